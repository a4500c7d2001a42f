"""StorageConfig: defaults, dotted and nested keys, and one clear error per bad file."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from waltz.errors import ConfigError
from waltz.storage.config import StorageConfig

KEY = "3e1d2c4b-5a69-4788-8796-a5b4c3d2e1f0"
BASE = {
    "storage.port": 5000,
    "storage.admin.port": 5001,
    "storage.directory": "/data/waltz",
    "storage.cluster.key": KEY,
    "storage.cluster.numPartitions": 4,
}


def test_defaults_follow_the_original() -> None:
    c = StorageConfig.from_mapping(dict(BASE))
    assert (c.port, c.admin_port, c.http_port) == (5000, 5001, 0)
    assert c.directory == Path("/data/waltz")
    assert c.segment_size_threshold_bytes == 1_000_000_000
    assert c.segment_cache_capacity == 5
    assert c.segment_preallocate_bytes == 4 * 1024 * 1024
    off = StorageConfig.from_mapping({**BASE, "storage.segment.preallocateBytes": 0})
    assert off.segment_preallocate_bytes == 0
    assert c.cluster_key == uuid.UUID(KEY)
    assert c.num_partitions == 4
    assert c.zookeeper_connect == ""


def test_nested_yaml_is_the_same_as_dotted(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(
        "storage:\n  port: 5000\n  admin:\n    port: 5001\n  directory: /data/waltz\n"
        f"  segment.size.threshold: 4096\n  cluster:\n    key: {KEY}\n    numPartitions: 4\n",
        encoding="utf-8",
    )
    c = StorageConfig.load(path)
    assert (c.port, c.admin_port, c.segment_size_threshold_bytes) == (5000, 5001, 4096)


def test_zookeeper_identity_needs_a_cluster_root() -> None:
    values = {k: v for k, v in BASE.items() if "cluster" not in k}
    with pytest.raises(ConfigError, match=r"cluster\.root is required"):
        StorageConfig.from_mapping({**values, "zookeeper.connectString": "127.0.0.1:2181"})
    c = StorageConfig.from_mapping({**values, "zookeeper.connectString": "zk:2181", "cluster.root": "/w"})
    assert (c.zookeeper_connect, c.cluster_root, c.cluster_key) == ("zk:2181", "/w", None)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"storage.prot": 1}, "unknown key 'storage.prot' (did you mean 'storage.port'?)"),
        ({"storage.admin.port": 5000}, "ports must be distinct"),
        ({"storage.http.port": 5001}, "ports must be distinct"),
        ({"storage.port": 70000}, "must be at most 65535"),
        ({"storage.port": "x"}, "expected an integer"),
        ({"storage.cluster.key": "nope"}, "not a UUID"),
        ({"storage.segment.size.threshold": 10}, "must be at least"),
        ({"storage.cluster.numPartitions": 0}, "storage.cluster.key and storage.cluster.numPartitions"),
        ({"storage.directory": None}, "storage.directory"),
        ({"storage.maxSessionIdStep": 0}, "must be at least 1"),
        ({"storage.segment.preallocateBytes": 4096}, "must be 0 (off) or between 65536 and 1073741824"),
        ({"storage.segment.preallocateBytes": -1}, "must be 0 (off) or between"),
        ({"storage.segment.preallocateBytes": 1 << 31}, "must be 0 (off) or between"),
    ],
)
def test_bad_values(change: dict[str, object], message: str) -> None:
    values = {**BASE, **change}
    if change.get("storage.directory", 1) is None:
        del values["storage.directory"]
    with pytest.raises(ConfigError) as info:
        StorageConfig.from_mapping(values)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "cannot read config file"),
        ("storage.port: [1\n", "not valid YAML at line 2, column 1"),
        ("a: b\n  c: d\n", "not valid YAML at line 2"),
        ("- 1\n- 2\n", "expected a mapping"),
    ],
)
def test_bad_files_give_one_line(tmp_path: Path, text: str | None, message: str) -> None:
    path = tmp_path / "s.yaml"
    if text is not None:
        path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        StorageConfig.load(path)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_syncfs_min_files_defaults_to_4_and_0_turns_it_off() -> None:
    assert StorageConfig.from_mapping(dict(BASE)).syncfs_min_files == 4
    assert StorageConfig.from_mapping({**BASE, "storage.fsync.syncfsMinFiles": 0}).syncfs_min_files == 0
    nested = {**BASE, "storage": {"fsync": {"syncfsMinFiles": 16}}}
    nested.update(dict(BASE.items()))
    with pytest.raises(ConfigError, match=r"storage\.fsync\.syncfsMinFiles"):
        StorageConfig.from_mapping({**BASE, "storage.fsync.syncfsMinFiles": -1})
