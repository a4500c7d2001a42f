"""TransactionBuilder: header, data, serializers, locks and the request it builds."""

from __future__ import annotations

import zlib

import pytest

from waltz import PartitionLocalLock, TransactionBuilder
from waltz.client.locks import lock_hash
from waltz.client.serializer import JsonSerializer, Utf8Serializer
from waltz.protocol.client_server import encode
from waltz.protocol.framing import FRAME_HEADER, MAGIC_CLIENT
from waltz.protocol.records import ReqId

REQ = ReqId.of(3, 1, 0, 42)


def test_defaults_build_an_empty_transaction() -> None:
    request = TransactionBuilder(0, 17).build(REQ)
    assert request.req_id == REQ
    assert request.client_high_water_mark == 17
    assert request.header == 0
    assert request.data == b""
    assert request.checksum == zlib.crc32(b"")
    assert request.write_locks == request.read_locks == request.append_locks == ()


def test_bytes_data_header_and_checksum() -> None:
    b = TransactionBuilder(0, -1)
    b.set_header(-5)
    b.set_transaction_data(bytearray(b"hello"))
    request = b.build(REQ)
    assert (request.header, request.data, request.checksum) == (-5, b"hello", zlib.crc32(b"hello"))
    assert isinstance(request.data, bytes)


def test_serializers() -> None:
    b = TransactionBuilder(0, -1)
    b.set_transaction_data({"b": 1, "a": [1, 2]}, JsonSerializer())
    assert b.data == b'{"a":[1,2],"b":1}'
    b.set_transaction_data("héllo", Utf8Serializer())
    assert b.data == "héllo".encode()


def test_data_without_serializer_must_be_bytes() -> None:
    with pytest.raises(TypeError, match="must be bytes"):
        TransactionBuilder(0, -1).set_transaction_data("text")  # type: ignore[call-overload]


@pytest.mark.parametrize("header", [2**31, -(2**31) - 1])
def test_header_must_fit_in_32_bits(header: int) -> None:
    with pytest.raises(ValueError, match="32-bit"):
        TransactionBuilder(0, -1).set_header(header)


def test_header_takes_the_32_bit_bounds_and_refuses_a_bool() -> None:
    b = TransactionBuilder(0, -1)
    for header in (2**31 - 1, -(2**31)):
        b.set_header(header)
        assert b.header == header
    with pytest.raises(TypeError, match="bool"):
        b.set_header(True)
    assert b.header == -(2**31)


def test_locks_become_java_hashes_without_duplicates() -> None:
    a, b = PartitionLocalLock("account", 1), PartitionLocalLock("withdrawal", 1)
    builder = TransactionBuilder(0, -1)
    builder.set_write_locks([b, b])
    builder.set_read_locks([a])
    builder.set_append_locks([PartitionLocalLock("parent", 9)])
    request = builder.build(REQ)
    assert request.write_locks == (lock_hash(b),)
    assert request.read_locks == (lock_hash(a),)
    assert request.append_locks == (lock_hash(PartitionLocalLock("parent", 9)),)
    assert builder.write_locks == (b, b)


@pytest.mark.parametrize("name", ["k", "", "withdrawal", "é𝄞x"])
@pytest.mark.parametrize("lock_id", [0, 1, -1, 2**31 - 1, 2**31, -(2**31), 2**32 + 5, 2**63 - 1, -(2**63)])
def test_one_write_lock_in_a_list_is_hashed_as_lock_hash(name: str, lock_id: int) -> None:
    # set_write_locks([lock]) hashes on its own (lock_hash inlined): it must agree with lock_hash, and
    # with the general path (a tuple), on both signs and across the 32-bit halves.
    lock = PartitionLocalLock(name, lock_id)
    fast, general = TransactionBuilder(0, -1), TransactionBuilder(0, -1)
    fast.set_write_locks([lock])
    general.set_write_locks((lock,))
    assert fast.write_locks == general.write_locks == (lock,)
    assert fast.write_lock_hashes == general.write_lock_hashes == (lock_hash(lock),)
    assert fast.build(REQ).write_locks == (lock.hash32(),)


def test_a_new_write_lock_list_replaces_the_hashes() -> None:
    builder = TransactionBuilder(0, -1)
    builder.set_write_locks([PartitionLocalLock("a", 1)])
    builder.set_write_locks([PartitionLocalLock("a", 2), PartitionLocalLock("a", 3)])
    assert builder.write_lock_hashes == (
        lock_hash(PartitionLocalLock("a", 2)),
        lock_hash(PartitionLocalLock("a", 3)),
    )
    builder.set_write_locks([PartitionLocalLock("b", 4)])
    assert builder.write_lock_hashes == (lock_hash(PartitionLocalLock("b", 4)),)


def test_locks_must_be_partition_local_locks() -> None:
    with pytest.raises(TypeError, match="PartitionLocalLock"):
        TransactionBuilder(0, -1).set_write_locks([("account", 1)])  # type: ignore[list-item]


def test_frame_append_is_the_frame_of_build_and_leaves_other_locks_to_the_general_path() -> None:
    """``frame_append`` (the network driver's one-pass path) frames exactly ``build(req_id)``; with read or
    append locks it appends nothing, and the driver encodes ``build(req_id)`` instead."""
    req_id = ReqId(7 << 32, 1)
    builder = TransactionBuilder(0, 41)
    builder.set_header(5)
    builder.set_transaction_data(b"payload")
    builder.set_write_locks([PartitionLocalLock("k", 3)])
    out: list[bytes] = []
    assert builder.frame_append(out, MAGIC_CLIENT, 5, 1 << 20, req_id)
    payload = encode(builder.build(req_id), 5)
    assert b"".join(out) == FRAME_HEADER.pack(MAGIC_CLIENT, 5, len(payload)) + payload
    for kind in ("set_read_locks", "set_append_locks"):
        other = TransactionBuilder(0, 41)
        getattr(other, kind)([PartitionLocalLock("k", 4)])
        out = []
        assert not other.frame_append(out, MAGIC_CLIENT, 5, 1 << 20, req_id)
        assert out == []
