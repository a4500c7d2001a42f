"""Client <-> server codec: golden bytes for every message and version, the one-error contract, fuzz."""

from __future__ import annotations

import dataclasses
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from waltz.errors import LocalProtocolError, RemoteProtocolError
from waltz.protocol import client_server as cs
from waltz.protocol.client_server import (
    MAGIC,
    SUPPORTED_VERSIONS,
    AddPreferredPartitionRequest,
    AddPreferredPartitionResponse,
    AppendRequest,
    CheckStorageConnectivityRequest,
    CheckStorageConnectivityResponse,
    FeedData,
    FeedRequest,
    FeedSuspended,
    FlushRequest,
    FlushResponse,
    HighWaterMarkRequest,
    HighWaterMarkResponse,
    LockFailure,
    Message,
    MountRequest,
    MountResponse,
    PartitionState,
    RemovePreferredPartitionRequest,
    RemovePreferredPartitionResponse,
    ServerPartitionsAssignmentRequest,
    ServerPartitionsAssignmentResponse,
    ServerPartitionsHealthStatRequest,
    ServerPartitionsHealthStatResponse,
    TransactionDataRequest,
    TransactionDataResponse,
    TransactionRangeRequest,
    TransactionRangeResponse,
    TrimmedResponse,
    decode,
    encode,
)
from waltz.protocol.framing import FRAME_HEADER, MAGIC_CLIENT
from waltz.protocol.record_run import encode_run
from waltz.protocol.records import Record, RecordHeader, ReqId, crc32

REQ = ReqId.of(client_id=1, generation=2, partition_id=3, seq_num=4)
# msb = client 1 << 32 | generation 2; lsb = partition 3 << 32 | seq 4
REQ_HEX = "00000001000000020000000300000004"
ABC_CRC_HEX = "352441c2"  # CRC-32 of b"abc" (the standard check value of zlib / java.util.zip.CRC32)

ALL = SUPPORTED_VERSIONS
V1_UP = (1, 2, 3, 4, 5, 6)
V2_UP = (2, 3, 4, 5, 6)
V4_UP = (4, 5, 6)
V5_UP = (5, 6)


def h(*parts: str) -> bytes:
    """Golden bytes written field by field, so each expectation reads like the layout table."""
    return bytes.fromhex("".join(parts).replace(" ", ""))


