"""``waltz local``: every command through the real CLI, and the failures it must report cleanly.

Each test that starts a cluster stops it in a ``finally`` (by the pids in cluster.json) and checks that no
process whose command line mentions its directory survives.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from waltz import local
from waltz.client.config import ClientConfig
from waltz.cluster import zkserver
from waltz.errors import ClusterError
from waltz.local import procs
from waltz.local.state import LocalCluster

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def waltz(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "waltz.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def processes_mentioning(path: Path) -> list[str]:
    """Command lines of live processes that mention ``path`` (storage/server configs, zoo.cfg)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(path) in cmdline and procs.start_ticks(int(proc.name)) is not None:
            found.append(f"{proc.name}: {cmdline[:200]}")
    return found


@pytest.fixture
def cluster_dir(tmp_path: Path) -> Iterator[Path]:
    directory = tmp_path / "cluster"
    try:
        yield directory
    finally:
        if (directory / "cluster.json").exists():
            local.down(directory)
        assert processes_mentioning(directory) == []


@pytest.mark.timeout(240)
def test_up_status_kill_start_down(cluster_dir: Path) -> None:
    d = str(cluster_dir)
    up = waltz("local", "up", "--dir", d, "--storages", "3", "--servers", "2", "--partitions", "2")
    assert up.returncode == 0, up.stderr
    assert "storage 2" in up.stdout
    assert "client config" in up.stdout
    cluster = LocalCluster.load(cluster_dir)
    assert cluster.state == "running"
    assert all(procs.is_alive(p.process) for p in cluster.processes)
    assert all(s.partitions == [0, 1] for s in cluster.storages)  # one group per node: full replication
    assert (cluster_dir / "logs" / "server-1.log").exists()
    config = ClientConfig.from_yaml(cluster_dir / "client.yaml")
    assert config.cluster_root == "/waltz/local"

    st = waltz("local", "status", "--dir", d, "--json")
    assert st.returncode == 0, st.stdout + st.stderr
    status = json.loads(st.stdout)
    assert all(p["running"] for p in status["processes"])
    assert [p["healthy"] for p in status["partitions"]] == [True, True]
    assert all(len(p["replicas"]) == 3 for p in status["partitions"])

    # The tools against the real cluster.
    val = waltz("client", "validate", "-c", str(cluster_dir / "client.yaml"), "--txns-per-client", "15")
    assert val.returncode == 0, val.stdout + val.stderr
    hwm = waltz("client", "high-water-mark", "-c", str(cluster_dir / "client.yaml"), "-p", "0")
    assert hwm.returncode == 0
    assert int(hwm.stdout) >= -1
    text = waltz("local", "status", "--dir", d).stdout
    assert "partition" in text
    assert "storage 0:" in text

    old_pid = cluster.storages[1].pid
    kill = waltz("local", "kill", "--dir", d, "--storage", "1")
    assert kill.returncode == 0, kill.stderr
    assert not procs.is_alive(cluster.storages[1].process)
    down_status = waltz("local", "status", "--dir", d)
    assert down_status.returncode == 3
    assert "DOWN" in down_status.stdout
    again = waltz("local", "kill", "--dir", d, "--storage", "1")
    assert again.returncode == 1
    assert "storage 1 is not running" in again.stderr

    start = waltz("local", "start", "--dir", d, "--storage", "1")
    assert start.returncode == 0, start.stderr
    restarted = LocalCluster.load(cluster_dir).storages[1]
    assert restarted.pid != old_pid
    assert procs.is_alive(restarted.process)
    twice = waltz("local", "start", "--dir", d, "--storage", "1")
    assert twice.returncode == 1
    assert "already running" in twice.stderr

    assert waltz("local", "kill", "--dir", d, "--server", "0").returncode == 0
    assert waltz("local", "start", "--dir", d, "--server", "0").returncode == 0
    missing = waltz("local", "kill", "--dir", d, "--storage", "7")
    assert missing.returncode == 2
    assert "there is no storage 7" in missing.stderr

    second = waltz("local", "up", "--dir", d)
    assert second.returncode == 2
    assert "already holds a running cluster" in second.stderr

    down = waltz("local", "down", "--dir", d)
    assert down.returncode == 0, down.stderr
    assert "zookeeper" in down.stdout
    final = LocalCluster.load(cluster_dir)
    assert not any(procs.is_alive(p.process) for p in final.processes)
    assert processes_mentioning(cluster_dir) == []
    assert waltz("local", "down", "--dir", d).stdout.strip() == "nothing was running"
    reuse = waltz("local", "up", "--dir", d)
    assert reuse.returncode == 2
    assert "holds a stopped cluster's data" in reuse.stderr
    assert waltz("local", "start", "--dir", d, "--server", "0").returncode == 1
    assert waltz("local", "down", "--dir", d, "--purge").returncode == 0
    assert not cluster_dir.exists()


