"""PartitionMetadata: golden bytes and strict decoding."""

import pytest

from waltz.cluster.partition_metadata import UNRESOLVED, PartitionMetadata, ReplicaState
from waltz.errors import MetadataError


def test_golden_bytes_and_round_trip() -> None:
    md = PartitionMetadata(2, 7, {"h:1": ReplicaState("h:1", 7, UNRESOLVED)})
    raw = md.encode(partition_id=3)
    assert raw == bytes.fromhex(
        "01 00000002 0000000000000007 00000001 01 01 00000003 0003 683a31 0000000000000007 8000000000000000"
    )
    assert PartitionMetadata.decode(raw) == md


def test_empty_metadata() -> None:
    md = PartitionMetadata()
    assert PartitionMetadata.decode(md.encode(0)) == md


def test_malformed_is_metadata_error() -> None:
    raw = PartitionMetadata(1, 1, {"a:1": ReplicaState("a:1", 1, 5)}).encode(0)
    for bad in (raw[:-1], raw + b"\x00", b"\x02" + raw[1:], b""):
        with pytest.raises(MetadataError):
            PartitionMetadata.decode(bad)