# (message, versions it encodes to exactly these bytes under, payload)
GOLDEN: list[tuple[Message, tuple[int, ...], bytes]] = [
    (MountRequest(REQ, 5, 6), ALL, h("00", REQ_HEX, "0000000000000005", "0000000000000006")),
    (MountResponse(REQ, PartitionState.READY), (0, 1, 2), h("01", REQ_HEX, "01")),
    (MountResponse(REQ, PartitionState.NOT_READY), (0, 1, 2), h("01", REQ_HEX, "00")),
    (MountResponse(REQ, PartitionState.READY), (3, 4, 5, 6), h("01", REQ_HEX, "00000000")),
    (MountResponse(REQ, PartitionState.NOT_READY), (3, 4, 5, 6), h("01", REQ_HEX, "00000001")),
    (MountResponse(REQ, PartitionState.CLIENT_AHEAD), (3, 4, 5, 6), h("01", REQ_HEX, "00000002")),
    (
        AppendRequest(REQ, 9, (1, -1), (), (), 7, b"abc", crc32(b"abc")),
        (0,),
        h(
            "02",
            REQ_HEX,
            "0000000000000009",  # client high-water mark
            "00000002 00000001 ffffffff",  # write locks
            "00000007",  # header
            "00000003 616263",  # data
            ABC_CRC_HEX,
        ),
    ),
    (
        AppendRequest(REQ, 9, (1,), (3,), (), 7, b"abc", crc32(b"abc")),
        (1,),
        h(
            "02",
            REQ_HEX,
            "0000000000000009",
            "00000001 00000001",  # write locks
            "00000001 00000003",  # read locks
            "00000007",
            "00000003 616263",
            ABC_CRC_HEX,
        ),
    ),
    (
        AppendRequest(REQ, -1, (1,), (3,), (-2,), -7, b"abc", crc32(b"abc")),
        V2_UP,
        h(
            "02",
            REQ_HEX,
            "ffffffffffffffff",
            "00000001 00000001",  # write locks
            "00000001 00000003",  # read locks
            "00000001 fffffffe",  # append locks
            "fffffff9",
            "00000003 616263",
            ABC_CRC_HEX,
        ),
    ),
    (
        # One write lock and nothing else (a conditional append on one key: its own encoder path).
        AppendRequest(REQ, 9, (-5,), (), (), 7, b"abc", crc32(b"abc")),
        V2_UP,
        h(
            "02",
            REQ_HEX,
            "0000000000000009",
            "00000001 fffffffb",  # write locks
            "00000000",  # read locks
            "00000000",  # append locks
            "00000007",
            "00000003 616263",
            ABC_CRC_HEX,
        ),
    ),
    (
        AppendRequest(REQ, 0, (), (), (), 0, b"", 0),
        V2_UP,
        h(
            "02",
            REQ_HEX,
            "0000000000000000",
            "00000000",
            "00000000",
            "00000000",
            "00000000",
            "00000000",
            "00000000",
        ),
    ),
    (FeedRequest(REQ, 9), ALL, h("03", REQ_HEX, "0000000000000009")),
    (FeedData(REQ, 10, -1), ALL, h("04", REQ_HEX, "000000000000000a", "ffffffff")),
    (FeedSuspended(REQ), ALL, h("05", REQ_HEX)),
    (TransactionDataRequest(REQ, 10), ALL, h("06", REQ_HEX, "000000000000000a")),
    (
        TransactionDataResponse.success(REQ, 10, b"abc"),
        ALL,
        h("07", REQ_HEX, "000000000000000a", "01", "00000003 616263", ABC_CRC_HEX),
    ),
    (
        TransactionDataResponse.failure(REQ, 10, "oops"),
        ALL,
        h("07", REQ_HEX, "000000000000000a", "00", "00000004 6f6f7073"),
    ),
    (
        TransactionDataResponse.failure(REQ, 10, None),
        ALL,
        h("07", REQ_HEX, "000000000000000a", "00", "ffffffff"),
    ),
    (FlushRequest(REQ), ALL, h("08", REQ_HEX)),
    (FlushResponse(REQ, -1), ALL, h("09", REQ_HEX, "ffffffffffffffff")),
    (LockFailure(REQ, 42), ALL, h("0a", REQ_HEX, "000000000000002a")),
    (HighWaterMarkRequest(REQ), ALL, h("0b", REQ_HEX)),
    (HighWaterMarkResponse(REQ, 0), ALL, h("0c", REQ_HEX, "0000000000000000")),
    (CheckStorageConnectivityRequest(REQ), V1_UP, h("0d", REQ_HEX)),
    (
        CheckStorageConnectivityResponse(REQ, (("h:1", True), ("é", False))),
        V1_UP,
        h("0e", REQ_HEX, "00000002", "00000003 683a31", "01", "00000002 c3a9", "00"),
    ),
    (ServerPartitionsAssignmentRequest(REQ), V2_UP, h("0f", REQ_HEX)),
    (
        ServerPartitionsAssignmentResponse(REQ, (0, 5)),
        V2_UP,
        h("10", REQ_HEX, "00000002", "00000000", "00000005"),
    ),
    (AddPreferredPartitionRequest(REQ, (3,)), V2_UP, h("11", REQ_HEX, "00000001", "00000003")),
    (AddPreferredPartitionResponse(REQ, True), V2_UP, h("12", REQ_HEX, "01")),
    (RemovePreferredPartitionRequest(REQ, ()), V2_UP, h("13", REQ_HEX, "00000000")),
    (RemovePreferredPartitionResponse(REQ, False), V2_UP, h("14", REQ_HEX, "00")),
    (ServerPartitionsHealthStatRequest(REQ), V4_UP, h("15", REQ_HEX)),
    (
        ServerPartitionsHealthStatResponse(REQ, ((1, True), (2, False))),
        V4_UP,
        h("16", REQ_HEX, "00000002", "00000001 01", "00000002 00"),
    ),
    (TransactionRangeRequest(REQ, 7, 100), V5_UP, h("17", REQ_HEX, "0000000000000007", "00000064")),
    (
        TransactionRangeResponse.of(REQ, 7, (Record(7, REQ, -2, b"abc", 0x352441C2),)),
        V5_UP,
        h(
            "18",
            REQ_HEX,
            "0000000000000007",
            "00000001",
            "0000002b",  # run length: 40 + 3
            "0000000000000007",
            REQ_HEX,
            "fffffffe",
            "00000003",
            ABC_CRC_HEX,
            "616263",
            "b3a3630f",  # CRC-32 of the 39 record bytes before it
        ),
    ),
    (
        TransactionRangeResponse(REQ, 9, 0, b""),
        V5_UP,
        h("18", REQ_HEX, "0000000000000009", "00000000", "00000000"),
    ),
    (TrimmedResponse(REQ, 5, 300), (6,), h("19", REQ_HEX, "0000000000000005", "000000000000012c")),
]

CASES = [(msg, version, payload) for msg, versions, payload in GOLDEN for version in versions]
CASE_IDS = [f"{type(msg).__name__}-V{version}-{i}" for i, (msg, version, _) in enumerate(CASES)]


def test_constants() -> None:
    assert ord("L") == MAGIC
    assert SUPPORTED_VERSIONS == (0, 1, 2, 3, 4, 5, 6)


def test_golden_covers_every_message_type_at_every_version_that_has_it() -> None:
    covered = {(payload[0], version) for _, version, payload in CASES}
    for cls in cs._CLASSES:
        for version in SUPPORTED_VERSIONS:
            if version >= cls.MIN_VERSION:
                assert (int(cls.TYPE), version) in covered, (cls.__name__, version)
    assert sorted({int(cls.TYPE) for cls in cs._CLASSES}) == list(range(26))