@pytest.mark.timeout(60)
def test_a_port_in_use_is_reported_before_anything_starts(cluster_dir: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = waltz("local", "up", "--dir", str(cluster_dir), "--zk-port", str(port))
        assert result.returncode == 2
        assert f"port {port} (ZooKeeper client port) is already in use" in result.stderr
        ranged = waltz("local", "up", "--dir", str(cluster_dir), "--base-port", str(port - 2))
        assert ranged.returncode == 2
        assert f"port {port} (storage 0 HTTP port) is already in use" in ranged.stderr
    assert not (cluster_dir / "cluster.json").exists()


@pytest.mark.timeout(60)
def test_bad_options_are_refused(cluster_dir: Path) -> None:
    groups = waltz("local", "up", "--dir", str(cluster_dir), "--storages", "2", "--groups", "3")
    assert groups.returncode == 2
    assert "--groups must be between 1 and the number of storage nodes (2)" in groups.stderr
    none = waltz("local", "status", "--dir", str(cluster_dir))
    assert none.returncode == 2
    assert "holds no local cluster" in none.stderr


@pytest.mark.timeout(60)
def test_a_missing_zookeeper_package_is_reported(cluster_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zkserver, "ZOOKEEPER_JAR", cluster_dir / "nowhere" / "zookeeper.jar")
    with pytest.raises(ClusterError, match="apt-get install zookeeper"):
        local.up(local.UpOptions(directory=cluster_dir))
    assert not (cluster_dir / "cluster.json").exists()


@pytest.mark.timeout(120)
def test_a_process_dying_during_start_leaves_nothing_running(
    cluster_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from waltz.local import configs

    real = configs.server_config

    def broken(cluster: LocalCluster, rec: local.ProcessRecord) -> dict[str, object]:
        values = real(cluster, rec)
        if rec.index == 1:
            values["server.noSuchSetting"] = 1  # The server refuses its config and exits.
        return values

    monkeypatch.setattr(configs, "server_config", broken)
    with pytest.raises(procs.ProcessStartError, match="server 1 exited during start") as info:
        local.up(local.UpOptions(directory=cluster_dir, storages=2, servers=2, partitions=1))
    assert "noSuchSetting" in str(info.value)  # the log tail says why
    assert processes_mentioning(cluster_dir) == []
    assert not (cluster_dir / "cluster.json").exists()
    assert (cluster_dir / "logs" / "server-1.log").exists()  # kept for the post-mortem
    assert not (cluster_dir / "storage-0").exists()


@pytest.mark.timeout(240)
def test_zookeeper_restart_cluster_restart_and_purge_keeps_foreign_files(cluster_dir: Path) -> None:
    d = str(cluster_dir)
    up = waltz("local", "up", "--dir", d, "--storages", "1", "--servers", "1", "--partitions", "1")
    assert up.returncode == 0, up.stderr
    # Someone else's file appears in the directory after `up`.
    (cluster_dir / "notes.txt").write_text("mine")

    assert waltz("local", "kill", "--dir", d, "--server", "0").returncode == 0
    killed = waltz("local", "kill", "--dir", d, "--zookeeper")
    assert killed.returncode == 0, killed.stderr
    assert not procs.is_alive(LocalCluster.load(cluster_dir).zookeeper.process)
    needs_zk = waltz("local", "start", "--dir", d, "--server", "0")
    assert needs_zk.returncode == 1
    assert "start it first with `waltz local start" in needs_zk.stderr
    started = waltz("local", "start", "--dir", d, "--zookeeper")
    assert started.returncode == 0, started.stderr
    assert waltz("local", "start", "--dir", d, "--server", "0").returncode == 0
    assert procs.is_alive(LocalCluster.load(cluster_dir).zookeeper.process)
    again = waltz("local", "start", "--dir", d, "--zookeeper")
    assert again.returncode == 1
    assert "zookeeper is already running" in again.stderr
    # The cluster's metadata survived in ZooKeeper's data directory: the partition is served again.
    deadline = time.monotonic() + 60
    while waltz("local", "status", "--dir", d).returncode != 0:
        assert time.monotonic() < deadline, "the cluster did not recover after ZooKeeper restarted"
        time.sleep(1)

    before = {p.name: p.pid for p in LocalCluster.load(cluster_dir).processes}
    restarted = waltz("local", "restart", "--dir", d)
    assert restarted.returncode == 0, restarted.stderr
    after = LocalCluster.load(cluster_dir)
    assert after.state == "running"
    assert all(procs.is_alive(p.process) and p.pid != before[p.name] for p in after.processes)
    assert waltz("local", "status", "--dir", d).returncode == 0
    # A stopped cluster starts again with `restart`.
    assert waltz("local", "down", "--dir", d).returncode == 0
    assert waltz("local", "restart", "--dir", d).returncode == 0
    assert waltz("local", "status", "--dir", d).returncode == 0

    purged = waltz("local", "down", "--dir", d, "--purge")
    assert purged.returncode == 0, purged.stderr
    assert "kept" in purged.stdout
    assert "notes.txt" in purged.stdout
    assert sorted(p.name for p in cluster_dir.iterdir()) == ["notes.txt"]
    # A non-empty directory that holds no cluster of ours is refused.
    refused = waltz("local", "up", "--dir", d)
    assert refused.returncode == 2
    assert "is not empty and holds no `waltz local` cluster (notes.txt)" in refused.stderr
    assert sorted(p.name for p in cluster_dir.iterdir()) == ["notes.txt"]


def test_an_even_or_oversized_ensemble_is_refused(cluster_dir: Path) -> None:
    for n in (0, 2, 4, 9):
        result = waltz("local", "up", "--dir", str(cluster_dir), "--zookeepers", str(n))
        assert result.returncode == 2
        assert "--zookeepers must be 1 or an odd number up to 7" in result.stderr
    assert not cluster_dir.exists()


@pytest.mark.timeout(300)
def test_an_ensemble_with_tls_on_its_quorum_links(cluster_dir: Path) -> None:
    d = str(cluster_dir)
    up = waltz(
        "local", "up", "--dir", d, "--zookeepers", "3", "--tls",
        "--storages", "2", "--servers", "1", "--partitions", "2",
    )  # fmt: skip
    assert up.returncode == 0, up.stderr
    assert "3-member ensemble" in up.stderr
    cluster = LocalCluster.load(cluster_dir)
    assert [z.name for z in cluster.zookeepers] == ["zookeeper 0", "zookeeper 1", "zookeeper 2"]
    assert cluster.zk_connect == ",".join(f"127.0.0.1:{z.port}" for z in cluster.zookeepers)
    assert ClientConfig.from_yaml(cluster_dir / "client.yaml").zookeeper_connect_string == cluster.zk_connect
    for z in cluster.zookeepers:
        zoo_cfg = (Path(z.data_dir) / "zoo.cfg").read_text()
        assert "sslQuorum=true" in zoo_cfg
        assert f"server.{z.index + 1}=127.0.0.1:{z.quorum_port}:{z.election_port}" in zoo_cfg
        assert (Path(z.data_dir) / "data" / "myid").read_text() == f"{z.index + 1}\n"
    logs = "".join(Path(z.log).read_text() for z in cluster.zookeepers)
    assert "Using TLS encrypted quorum communication" in logs
    assert "SSL handshake complete" in logs  # the members did talk TLS to each other

    # One member killed: the other two keep the quorum and the cluster serves on.
    killed = waltz("local", "kill", "--dir", d, "--zookeeper", "1")
    assert killed.returncode == 0, killed.stderr
    assert "killed zookeeper 1" in killed.stdout
    st = waltz("local", "status", "--dir", d, "--json")
    assert st.returncode == 3  # a process is down...
    status = json.loads(st.stdout)
    assert all(p["healthy"] for p in status["partitions"])  # ...but every partition is served
    assert waltz("local", "start", "--dir", d, "--zookeeper", "1").returncode == 0
    assert waltz("local", "status", "--dir", d).returncode == 0
    # The whole ensemble stopped and started again: its data, hence the cluster, survives.
    assert waltz("local", "down", "--dir", d).returncode == 0
    restarted = waltz("local", "restart", "--dir", d)
    assert restarted.returncode == 0, restarted.stderr
    assert waltz("local", "status", "--dir", d).returncode == 0
    assert waltz("local", "down", "--dir", d, "--purge").returncode == 0
