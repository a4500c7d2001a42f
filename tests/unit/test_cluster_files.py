"""waltz.cluster.files: what Waltz lays out for ZooKeeper and ``waltz local`` is written durably and whole."""

from __future__ import annotations

import stat
from pathlib import Path

from waltz.cluster.files import mkdir_durable, write_durable
from waltz.cluster.zkserver import ZooKeeperServer


def test_mkdir_durable_makes_missing_parents_and_says_so(tmp_path: Path) -> None:
    assert mkdir_durable(tmp_path / "a" / "b")
    assert (tmp_path / "a" / "b").is_dir()
    assert not mkdir_durable(tmp_path / "a" / "b")


def test_write_durable_replaces_whole_with_the_mode_asked(tmp_path: Path) -> None:
    target = tmp_path / "f"
    target.write_bytes(b"old contents that are longer")
    write_durable(target, b"new", mode=0o600)
    assert target.read_bytes() == b"new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]  # nothing left aside


def test_zookeeper_directory_is_laid_out_with_durable_files(tmp_path: Path) -> None:
    zk = ZooKeeperServer(tmp_path / "zk", 12345, server_id=2, peers=[(2, 1, 2)])
    zk.write_config()
    assert "dataDir=" in zk.config_path.read_text()
    assert (tmp_path / "zk" / "data" / "myid").read_text() == "2\n"
    assert not list((tmp_path / "zk").glob("*.tmp"))