@pytest.mark.parametrize(("msg", "version", "payload"), CASES, ids=CASE_IDS)
def test_golden_encode(msg: Message, version: int, payload: bytes) -> None:
    assert encode(msg, version) == payload


@pytest.mark.parametrize(("msg", "version", "payload"), CASES, ids=CASE_IDS)
def test_golden_decode_whole(msg: Message, version: int, payload: bytes) -> None:
    assert decode(payload, version) == msg
    assert decode(bytearray(payload), version) == msg
    assert decode(memoryview(payload), version) == msg


@pytest.mark.parametrize(("msg", "version", "payload"), CASES, ids=CASE_IDS)
def test_golden_decode_rejects_trailing_bytes(msg: Message, version: int, payload: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        decode(payload + b"\x00", version)


@pytest.mark.parametrize(("msg", "version", "payload"), CASES, ids=CASE_IDS)
def test_golden_decode_rejects_every_truncation(msg: Message, version: int, payload: bytes) -> None:
    for n in range(len(payload)):
        with pytest.raises(RemoteProtocolError):
            decode(payload[:n], version)


# -- version rules

NEWER_MESSAGES: list[tuple[Message, int]] = [
    (msg, version)
    for msg, versions, _ in GOLDEN
    if type(msg).MIN_VERSION > 0
    for version in SUPPORTED_VERSIONS
    if version < type(msg).MIN_VERSION
]


@pytest.mark.parametrize(("msg", "version", "payload"), CASES, ids=CASE_IDS)
def test_decode_feed_data_takes_exactly_the_feed_data_payloads(
    msg: Message, version: int, payload: bytes
) -> None:
    fast = cs.decode_feed_data(payload)
    if isinstance(msg, FeedData):
        assert fast == (msg.req_id, msg.transaction_id, msg.header)
        assert cs.decode_feed_data(payload + b"\x00") is None  # Trailing bytes: decode() refuses them.
        assert cs.decode_feed_data(payload[:-1]) is None
    else:
        assert fast is None


@pytest.mark.parametrize(("msg", "version", "payload"), CASES, ids=CASE_IDS)
def test_decode_feed_runs_takes_a_payload_exactly_as_decode_feed_data(
    msg: Message, version: int, payload: bytes
) -> None:
    runs = cs.decode_feed_runs([b"x", payload, payload + b"\x00"])
    fast = cs.decode_feed_data(payload)
    if fast is None:
        assert runs == [(-1, [], 0), (-1, [], 1), (-1, [], 2)]
    else:
        partition = fast[0].lsb >> 32 & 0xFFFFFFFF
        # The payload with a trailing byte is not taken.
        assert runs == [(-1, [], 0), (partition, [(fast[1], fast[0], fast[2])], 1), (-1, [], 2)]


def test_decode_feed_runs_splits_where_the_partition_changes_or_another_message_starts() -> None:
    def feed(partition: int, seq: int, tid: int) -> bytes:
        return encode(FeedData(ReqId.of(7, 1, partition, seq), tid, tid * 10), 4)

    flush = encode(FlushRequest(ReqId.of(7, 1, 0, 9)), 4)
    payloads = [
        feed(0, 1, 5),
        feed(0, 2, 6),
        feed(3, 1, 7),
        feed(3, 2, 8),
        flush,
        feed(0, 3, 9),
        feed(3, 3, 10),
    ]
    assert cs.decode_feed_runs(payloads) == [
        (0, [(5, ReqId.of(7, 1, 0, 1), 50), (6, ReqId.of(7, 1, 0, 2), 60)], 0),
        (3, [(7, ReqId.of(7, 1, 3, 1), 70), (8, ReqId.of(7, 1, 3, 2), 80)], 2),
        (-1, [], 4),
        (0, [(9, ReqId.of(7, 1, 0, 3), 90)], 5),
        (3, [(10, ReqId.of(7, 1, 3, 3), 100)], 6),
    ]
    assert cs.decode_feed_runs([]) == []
    # A partition id of 2**31 or more is read unsigned (no mount has it, as its signed reading).
    high = encode(FeedData(ReqId(1, (2**31 + 5) << 32 | 1), 1, 0), 4)
    assert cs.decode_feed_runs([high])[0][0] == 2**31 + 5


@pytest.mark.parametrize(("msg", "version"), NEWER_MESSAGES)
def test_message_newer_than_the_version_is_refused_on_both_sides(msg: Message, version: int) -> None:
    with pytest.raises(LocalProtocolError, match="upgrade servers"):
        encode(msg, version)
    payload = encode(msg, SUPPORTED_VERSIONS[-1])
    with pytest.raises(RemoteProtocolError, match="not part of codec"):
        decode(payload, version)


def test_append_read_locks_need_v1_and_append_locks_need_v2() -> None:
    with pytest.raises(LocalProtocolError, match="not supported, upgrade servers"):
        encode(AppendRequest.build(REQ, 0, 0, b"", read_locks=(1,)), 0)
    for version in (0, 1):
        with pytest.raises(LocalProtocolError, match="not supported, upgrade servers"):
            encode(AppendRequest.build(REQ, 0, 0, b"", append_locks=(1,)), version)
    # The same request without those locks is fine under the old codecs.
    assert decode(encode(AppendRequest.build(REQ, 0, 0, b"x", (5,)), 0), 0) == AppendRequest.build(
        REQ, 0, 0, b"x", (5,)
    )


def test_client_ahead_travels_as_not_ready_before_v3() -> None:
    for version in (0, 1, 2):
        payload = encode(MountResponse(REQ, PartitionState.CLIENT_AHEAD), version)
        assert payload == h("01", REQ_HEX, "00")
        decoded = decode(payload, version)
        assert isinstance(decoded, MountResponse)
        assert decoded.state is PartitionState.NOT_READY
        assert not decoded.partition_ready


def test_unsupported_version_is_a_local_error() -> None:
    with pytest.raises(LocalProtocolError):
        encode(FlushRequest(REQ), 7)
    with pytest.raises(LocalProtocolError):
        decode(h("08", REQ_HEX), -1)


# -- malformed input


@pytest.mark.parametrize("version", SUPPORTED_VERSIONS)
def test_empty_and_unknown_types_are_remote_errors(version: int) -> None:
    with pytest.raises(RemoteProtocolError, match="empty"):
        decode(b"", version)
    for code in (26, 0x7F, 0xFF):
        with pytest.raises(RemoteProtocolError, match="unknown"):
            decode(bytes([code]) + h(REQ_HEX), version)


def test_append_checksum_mismatch_is_a_remote_error() -> None:
    payload = bytearray(encode(AppendRequest.build(REQ, 1, 2, b"abc", (1,)), 4))
    payload[-1] ^= 1  # corrupt the checksum
    with pytest.raises(RemoteProtocolError, match="checksum"):
        decode(bytes(payload), 4)
    payload[-1] ^= 1
    payload[-5] ^= 0x20  # corrupt the data instead
    with pytest.raises(RemoteProtocolError, match="checksum"):
        decode(bytes(payload), 4)


def test_transaction_data_checksum_mismatch_is_a_remote_error() -> None:
    bad = TransactionDataResponse(REQ, 10, b"abc", crc32(b"abd"), None)
    payload = encode(bad, 4)  # encoding relays the checksum as given (the server does not recompute it)
    with pytest.raises(RemoteProtocolError, match="checksum"):
        decode(payload, 4)


def test_transaction_data_ok_with_null_data_is_a_remote_error() -> None:
    with pytest.raises(RemoteProtocolError):
        decode(h("07", REQ_HEX, "000000000000000a", "01", "ffffffff", "00000000"), 4)


def test_bad_booleans_and_states_are_remote_errors() -> None:
    with pytest.raises(RemoteProtocolError, match="boolean"):
        decode(h("01", REQ_HEX, "02"), 0)
    with pytest.raises(RemoteProtocolError, match="partition state"):
        decode(h("01", REQ_HEX, "00000003"), 3)
    with pytest.raises(RemoteProtocolError, match="boolean"):
        decode(h("12", REQ_HEX, "ff"), 2)
    with pytest.raises(RemoteProtocolError):
        decode(h("0e", REQ_HEX, "00000001", "00000001 ff", "01"), 1)  # invalid UTF-8


def test_null_lock_arrays_decode_as_empty() -> None:
    payload = h(
        "02",
        REQ_HEX,
        "0000000000000000",
        "ffffffff",
        "ffffffff",
        "ffffffff",
        "00000000",
        "00000000",
        "00000000",
    )
    assert decode(payload, 2) == AppendRequest(REQ, 0, (), (), (), 0, b"", 0)


@pytest.mark.parametrize("count", ["fffffffe", "80000000", "7fffffff", "00000002"])
def test_bad_or_oversized_lock_counts_are_remote_errors(count: str) -> None:
    payload = h("02", REQ_HEX, "0000000000000000", count, "00000001")
    with pytest.raises(RemoteProtocolError):
        decode(payload, 0)


@pytest.mark.parametrize("code", ["0e", "10", "11", "13", "16"])
@pytest.mark.parametrize("count", ["ffffffff", "80000000", "7fffffff", "00000001"])
def test_bad_or_oversized_list_counts_are_remote_errors(code: str, count: str) -> None:
    with pytest.raises(RemoteProtocolError):
        decode(h(code, REQ_HEX, count), 4)


def test_negative_data_length_is_a_remote_error() -> None:
    payload = h("02", REQ_HEX, "0000000000000000", "00000000", "00000000", "ffffffff", ABC_CRC_HEX)
    with pytest.raises(RemoteProtocolError):
        decode(payload, 0)


@pytest.mark.parametrize("version", ALL)
@pytest.mark.parametrize("hwm", [-2, -(10**15), -(2**63)])
def test_a_client_high_water_mark_below_minus_one_is_refused_on_both_sides(version: int, hwm: int) -> None:
    # -1 means "holds nothing yet"; below it a feed would start at ids that never exist (the server's feed
    # task polled for them every 10 ms for as long as the connection lived).
    mark = struct.pack(">q", hwm).hex()
    with pytest.raises(RemoteProtocolError, match=f"FeedRequest: client high-water mark {hwm} is below -1"):
        decode(h("03", REQ_HEX, mark), version)
    with pytest.raises(RemoteProtocolError, match=f"MountRequest: client high-water mark {hwm} is below -1"):
        decode(h("00", REQ_HEX, mark, "0000000000000001"), version)
    with pytest.raises(LocalProtocolError, match="below -1"):
        encode(FeedRequest(REQ, hwm), version)
    with pytest.raises(LocalProtocolError, match="below -1"):
        encode(MountRequest(REQ, hwm, 1), version)
    assert decode(encode(FeedRequest(REQ, -1), version), version) == FeedRequest(REQ, -1)
    assert decode(encode(MountRequest(REQ, -1, 1), version), version) == MountRequest(REQ, -1, 1)


# -- encoding errors


@pytest.mark.parametrize(
    "msg",
    [
        AppendRequest(REQ, 2**63, (), (), (), 0, b"", 0),
        AppendRequest(REQ, 0, (2**31,), (), (), 0, b"", 0),
        AppendRequest(REQ, 0, (), (), (), -(2**31) - 1, b"", 0),
        AppendRequest(REQ, 0, (), (), (), 0, b"", -1),
        AppendRequest(REQ, 0, (), (), (), 0, b"", 2**32),
        FeedData(REQ, 0, 2**31),
        FeedRequest(REQ, -(2**63) - 1),
        TransactionDataResponse(REQ, 0, b"", 2**32, None),
        TransactionDataResponse(REQ, 0, b"", 0, "both"),
        ServerPartitionsAssignmentResponse(REQ, (2**31,)),
        ServerPartitionsHealthStatResponse(REQ, ((2**31, True),)),
    ],
)
def test_unencodable_fields_are_local_errors(msg: Message) -> None:
    with pytest.raises(LocalProtocolError):
        encode(msg, 4)


@pytest.mark.parametrize("version", ALL)
def test_encode_feed_data_is_encode_of_each_feed_data(version: int) -> None:
    headers = [
        RecordHeader(0, REQ, 0),
        RecordHeader(2**63 - 1, ReqId(2**64 - 1, 2**64 - 1), -(2**31)),
        RecordHeader(7, ReqId.of(-1, -2, 3, -4), 2**31 - 1),
    ]
    assert cs.encode_feed_data(headers, version) == [
        encode(FeedData(rid, txn, header), version) for txn, rid, header in headers
    ]
    assert cs.encode_feed_data([], version) == []


@pytest.mark.parametrize("version", ALL)
def test_encode_feed_entries_is_encode_feed_data_of_the_flat_headers(version: int) -> None:
    headers = [
        RecordHeader(0, REQ, 0),
        RecordHeader(2**63 - 1, ReqId(2**64 - 1, 2**64 - 1), -(2**31)),
        RecordHeader(7, ReqId.of(-1, -2, 3, -4), 2**31 - 1),
    ]
    flat = [(h.transaction_id, h.req_id.msb, h.req_id.lsb, h.header) for h in headers]
    assert cs.encode_feed_entries(flat, version) == cs.encode_feed_data(headers, version)
    assert cs.encode_feed_entries([], version) == []
    with pytest.raises(LocalProtocolError):
        cs.encode_feed_entries([(0, 0, 0, 2**31)], version)
    with pytest.raises(LocalProtocolError):
        cs.encode_feed_entries(flat, 99)


@pytest.mark.parametrize("version", ALL)
def test_frame_feed_entries_frames_each_feed_data_for_the_client_protocol(version: int) -> None:
    flat = [(0, 1, 2, 3), (2**63 - 1, 2**64 - 1, 0, -(2**31)), (7, 5, 6, 2**31 - 1)]
    payloads = cs.encode_feed_entries(flat, version)
    assert cs.frame_feed_entries(flat, version) == b"".join(
        FRAME_HEADER.pack(MAGIC_CLIENT, version, len(p)) + p for p in payloads
    )
    assert cs.frame_feed_entries([], version) == b""
    with pytest.raises(LocalProtocolError):
        cs.frame_feed_entries([(0, 0, 0, 2**31)], version)


def test_encode_feed_data_refuses_what_encode_refuses() -> None:
    with pytest.raises(LocalProtocolError):
        cs.encode_feed_data([RecordHeader(0, REQ, 2**31)], 4)
    with pytest.raises(LocalProtocolError):
        cs.encode_feed_data([RecordHeader(0, REQ, 0)], 99)


def test_append_build_computes_the_checksum() -> None:
    msg = AppendRequest.build(REQ, 1, 2, b"abc", (1,), (2,), (3,))
    assert msg.checksum == 0x352441C2
    assert TransactionDataResponse.success(REQ, 1, b"abc").checksum == 0x352441C2
    assert TransactionDataResponse.success(REQ, 1, b"abc").ok
    assert not TransactionDataResponse.failure(REQ, 1, "x").ok


# -- fuzz and round trips

versions = st.sampled_from(SUPPORTED_VERSIONS)


def _decodes_or_remote_error(payload: bytes, version: int) -> None:
    try:
        decode(payload, version)
    except RemoteProtocolError:
        pass


@given(st.binary(max_size=300), versions)
def test_fuzz_random_bytes(payload: bytes, version: int) -> None:
    _decodes_or_remote_error(payload, version)


@given(st.integers(0, 25), st.binary(min_size=16, max_size=16), st.binary(max_size=120), versions)
def test_fuzz_valid_type_and_req_id_random_body(code: int, req: bytes, body: bytes, version: int) -> None:
    _decodes_or_remote_error(bytes([code]) + req + body, version)


@given(st.sampled_from(CASES), st.data())
def test_fuzz_mutated_golden_payloads(case: tuple[Message, int, bytes], data: st.DataObject) -> None:
    _, version, payload = case
    buf = bytearray(payload)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "insert", "delete"]))
        pos = data.draw(st.integers(0, len(buf)))
        if op == "insert":
            buf[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
        elif buf:
            pos = min(pos, len(buf) - 1)
            if op == "flip":
                buf[pos] = data.draw(st.integers(0, 255))
            else:
                del buf[pos]
    _decodes_or_remote_error(bytes(buf), version)


u64 = st.integers(0, 2**64 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
i32 = st.integers(-(2**31), 2**31 - 1)
hwms = st.integers(-1, 2**63 - 1)  # a client's high-water mark: -1 or a transaction id
req_ids = st.builds(ReqId, u64, u64)
int_tuples = st.lists(i32, max_size=6).map(tuple)


@st.composite
def messages(draw: st.DrawFn, version: int) -> Message:
    req = draw(req_ids)
    choices: list[st.SearchStrategy[Message]] = [
        st.builds(MountRequest, st.just(req), hwms, i64),
        st.builds(
            MountResponse,
            st.just(req),
            st.sampled_from(
                list(PartitionState) if version >= 3 else [PartitionState.READY, PartitionState.NOT_READY]
            ),
        ),
        st.builds(
            AppendRequest.build,
            st.just(req),
            i64,
            i32,
            st.binary(max_size=64),
            int_tuples,
            int_tuples if version >= 1 else st.just(()),
            int_tuples if version >= 2 else st.just(()),
        ),
        st.builds(FeedRequest, st.just(req), hwms),
        st.builds(FeedData, st.just(req), i64, i32),
        st.just(FeedSuspended(req)),
        st.builds(TransactionDataRequest, st.just(req), i64),
        st.builds(TransactionDataResponse.success, st.just(req), i64, st.binary(max_size=64)),
        st.builds(TransactionDataResponse.failure, st.just(req), i64, st.none() | st.text(max_size=20)),
        st.just(FlushRequest(req)),
        st.builds(FlushResponse, st.just(req), i64),
        st.builds(LockFailure, st.just(req), i64),
        st.just(HighWaterMarkRequest(req)),
        st.builds(HighWaterMarkResponse, st.just(req), i64),
    ]
    if version >= 1:
        choices += [
            st.just(CheckStorageConnectivityRequest(req)),
            st.builds(
                CheckStorageConnectivityResponse,
                st.just(req),
                st.lists(st.tuples(st.text(max_size=12), st.booleans()), max_size=4).map(tuple),
            ),
        ]
    if version >= 2:
        choices += [
            st.just(ServerPartitionsAssignmentRequest(req)),
            st.builds(ServerPartitionsAssignmentResponse, st.just(req), int_tuples),
            st.builds(AddPreferredPartitionRequest, st.just(req), int_tuples),
            st.builds(AddPreferredPartitionResponse, st.just(req), st.booleans()),
            st.builds(RemovePreferredPartitionRequest, st.just(req), int_tuples),
            st.builds(RemovePreferredPartitionResponse, st.just(req), st.booleans()),
        ]
    if version >= 4:
        choices += [
            st.just(ServerPartitionsHealthStatRequest(req)),
            st.builds(
                ServerPartitionsHealthStatResponse,
                st.just(req),
                st.lists(st.tuples(i32, st.booleans()), max_size=4).map(tuple),
            ),
        ]
    return draw(st.one_of(choices))


@given(st.data())
def test_round_trip(data: st.DataObject) -> None:
    version = data.draw(versions)
    msg = data.draw(messages(version))
    payload = encode(msg, version)
    assert payload[0] == msg.TYPE
    assert decode(payload, version) == msg
    assert encode(decode(payload, version), version) == payload


def test_new_append_request_is_the_constructor_field_for_field() -> None:
    args = (REQ, 9, (1, -1), (3,), (-2,), 7, b"abc", crc32(b"abc"))
    fast = cs.new_append_request(*args)
    assert fast == AppendRequest(*args)
    assert hash(fast) == hash(AppendRequest(*args))
    assert [f.name for f in dataclasses.fields(AppendRequest)] == [
        "req_id",
        "client_high_water_mark",
        "write_locks",
        "read_locks",
        "append_locks",
        "header",
        "data",
        "checksum",
    ]  # new_append_request sets exactly these, in this order: a new field must be added there too.
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.header = 1  # type: ignore[misc]


def test_a_range_response_run_is_checked_when_unpacked_not_when_decoded() -> None:
    """The decoder does not walk the run (the reader's unpacking does, once, with the checksums): a run
    whose ids are out of sequence decodes, and unpacking it refuses it whole. A count the run's bytes cannot
    hold is refused by the decoder at no per-record cost."""
    recs = [Record.build(7 + i, REQ, 0, b"abcd") for i in range(2)]
    swapped = encode_run([recs[1], recs[0]])
    msg = decode(encode(TransactionRangeResponse(REQ, 7, 2, swapped), 5), 5)
    assert isinstance(msg, TransactionRangeResponse)
    assert (msg.transaction_id, msg.count, msg.run) == (7, 2, swapped)
    with pytest.raises(RemoteProtocolError, match="transaction 8, expected 7"):
        msg.records()
    with pytest.raises(RemoteProtocolError, match="cannot hold 3 records"):
        decode(encode(TransactionRangeResponse(REQ, 7, 3, encode_run(recs)), 5), 5)
    with pytest.raises(RemoteProtocolError, match="cannot hold -1 records"):
        decode(encode(TransactionRangeResponse(REQ, 7, -1, b""), 5), 5)


@given(st.data())
def test_decode_append_fields_reads_what_decode_reads_and_refuses_what_it_refuses(
    data: st.DataObject,
) -> None:
    # The server's hot path decodes appends to AppendFields: for every payload, valid or mutated, it must
    # give the message's fields in the message's order, or raise the same RemoteProtocolError.
    version = data.draw(versions)
    msg = data.draw(
        st.builds(
            AppendRequest.build,
            req_ids,
            i64,
            i32,
            st.binary(max_size=64),
            int_tuples,
            int_tuples if version >= 1 else st.just(()),
            int_tuples if version >= 2 else st.just(()),
        )
    )
    buf = bytearray(encode(msg, version))
    for _ in range(data.draw(st.integers(0, 3))):
        # Not the type byte: the server decodes only payloads of type APPEND_REQUEST this way.
        pos = data.draw(st.integers(1, len(buf) - 1))
        buf[pos] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        del buf[data.draw(st.integers(1, len(buf) - 1)) :]
    payload = bytes(buf)
    try:
        expected = decode(payload, version)
    except RemoteProtocolError as e:
        refused = str(e)
    else:
        refused = None
    if refused is not None:
        with pytest.raises(RemoteProtocolError) as got:
            cs.decode_append_fields(payload, version)
        assert str(got.value) == refused
        return
    fields = cs.decode_append_fields(payload, version)
    assert type(fields) is cs.AppendFields
    assert isinstance(expected, AppendRequest)
    assert tuple(fields) == tuple(getattr(expected, f.name) for f in dataclasses.fields(AppendRequest))
    assert cs.AppendFields._fields == tuple(f.name for f in dataclasses.fields(AppendRequest))


def test_a_range_response_in_parts_is_its_encoding_with_the_run_not_copied() -> None:
    run = encode_run([Record.build(7 + i, ReqId.of(1, 2, 3, 4 + i), i, bytes(i * 10)) for i in range(3)])
    msg = cs.TransactionRangeResponse(ReqId.of(1, 2, 3, 4), 7, 3, run)
    head, body = cs.encode_range_response_parts(msg, 5)
    assert body is run
    assert head + body == cs.encode(msg, 5)
    with pytest.raises(LocalProtocolError, match="V5"):
        cs.encode_range_response_parts(msg, 4)  # as encode() refuses it


i32s = st.integers(min_value=-(2**31), max_value=2**31 - 1)


@given(
    version=versions,
    msb=st.integers(min_value=0, max_value=2**64 - 1),
    lsb=st.integers(min_value=0, max_value=2**64 - 1),
    hwm=st.integers(min_value=-(2**63), max_value=2**63 - 1),
    lock=i32s,
    header=i32s,
    data=st.binary(max_size=40),
)
def test_an_append_with_one_write_lock_encodes_as_the_general_layout(
    version: int, msb: int, lsb: int, hwm: int, lock: int, header: int, data: bytes
) -> None:
    """The precompiled head of an append with one write lock and no other locks gives the bytes of the
    general layout (type, ReqId, hwm, then each lock list as a count and its hashes, header, length, data,
    data checksum), on every codec version, and encode and append_payload agree."""
    msg = AppendRequest(ReqId(msb, lsb), hwm, (lock,), (), (), header, data, crc32(data))
    mask = 2**64 - 1
    if version >= 2:
        head = struct.pack(">BQQqiiiiii", 2, msb & mask, lsb & mask, hwm, 1, lock, 0, 0, header, len(data))
    elif version == 1:
        head = struct.pack(">BQQqiiiii", 2, msb & mask, lsb & mask, hwm, 1, lock, 0, header, len(data))
    else:
        head = struct.pack(">BQQqiiii", 2, msb & mask, lsb & mask, hwm, 1, lock, header, len(data))
    want = head + data + struct.pack(">I", crc32(data))
    assert encode(msg, version) == want
    assert cs.append_payload(msg, version) == want
    assert decode(want, version) == msg


def test_a_decoded_range_response_run_is_a_view_of_the_payload_not_a_copy() -> None:
    """A range read's run is megabytes: decoding takes it as a read-only view of the received payload
    (immutable bytes, so it can never change under the reader) rather than copying it out; a payload in a
    buffer that can change (bytearray) is copied as before."""
    recs = [Record.build(7 + i, REQ, i, bytes(range(i, i + 40))) for i in range(20)]
    payload = encode(TransactionRangeResponse.of(REQ, 7, recs), 5)
    msg = decode(payload, 5)
    assert isinstance(msg, TransactionRangeResponse)
    assert isinstance(msg.run, memoryview)
    assert msg.run.obj is payload
    assert msg.run.readonly
    assert msg.records() == recs
    mutable = bytearray(payload)
    copied = decode(mutable, 5)
    assert isinstance(copied, TransactionRangeResponse)
    mutable[-1] ^= 0xFF  # the caller reuses its buffer: the decoded run keeps what was received
    assert copied.records() == recs
    assert copied == msg


@given(
    version=versions,
    msb=st.integers(min_value=-(2**63), max_value=2**64 - 1),
    lsb=st.integers(min_value=-(2**63), max_value=2**64 - 1),
    hwm=st.integers(min_value=-(2**63), max_value=2**63 - 1),
    locks=st.lists(i32s, max_size=2).map(tuple),
    header=i32s,
    data=st.binary(max_size=40),
)
def test_frame_append_writes_the_frame_of_the_encoded_append_or_nothing(
    version: int, msb: int, lsb: int, hwm: int, locks: tuple[int, ...], header: int, data: bytes
) -> None:
    """The client's one-pass append frame is the frame of ``encode(AppendRequest(...))``, byte for byte; what
    it does not cover (codecs before V2, two write locks, a ReqId half above 2**63) appends nothing."""
    req_id = ReqId(msb, lsb)
    out: list[bytes] = [b"before"]
    framed = cs.frame_append(out, MAGIC_CLIENT, version, 1 << 20, req_id, hwm, locks, header, data)
    assert framed == (version >= 2 and len(locks) <= 1 and msb < 2**63 and lsb < 2**63)
    if not framed:
        assert out == [b"before"]
        return
    payload = encode(AppendRequest(req_id, hwm, locks, (), (), header, data, crc32(data)), version)
    assert b"".join(out) == b"before" + FRAME_HEADER.pack(MAGIC_CLIENT, version, len(payload)) + payload
    assert out[2] is data  # Not copied before the write.


def test_frame_append_leaves_a_payload_over_the_frame_limit_to_the_general_path() -> None:
    """A payload over ``max_frame_bytes`` appends nothing (the connection refuses it on the general path,
    as it refuses any message too large); one exactly at the limit is framed."""
    data = bytes(100)
    size = len(encode(AppendRequest(ReqId(1, 2), -1, (), (), (), 0, data, crc32(data)), 5))
    out: list[bytes] = []
    assert not cs.frame_append(out, MAGIC_CLIENT, 5, size - 1, ReqId(1, 2), -1, (), 0, data)
    assert out == []
    assert cs.frame_append(out, MAGIC_CLIENT, 5, size, ReqId(1, 2), -1, (), 0, data)
    assert len(b"".join(out)) == FRAME_HEADER.size + size


def test_a_trimmed_response_names_an_id_below_its_trim_point_and_raises_trimmed_error() -> None:
    for bad in (TrimmedResponse(REQ, 300, 300), TrimmedResponse(REQ, -1, 5)):
        with pytest.raises(LocalProtocolError, match="is not below the trim point"):
            encode(bad, 6)
    with pytest.raises(RemoteProtocolError, match="is not below the trim point"):
        decode(h("19", REQ_HEX, "000000000000012c", "000000000000012c"), 6)
    error = TrimmedResponse(REQ, 5, 300).error()
    assert (error.partition_id, error.transaction_id, error.trim_point) == (REQ.partition_id, 5, 300)
    assert "transaction 5 is below the trim point 300" in str(error)
