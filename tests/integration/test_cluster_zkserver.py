"""The ZooKeeper launcher: standalone start/stop by pid, a 3-node ensemble surviving a member's crash."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from waltz.cluster import store_metadata as sm
from waltz.cluster import zk as zkutil
from waltz.cluster import zkserver
from waltz.cluster.zkserver import ZooKeeperEnsemble, ZooKeeperServer, four_letter_word
from waltz.errors import ClusterError
from waltz.local import procs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_standalone_starts_answers_and_stops_by_pid(tmp_path: Path) -> None:
    server = ZooKeeperServer(tmp_path / "zk")
    with server:
        assert four_letter_word(server.host, server.port, "ruok") == "imok"
        pid = server.pid
        assert pid is not None
        text = server.config_path.read_text(encoding="ascii")
        assert "admin.enableServer=false" in text
        assert "clientPortAddress=127.0.0.1" in text
    assert server.process is not None
    assert server.process.returncode is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert server.log_path.exists()
    server.stop()  # Idempotent.


_OWNER_SCRIPT = """
import sys, time
from waltz.cluster.zkserver import ZooKeeperServer
server = ZooKeeperServer(sys.argv[1], die_with_parent=sys.argv[2] == "1").start()
print(server.pid, flush=True)
time.sleep(600)
"""


def _zookeeper_of_killed_owner(tmp_path: Path, die_with_parent: bool) -> procs.ProcessId:
    """Start a ZooKeeper from a child Python process, kill that process with SIGKILL (no cleanup runs) and
    return the ZooKeeper's process."""
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER_SCRIPT, str(tmp_path / "zk"), "1" if die_with_parent else "0"],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert owner.stdout is not None
        line = owner.stdout.readline()
        assert line.strip().isdigit(), f"the owner printed {line!r}"
        return procs.identify(int(line))  # while its owner still runs: it cannot have died yet
    finally:
        owner.kill()
        owner.wait(10)
        if owner.stdout is not None:
            owner.stdout.close()


def test_a_throwaway_server_dies_with_its_killed_owner(tmp_path: Path) -> None:
    zk = _zookeeper_of_killed_owner(tmp_path, die_with_parent=True)
    try:
        assert procs.wait_gone(zk, 10), "the ZooKeeper outlived the process that started it"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(zk.pid, signal.SIGKILL)


def test_a_local_cluster_server_outlives_its_starter(tmp_path: Path) -> None:
    # The default (``waltz local up``): the ZooKeeper must outlive the command that started it.
    zk = _zookeeper_of_killed_owner(tmp_path, die_with_parent=False)
    try:
        assert not procs.wait_gone(zk, 1.5), "the ZooKeeper died with the process that started it"
    finally:
        os.kill(zk.pid, signal.SIGKILL)


def test_missing_zookeeper_gives_install_hint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zkserver, "ZOOKEEPER_JAR", tmp_path / "nope.jar")
    with pytest.raises(ClusterError, match="apt-get install zookeeper"):
        ZooKeeperServer(tmp_path / "zk").start()


def test_ensemble_survives_one_member_crash(tmp_path: Path) -> None:
    with ZooKeeperEnsemble(tmp_path / "ens", 3, die_with_parent=True) as ensemble:
        modes = [four_letter_word(s.host, s.port, "srvr") for s in ensemble.servers]
        assert sum("Mode: leader" in m for m in modes) == 1
        client = zkutil.connect(ensemble.connect_string, session_timeout_ms=6000)
        try:
            sm.create_cluster(client, "/ens", "e", 2)
            leader = next(s for s, m in zip(ensemble.servers, modes, strict=True) if "Mode: leader" in m)
            leader.kill()
            # The remaining two still form a quorum: calls fail (ClusterError) during the re-election, then
            # reads and writes work again on the same session.
            deadline = time.monotonic() + 30
            while True:
                try:
                    assert sm.next_id(client, "/ens", "server") >= 1  # A lost reply may skip an id.
                    break
                except ClusterError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            assert sm.read_cluster_params(client, "/ens").name == "e"
        finally:
            zkutil.close(client)
