"""ZooKeeper value codecs: golden bytes, round trips, strict decoding (REFERENCE §6.1)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from waltz.cluster.cluster_params import ClusterParams
from waltz.cluster.codec import Reader, decode_modified_utf8, encode_modified_utf8
from waltz.cluster.connection_metadata import ConnectionMetadata
from waltz.cluster.counter import decode_counter, encode_counter
from waltz.cluster.group_descriptor import GroupDescriptor
from waltz.cluster.partition_assignment import PartitionAssignment
from waltz.cluster.replica_assignments import ReplicaAssignments
from waltz.cluster.server_descriptor import ServerDescriptor
from waltz.cluster.store_params import StoreParams
from waltz.errors import MetadataError

KEY = uuid.UUID("00112233-4455-6677-8899-aabbccddeeff")

GOLDEN: list[tuple[Any, Callable[[bytes], Any], str]] = [
    (ClusterParams("c1", 3), ClusterParams.decode, "b4e87347 01 0002 6331 00000003"),
    (StoreParams(KEY, 4), StoreParams.decode, "01 00112233445566778899aabbccddeeff 00000004"),
    (
        ReplicaAssignments({"b:2": [1], "a:1": [2, 0]}),
        ReplicaAssignments.decode,
        "01 00000002 0003 613a31 00000002 00000000 00000002 0003 623a32 00000001 00000001",
    ),
    (
        GroupDescriptor({"a:1": 0, "b:2": 1}),
        GroupDescriptor.decode,
        "01 00000002 0003 613a31 00000000 0003 623a32 00000001",
    ),
    (ConnectionMetadata({"a:1": 7001}), ConnectionMetadata.decode, "01 00000001 0003 613a31 00001b59"),
    (
        ServerDescriptor(5, "h", 80, (3, 1)),
        ServerDescriptor.decode,
        "01 00000005 0001 68 00000050 00000002 00000001 00000003",
    ),
    (
        PartitionAssignment(7, 2, {2: {1: 4}, 1: {0: 1}}),
        PartitionAssignment.decode,
        "03 00000007 00000002 00000002"
        " 00000001 00000001 00000000 00000001"
        " 00000002 00000001 00000001 00000004",
    ),
]


@pytest.mark.parametrize(("value", "decode", "golden"), GOLDEN, ids=lambda v: type(v).__name__)
def test_golden_bytes(value: Any, decode: Callable[[bytes], Any], golden: str) -> None:
    raw = value.encode()
    assert raw.hex() == golden.replace(" ", "")
    assert decode(raw).encode() == raw


@pytest.mark.parametrize(("value", "decode", "golden"), GOLDEN, ids=lambda v: type(v).__name__)
def test_truncated_trailing_and_bad_version_are_metadata_errors(
    value: Any, decode: Callable[[bytes], Any], golden: str
) -> None:
    raw = value.encode()
    for cut in range(len(raw)):
        with pytest.raises(MetadataError):
            decode(raw[:cut])
    with pytest.raises(MetadataError):
        decode(raw + b"\x00")
    # The version byte is the first byte, except for ClusterParams where the magic comes first.
    at = 4 if isinstance(value, ClusterParams) else 0
    with pytest.raises(MetadataError):
        decode(raw[:at] + b"\x09" + raw[at + 1 :])


def test_round_trip_values_equal() -> None:
    assert ReplicaAssignments.decode(ReplicaAssignments({"a:1": [2, 0]}).encode()).replicas == {"a:1": [0, 2]}
    pa = PartitionAssignment(7, 2, {2: {1: 4}, 1: {0: 1}})
    assert PartitionAssignment.decode(pa.encode()) == pa
    assert pa.generations() == {0: 1, 1: 4}
    assert pa.owner_of(1) == 2
    assert ServerDescriptor.decode(ServerDescriptor(5, "h", 80, (3, 1)).encode()).preferred_partitions == (
        1,
        3,
    )


def test_counter() -> None:
    assert encode_counter(258).hex() == "0100000102"
    assert decode_counter(encode_counter(41)) == 41
    with pytest.raises(MetadataError):
        decode_counter(b"\x01\x00")


def test_cluster_params_bad_magic_and_count() -> None:
    raw = ClusterParams("x", 1).encode()
    with pytest.raises(MetadataError, match="magic"):
        ClusterParams.decode(b"\x00" + raw[1:])
    with pytest.raises(MetadataError):
        ClusterParams.decode(ClusterParams("x", 0).encode())


def test_modified_utf8_matches_java() -> None:
    # Java writes NUL as C0 80 and a supplementary character as two 3-byte surrogates.
    assert encode_modified_utf8("\x00") == b"\xc0\x80"
    assert encode_modified_utf8("\U0001f600") == bytes.fromhex("eda0bdedb880")
    assert encode_modified_utf8("é") == "é".encode()
    with pytest.raises(MetadataError):
        decode_modified_utf8(b"\x00")
    with pytest.raises(MetadataError):
        decode_modified_utf8(b"\xe0\x80")


@given(st.text(max_size=50))
def test_modified_utf8_round_trip(text: str) -> None:
    assert decode_modified_utf8(encode_modified_utf8(text)) == text


@given(st.binary(max_size=64))
def test_decoders_raise_only_metadata_error(raw: bytes) -> None:
    for _, decode, _ in GOLDEN:
        try:
            decode(raw)
        except MetadataError:
            pass


def test_reader_rejects_negative_counts() -> None:
    with pytest.raises(MetadataError, match="count"):
        Reader(b"\xff\xff\xff\xff", "x").count()
