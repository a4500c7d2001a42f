"""Every versioned format refuses a version it does not know, with an error naming the file (or znode) and
both versions, and never as damage: segment and index files, the control file, backup files and manifests,
ZooKeeper values, and the cluster's feature version."""

from __future__ import annotations

import json
import os
import struct
import uuid
from pathlib import Path
from typing import Any

import pytest

from waltz.cluster import features as ft
from waltz.cluster.server_descriptor import ServerDescriptor
from waltz.errors import BackupError, CorruptionError, FeatureVersionError, FormatVersionError, MetadataError
from waltz.ops import backup_format as bf
from waltz.storage.controlfile import CONTROL_FILE_NAME, ControlFile
from waltz.storage.fileio import OS_FS
from waltz.storage.segment import Segment, data_file_name, index_file_name
from waltz.version import __version__

KEY = uuid.UUID("00112233-4455-6677-8899-aabbccddeeff")


def _set_version(path: str, fmt: str, version: int) -> None:
    """Overwrite the leading version field of ``path``."""
    with open(path, "r+b") as f:
        f.write(struct.pack(fmt, version))


def test_a_newer_control_file_is_refused_naming_the_file_and_both_versions(tmp_path: Path) -> None:
    ControlFile.open_or_create(str(tmp_path), KEY, 2).close()
    path = os.path.join(tmp_path, CONTROL_FILE_NAME)
    before = Path(path).read_bytes()
    _set_version(path, ">i", 7)
    with pytest.raises(FormatVersionError) as e:
        ControlFile.open_or_create(str(tmp_path), KEY, 2)
    assert not isinstance(e.value, CorruptionError)
    message = str(e.value)
    assert path in message
    assert "format version 7" in message
    assert "versions 0 and 1" in message
    assert __version__ in message
    assert Path(path).read_bytes()[4:] == before[4:]  # nothing was changed


@pytest.mark.parametrize("which", ["data", "index"])
def test_a_newer_segment_or_index_is_refused_not_treated_as_damage(tmp_path: Path, which: str) -> None:
    Segment.create(OS_FS, str(tmp_path), KEY, 3, 0).close()
    name = data_file_name(0) if which == "data" else index_file_name(0)
    path = os.path.join(tmp_path, name)
    _set_version(path, ">i", 1)
    with pytest.raises(FormatVersionError) as e:
        Segment.open(OS_FS, str(tmp_path), 0, key=KEY, partition_id=3, writable=True, recover=True)
    assert not isinstance(e.value, CorruptionError)
    assert path in str(e.value)
    assert "segment format version 1, " in str(e.value)
    assert "reads version 0" in str(e.value)


def test_a_newer_backup_file_and_manifest_are_refused(tmp_path: Path) -> None:
    raw = bytearray(bf.FileHeader(0, KEY, 0, 9).encode())
    assert bf.FileHeader.decode(bytes(raw), tmp_path / "p.wbk").last == 9
    head = bytes(raw[: bf._HEADER.size])
    raw[8:10] = b"\x00\x02"  # the u16 version after the 8-byte magic
    raw[bf._HEADER.size :] = bf._HEADER_CRC.pack(bf.crc32(bytes(raw[: bf._HEADER.size])))
    assert bytes(raw[: bf._HEADER.size]) != head
    with pytest.raises(BackupError, match=r"p\.wbk: backup format version 2, .* reads version 1"):
        bf.FileHeader.decode(bytes(raw), tmp_path / "p.wbk")
    manifest = {"format": bf.FORMAT_NAME, "version": 2}
    with pytest.raises(BackupError, match=r"manifest.json: .* version 2; .* reads version 1"):
        bf.BackupManifest.from_json(json.dumps(manifest).encode(), tmp_path / "manifest.json")


def test_a_newer_zookeeper_value_is_refused_naming_both_versions() -> None:
    raw = bytearray(ServerDescriptor(1, "h", 2).encode())
    raw[0] = 2
    with pytest.raises(MetadataError, match=r"server descriptor: format version 2, .* reads version 1"):
        ServerDescriptor.decode(bytes(raw))
    with pytest.raises(MetadataError, match=r"/c/features: format version 2 .* reads version 1"):
        ft.decode_features(json.dumps({"format": "waltz-features", "version": 2}).encode(), "/c/features")
    with pytest.raises(MetadataError, match=r"/c/processes/server-1: format version 9"):
        ft.decode_process(
            json.dumps({"format": "waltz-process", "version": 9}).encode(), "/c/processes/server-1"
        )


def test_feature_and_process_values_round_trip() -> None:
    assert ft.decode_features(ft.encode_features(2)) == 2
    info = ft.ProcessInfo("server", "4", "0.2.0", ft.FeatureRange(1, 2), "h:1")
    assert ft.decode_process(ft.encode_process(info)) == info
    for bad in ([2, 1], [0, 1], [1], "1-2", [1, True]):
        value = json.loads(ft.encode_process(info))
        value["features"] = bad
        with pytest.raises(MetadataError, match="features must be"):
            ft.decode_process(json.dumps(value).encode())


class _FakeZk:
    """Just ``get`` of one znode (a unit test of one function; the integration tests use ZooKeeper)."""

    def __init__(self, values: dict[str, bytes]) -> None:
        self.values = values

    def get(self, path: str) -> tuple[bytes, Any]:
        from kazoo.exceptions import NoNodeError

        if path not in self.values:
            raise NoNodeError(path)
        return self.values[path], type("Stat", (), {"version": 3})()


def test_a_process_refuses_a_feature_version_it_does_not_support() -> None:
    assert ft.check_supported(_FakeZk({}), "/c", "this server") == 1  # type: ignore[arg-type]
    zk = _FakeZk({"/c/features": ft.encode_features(ft.SUPPORTED_FEATURES.hi + 1)})
    with pytest.raises(FeatureVersionError) as e:
        ft.check_supported(zk, "/c", "this storage node")  # type: ignore[arg-type]
    message = str(e.value)
    assert f"feature version is {ft.SUPPORTED_FEATURES.hi + 1}" in message
    assert "/c/features" in message
    assert f"supports feature versions {ft.SUPPORTED_FEATURES}" in message
    assert ft.read_feature_version(zk, "/c") == (ft.SUPPORTED_FEATURES.hi + 1, 3)  # type: ignore[arg-type]
