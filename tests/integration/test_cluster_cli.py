"""``waltz cluster ...`` end to end against a real ZooKeeper, including every error case."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from kazoo.client import KazooClient

from waltz.cli.main import main
from waltz.cluster import store_metadata as sm
from waltz.cluster.zkserver import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

ROOT = "/waltz/cli"


def _config(tmp_path: Path, connect_string: str, root: str = ROOT, name: str = "cli.yaml") -> str:
    path = tmp_path / name
    path.write_text(
        f"zookeeper:\n  connectString: {connect_string}\n  sessionTimeout: 4000\n  connectTimeout: 1500\n"
        f"cluster.root: {root}\n",
        encoding="utf-8",
    )
    return str(path)


@pytest.fixture
def cfg(tmp_path: Path, zk_connect_string: str) -> str:
    return _config(tmp_path, zk_connect_string)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse usage errors
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def _one_line_error(err: str, needle: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines, "expected an error message"
    assert needle in lines[-1], lines
    assert "Traceback" not in err


def test_full_workflow(capsys: pytest.CaptureFixture[str], cfg: str, zk: KazooClient) -> None:
    assert run(capsys, "cluster", "create", "-c", cfg, "--name", "demo", "--partitions", "8")[0] == 0
    code, out, _ = run(capsys, "cluster", "show-cluster-key", "-c", cfg)
    assert code == 0
    assert out.strip() == str(sm.read_store_params(zk, ROOT).cluster_key)

    for i, group in ((1, 0), (2, 0), (3, 1)):
        argv = ["--storage", f"s{i}:500{i}", "--admin-port", f"600{i}", "--group", str(group)]
        code, out, err = run(capsys, "cluster", "add-storage-node", "-c", cfg, *argv)
        assert code == 0, err
    assert (
        run(capsys, "cluster", "assign-partition", "-c", cfg, "--partition", "0-6,7", "--storage", "s1:5001")[
            0
        ]
        == 0
    )
    assert run(capsys, "cluster", "assign-partition", "-c", cfg, "-p", "0-1", "-s", "s2:5002")[0] == 0
    code, out, _ = run(capsys, "cluster", "auto-assign", "-c", cfg, "--group", "1")
    assert (code, out) == (0, "s3:5003: 0-7\n")
    assert run(capsys, "cluster", "unassign-partition", "-c", cfg, "-p", "0", "-s", "s2:5002")[0] == 0
    assert sm.read_replica_assignments(zk, ROOT).replicas == {
        "s1:5001": list(range(8)), "s2:5002": [1], "s3:5003": list(range(8)),
    }  # fmt: skip

    code, out, _ = run(capsys, "cluster", "list", "-c", cfg)
    assert code == 0
    assert "cluster name: demo" in out
    assert "number of partitions: 8" in out
    assert "s2:5002 group 0 admin port 6002: partitions 1" in out
    assert "partition 7: generation 0 session -1" in out

    assert run(capsys, "cluster", "unassign-partition", "-c", cfg, "-p", "1", "-s", "s2:5002")[0] == 0
    assert run(capsys, "cluster", "remove-storage-node", "-c", cfg, "--storage", "s2:5002")[0] == 0
    assert "s2:5002" not in sm.read_group_descriptor(zk, ROOT).groups
    assert run(capsys, "cluster", "delete", "-c", cfg, "--name", "demo")[0] == 0
    assert zk.exists(ROOT) is None


def test_refused_edits_are_one_line_errors(
    capsys: pytest.CaptureFixture[str], cfg: str, zk: KazooClient
) -> None:
    sm.create_cluster(zk, ROOT, "demo", 4)
    sm.add_storage_node(zk, ROOT, "s1:1", 0, 2)
    sm.assign_partitions(zk, ROOT, "s1:1", range(4))
    cases = [
        (("create", "--name", "demo", "--partitions", "4"), "already exists"),
        (("delete", "--name", "other"), "named 'demo'"),
        (("remove-storage-node", "--storage", "s1:1"), "still holds partitions 0-3"),
        (("unassign-partition", "-p", "2", "-s", "s1:1"), "last copy"),
        (("assign-partition", "-p", "2", "-s", "s1:1"), "already assigned"),
        (("assign-partition", "-p", "1", "-s", "s9:1"), "not in the cluster"),
        (("add-storage-node", "-s", "s1:1", "-a", "3", "-g", "0"), "already in the cluster"),
        (("auto-assign", "-g", "0"), "already has assignments"),
        (("auto-assign", "-g", "5"), "no storage nodes"),
    ]
    for argv, needle in cases:
        code, _, err = run(capsys, "cluster", argv[0], "-c", cfg, *argv[1:])
        assert code == 1, (argv, err)
        _one_line_error(err, needle)
    # Out-of-range and malformed ranges are configuration errors (exit 2).
    for ranges, needle in (
        ("4", "out of range"),
        ("3-1", "bad partition range"),
        ("x", "bad partition range"),
    ):
        code, _, err = run(capsys, "cluster", "assign-partition", "-c", cfg, "-p", ranges, "-s", "s1:1")
        assert code == 2
        _one_line_error(err, needle)
    # Force deletes whatever the name.
    assert run(capsys, "cluster", "delete", "-c", cfg, "--force")[0] == 0
    assert zk.exists(ROOT) is None


def test_missing_cluster(capsys: pytest.CaptureFixture[str], cfg: str) -> None:
    for argv in (
        ("list",),
        ("show-cluster-key",),
        ("delete", "--name", "x"),
        ("add-storage-node", "-s", "a:1", "-a", "2", "-g", "0"),
        ("remove-storage-node", "-s", "a:1"),
        ("assign-partition", "-p", "0", "-s", "a:1"),
        ("unassign-partition", "-p", "0", "-s", "a:1"),
        ("auto-assign", "-g", "0"),
    ):
        code, _, err = run(capsys, "cluster", argv[0], "-c", cfg, *argv[1:])
        assert code == 1, argv
        _one_line_error(err, f"no cluster at {ROOT}")


def test_bad_arguments(capsys: pytest.CaptureFixture[str], cfg: str, tmp_path: Path) -> None:
    for argv in (
        ("create", "--name", "x", "--partitions", "0"),
        ("create", "--name", "x", "--partitions", "many"),
        ("create", "--name", "x"),
        ("add-storage-node", "-s", "nocolon", "-a", "1", "-g", "0"),
        ("add-storage-node", "-s", "a:1", "-a", "1", "-g", "-1"),
    ):
        code, _, err = run(capsys, "cluster", argv[0], "-c", cfg, *argv[1:])
        assert code == 2, argv
        assert "Traceback" not in err
    code, _, err = run(capsys, "cluster", "list")
    assert code == 2
    assert "--cli-config-path" in err
    code, _, err = run(capsys, "cluster", "list", "-c", str(tmp_path / "missing.yaml"))
    assert code == 2
    _one_line_error(err, "cannot read config file")
    bad = tmp_path / "bad.yaml"
    bad.write_text("zookeeper.connectString: a:1\n", encoding="utf-8")
    code, _, err = run(capsys, "cluster", "list", "-c", str(bad))
    assert code == 2
    _one_line_error(err, "cluster.root: required but missing")
    code, _, err = run(capsys, "cluster", "delete", "-c", cfg)
    assert code == 2
    _one_line_error(err, "--name is required")


def test_unreachable_zookeeper_from_a_real_process(tmp_path: Path) -> None:
    cfg = _config(tmp_path, f"127.0.0.1:{free_port()}")
    proc = subprocess.run(
        [sys.executable, "-m", "waltz.cli.main", "cluster", "list", "-c", cfg],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().startswith("waltz: error: cannot connect to ZooKeeper at 127.0.0.1:")
    assert "no answer within 1500 ms" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
