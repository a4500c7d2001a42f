"""Primitive encodings and records: golden bytes, round trips and the one-error decoding contract."""

import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from waltz.errors import LocalProtocolError, RemoteProtocolError
from waltz.protocol.records import (
    Record,
    RecordHeader,
    ReqId,
    crc32,
    make_header,
    make_req_id,
    read_record,
    read_record_header,
    write_record,
    write_record_header,
)
from waltz.protocol.wire import Reader, Writer


def test_primitives_golden_bytes() -> None:
    w = (
        Writer()
        .u8(7)
        .bool(True)
        .i16(-2)
        .i32(1)
        .i64(-1)
        .bytes_(b"ab")
        .bytes_(None)
        .string("é")
        .int_list([1, -1])
    )
    assert w.getvalue() == bytes.fromhex(
        "0701fffe00000001ffffffffffffffff000000026162ffffffff00000002c3a90000000200000001ffffffff"
    )


def test_uuid_is_two_longs_msb_first() -> None:
    u = uuid.UUID("00112233-4455-6677-8899-aabbccddeeff")
    raw = Writer().uuid(u).getvalue()
    assert raw == bytes.fromhex("00112233445566778899aabbccddeeff")
    assert Reader(raw).uuid() == u


def test_reader_rejects_short_bad_bool_and_trailing() -> None:
    with pytest.raises(RemoteProtocolError, match="truncated"):
        Reader(b"\x00\x00").i32()
    with pytest.raises(RemoteProtocolError, match="boolean"):
        Reader(b"\x02").bool()
    r = Reader(b"\x01\x02")
    r.u8()
    with pytest.raises(RemoteProtocolError, match="trailing"):
        r.expect_end()
    with pytest.raises(RemoteProtocolError, match="negative"):
        Reader(bytes.fromhex("fffffffe")).bytes_()


@given(st.binary(max_size=40), st.sampled_from([bytes, bytearray, memoryview]))
def test_bytes_view_required_reads_what_bytes_required_reads(data: bytes, kind: type) -> None:
    """The same value (a view of immutable bytes, a copy of anything else) and the same errors."""
    buf = kind(data)
    try:
        expected = Reader(buf).bytes_required()
    except RemoteProtocolError as e:
        refused = str(e)
    else:
        refused = None
    if refused is not None:
        with pytest.raises(RemoteProtocolError) as got:
            Reader(buf).bytes_view_required()
        assert str(got.value) == refused
        return
    r = Reader(buf)
    value = r.bytes_view_required()
    assert value == expected
    assert r.pos == 4 + len(expected)
    if kind is bytes:
        assert isinstance(value, memoryview)
        assert value.obj is buf
    else:
        assert type(value) is bytes


def test_writer_rejects_out_of_range() -> None:
    with pytest.raises(LocalProtocolError):
        Writer().i32(2**31)
    with pytest.raises(LocalProtocolError):
        Writer().i16(40000)


def test_req_id_layout() -> None:
    rid = ReqId.of(client_id=5, generation=3, partition_id=2, seq_num=9)
    assert rid.to_bytes() == bytes.fromhex("00000005000000030000000200000009")
    assert (rid.client_id, rid.generation, rid.partition_id, rid.seq_num) == (5, 3, 2, 9)
    neg = ReqId.of(-1, -1, 7, -5)
    assert (neg.client_id, neg.generation, neg.partition_id, neg.seq_num) == (-1, -1, 7, -5)
    assert ReqId.from_bytes(neg.to_bytes()) == neg


def test_fast_constructors_build_the_same_values() -> None:
    rid = make_req_id(2**64 - 1, 7)
    assert rid == ReqId(2**64 - 1, 7)
    assert type(rid) is ReqId
    header = make_header(9, rid, -3)
    assert header == RecordHeader(9, rid, -3)
    assert type(header) is RecordHeader
    assert (header.transaction_id, header.req_id, header.header) == (9, rid, -3)


def test_record_golden_bytes_and_checksum() -> None:
    rec = Record.build(3, ReqId.of(1, 2, 0, 4), -1, b"hi")
    w = Writer()
    write_record(w, rec)
    expected = (
        bytes.fromhex("000000000000000300000001000000020000000000000004ffffffff00000002")
        + b"hi"
        + crc32(b"hi").to_bytes(4, "big")
    )
    assert w.getvalue() == expected
    assert crc32(b"hi") == 0xD8932AAC  # zlib/java CRC-32 of "hi"
    assert read_record(Reader(expected)) == rec
    assert rec.verify()


def test_record_header_round_trip() -> None:
    h = RecordHeader(2**40, ReqId.of(9, 9, 9, 9), 12345)
    w = Writer()
    write_record_header(w, h)
    assert len(w.getvalue()) == 28
    assert read_record_header(Reader(w.getvalue())) == h


@given(st.binary(max_size=80))
def test_record_decoder_never_raises_anything_else(data: bytes) -> None:
    try:
        read_record(Reader(data))
    except RemoteProtocolError:
        pass
