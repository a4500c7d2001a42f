"""The backup file format (:mod:`waltz.ops.backup_format`): golden bytes, the manifest, and every way a file
can be wrong, each a BackupError naming the file (never another exception)."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest

from waltz.cli.backup import parse_to_transaction, reader_config
from waltz.errors import BackupError, ConfigError
from waltz.ops.backup_format import (
    MANIFEST_NAME,
    BackupManifest,
    FileHeader,
    PartitionEntry,
    PartitionFileWriter,
    check_chain,
    iter_blocks,
    manifest_sha256,
    read_manifest,
    verify_backup,
    write_manifest,
)
from waltz.protocol.record_run import encode_run
from waltz.protocol.records import ReqId, crc32, make_record

KEY = uuid.UUID("00112233-4455-6677-8899-aabbccddeeff")
RECORDS = [
    make_record(5, *ReqId.of(7, 1, 3, 1), 42, b"ab", crc32(b"ab")),
    make_record(6, *ReqId.of(7, 1, 3, 2), -1, b"", crc32(b"")),
]

# partition 3, ids 5..6: header (magic, version 1, flags 0, partition, key, first, last, CRC-32), one block of
# two records (count, length, the records as stored), the end marker (0, 0, record count).
GOLDEN = bytes.fromhex(
    "57414c545a42414b" "0001" "0000" "00000003" "00112233445566778899aabbccddeeff"
    "0000000000000005" "0000000000000006" "075f37f9"
    "00000002" "00000052"
    "0000000000000005" "0000000700000001" "0000000300000001" "0000002a" "00000002" "9e83486d"
    "6162" "1df9280d"
    "0000000000000006" "0000000700000001" "0000000300000002" "ffffffff" "00000000" "00000000" "1db1ca25"
    "00000000" "00000000" "0000000000000002"
)  # fmt: skip


def _write(directory: Path, partition: int = 3, first: int = 5) -> PartitionEntry:
    directory.mkdir(exist_ok=True)
    records = [r._replace(transaction_id=first + i) for i, r in enumerate(RECORDS)]
    path = directory / f"partition-{partition}.wbk"
    writer = PartitionFileWriter(path, FileHeader(partition, KEY, first, first + len(records) - 1))
    writer.add_run(first, len(records), encode_run(records))
    return writer.finish()


def _backup(directory: Path, parent: tuple[uuid.UUID, str] | None = None, first: int = 5) -> BackupManifest:
    entry = _write(directory, 0, first)
    manifest = BackupManifest(uuid.uuid4(), 1, "c", KEY, 1, parent, (entry,))
    write_manifest(directory, manifest)
    return manifest


def test_file_bytes_are_the_documented_layout(tmp_path: Path) -> None:
    entry = _write(tmp_path)
    assert (tmp_path / "partition-3.wbk").read_bytes() == GOLDEN
    assert entry.bytes == len(GOLDEN)
    blocks = list(iter_blocks(tmp_path / "partition-3.wbk"))
    assert [(b[1], b[2]) for b in blocks] == [(5, 2)]
    assert blocks[0][0] == FileHeader(3, KEY, 5, 6)


def test_manifest_round_trips_and_names_its_fields(tmp_path: Path) -> None:
    manifest = _backup(tmp_path / "b")
    raw = json.loads((tmp_path / "b" / MANIFEST_NAME).read_text())
    assert set(raw) == {
        "format",
        "version",
        "backup_id",
        "created_ms",
        "cluster_name",
        "cluster_key",
        "num_partitions",
        "parent",
        "partitions",
    }
    assert set(raw["partitions"][0]) == {
        "partition",
        "file",
        "first",
        "last",
        "bytes",
        "sha256",
        "trim_point",
    }
    assert read_manifest(tmp_path / "b") == manifest
    assert verify_backup(tmp_path / "b") == manifest
    # A manifest written before trim points were recorded reads as untrimmed.
    for entry in raw["partitions"]:
        del entry["trim_point"]
    (tmp_path / "b" / MANIFEST_NAME).write_text(json.dumps(raw))
    assert all(e.trim_point == 0 for e in read_manifest(tmp_path / "b").partitions)


def test_every_truncation_is_a_named_error(tmp_path: Path) -> None:
    path = tmp_path / "partition-3.wbk"
    for n in range(len(GOLDEN)):
        path.write_bytes(GOLDEN[:n])
        with pytest.raises(BackupError, match=str(path)):
            list(iter_blocks(path))
    path.write_bytes(GOLDEN + b"\0")
    with pytest.raises(BackupError, match="after the end marker"):
        list(iter_blocks(path))


def test_every_flipped_byte_is_found(tmp_path: Path) -> None:
    path = tmp_path / "partition-3.wbk"
    for i in range(len(GOLDEN)):
        damaged = bytearray(GOLDEN)
        damaged[i] ^= 0x40
        path.write_bytes(bytes(damaged))
        with pytest.raises(BackupError, match=str(path)):
            list(iter_blocks(path))


def test_a_file_that_does_not_match_the_manifest_is_named(tmp_path: Path) -> None:
    _backup(tmp_path / "b")
    data = tmp_path / "b" / "partition-0.wbk"
    data.write_bytes(data.read_bytes()[:-1] + b"\x01")
    with pytest.raises(BackupError, match=f"{data}: does not match"):
        verify_backup(tmp_path / "b")


def test_a_backup_without_manifest_is_partial(tmp_path: Path) -> None:
    _backup(tmp_path / "b")
    (tmp_path / "b" / MANIFEST_NAME).unlink()
    with pytest.raises(BackupError, match="a partial or interrupted backup"):
        read_manifest(tmp_path / "b")
    (tmp_path / "b" / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(BackupError, match="malformed backup manifest"):
        read_manifest(tmp_path / "b")


def test_chains_must_continue_one_cluster(tmp_path: Path) -> None:
    full = _backup(tmp_path / "full")
    incr = _backup(tmp_path / "incr", (full.backup_id, manifest_sha256(tmp_path / "full")), first=7)
    dirs = [tmp_path / "full", tmp_path / "incr"]
    check_chain(dirs, [full, incr])
    with pytest.raises(BackupError, match="is an incremental backup"):
        check_chain(dirs[1:], [incr])
    gap = _backup(tmp_path / "gap", (full.backup_id, manifest_sha256(tmp_path / "full")), first=9)
    with pytest.raises(BackupError, match="starts at 9, not 7"):
        check_chain([dirs[0], tmp_path / "gap"], [full, gap])
    other = BackupManifest(incr.backup_id, 1, "c", uuid.uuid4(), 1, incr.parent, incr.partitions)
    with pytest.raises(BackupError, match="another cluster"):
        check_chain(dirs, [full, other])
    shutil.copy(tmp_path / "incr" / MANIFEST_NAME, tmp_path / "full" / MANIFEST_NAME)
    with pytest.raises(BackupError, match="was changed after"):
        check_chain(dirs, [full, incr])


def test_an_empty_range_is_a_file_of_no_blocks(tmp_path: Path) -> None:
    path = tmp_path / "partition-0.wbk"
    entry = PartitionFileWriter(path, FileHeader(0, KEY, 4, 3)).finish()
    assert entry.records == 0
    assert list(iter_blocks(path, entry)) == []
    assert path.stat().st_size == 52 + 16


def test_to_transaction_takes_one_id_or_one_per_partition() -> None:
    assert parse_to_transaction(None, 3) is None
    assert parse_to_transaction("7", 3) == {0: 7, 1: 7, 2: 7}
    assert parse_to_transaction("0=5,2=-1", 3) == {0: 5, 2: -1}
    with pytest.raises(ConfigError, match="--to-transaction"):
        parse_to_transaction("0=x", 3)


def test_backup_reads_a_cli_config_or_a_client_config(tmp_path: Path) -> None:
    cli = tmp_path / "cli.yaml"
    cli.write_text("zookeeper.connectString: h:1\nzookeeper.connectTimeout: 5000\ncluster.root: /c\n")
    config = reader_config(str(cli), 1234)
    assert (config.zookeeper_connect_string, config.cluster_root) == ("h:1", "/c")
    assert config.request_timeout_ms == 1234
    client = tmp_path / "client.yaml"
    client.write_text("zookeeper.connectString: h:2\nzookeeper.sessionTimeout: 9000\ncluster.root: /d\n")
    assert reader_config(str(client), 5).zookeeper_session_timeout_ms == 9000
    client.write_text("zookeeper.connectString: h:2\ncluster.root: /d\nclient.nonsense: 1\n")
    with pytest.raises(ConfigError, match=r"client\.nonsense"):
        reader_config(str(client), 5)
