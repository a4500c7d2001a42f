"""Server <-> storage codec: golden bytes for every message type and the one-error decoding contract.

Codec speed is measured by ``bench/codec_speed.py``, not asserted here."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from waltz.errors import (
    LocalProtocolError,
    RemoteProtocolError,
    SessionFencedError,
    StorageRpcError,
    TransactionOutOfOrderError,
    TrimmedError,
)
from waltz.protocol import storage as s
from waltz.protocol import storage_multi as sm
from waltz.protocol.framing import MAGIC_STORAGE, FrameDecoder, encode_frame
from waltz.protocol.record_run import run_bounds
from waltz.protocol.records import Record, RecordHeader, ReqId, crc32

pytestmark = pytest.mark.timeout(120)

KEY = uuid.UUID("00112233-4455-6677-8899-aabbccddeeff")
REC = Record(5, ReqId.of(1, 2, 3, 4), 7, b"ab", crc32(b"ab"))
REC_EMPTY = Record(6, ReqId.of(1, 2, 3, 5), -1, b"", 0)
HDR = RecordHeader(5, ReqId.of(1, 2, 3, 4), 7)

# Hand-written layouts (see the table in waltz/protocol/storage.py).
REC_HEX = "0000000000000005 0000000100000002 0000000300000004 00000007 00000002 6162 9e83486d"
REC_EMPTY_HEX = "0000000000000006 0000000100000002 0000000300000005 ffffffff 00000000 00000000"
# REC as a storage node stores it (a record run of one): the data checksum moves before the data, and a
# CRC-32 of the 38 bytes before it closes the record.
STORED_REC_HEX = "0000000000000005 0000000100000002 0000000300000004 00000007 00000002 9e83486d 6162 a9ca30ac"
HDR_HEX = "0000000000000005 0000000100000002 0000000300000004 00000007"
FAILURE = s.StorageRpcFailure("boom", (s.StackFrame("SessionFencedError", "append", "p.py", 12),))
FAILURE_HEX = (
    "00000004 626f6f6d  00000001"
    "  00000012 53657373696f6e46656e6365644572726f72  00000006 617070656e64  00000004 702e7079  0000000c"
)


def case_id(value: object) -> str:
    return "" if isinstance(value, str) else type(value).__name__


def p(type_code: int) -> str:
    """The prefix of a message with session 1, seq 2, partition 3."""
    return f"{type_code:02x} 0000000000000001 0000000000000002 00000003 "


CASES: list[tuple[s.StorageMessage, str]] = [
    (
        s.OpenRequest.of(KEY, 4),
        "01 ffffffffffffffff ffffffffffffffff ffffffff 00112233445566778899aabbccddeeff 00000004",
    ),
    (s.LastSessionInfoRequest(1, 2, 3, True), p(2) + "01"),
    (
        s.LastSessionInfoResponse(1, 2, 3, s.SessionInfo(9, 10, -1)),
        p(3) + "0000000000000009 000000000000000a ffffffffffffffff",
    ),
    (
        s.LastSessionInfoResponse(1, 2, 3, s.SessionInfo(9, 10, 8, damaged=True)),
        p(3) + "0000000000000009 000000000000000a 0000000000000008 01",
    ),
    (s.SetLowWaterMarkRequest(1, 2, 3, 100, False), p(4) + "0000000000000064 00"),
    (s.TruncateRequest(1, 2, 3, 99, True), p(5) + "0000000000000063 01"),
    (
        s.TruncateRequest(1, 2, 3, 99, False, operator_repair=True, reason="x"),
        p(5) + "0000000000000063 00 01 00000001 78",
    ),
    (
        s.TruncateRequest(1, 2, 3, -1, False, reason="recovery: closed"),
        p(5) + "ffffffffffffffff 00 00 00000010 " + b"recovery: closed".hex(),
    ),
    (s.AppendRequest(1, 2, 3, (REC, REC_EMPTY), False), p(6) + f"00000002 {REC_HEX} {REC_EMPTY_HEX} 00"),
    (s.AppendRequest(1, 2, 3, (), True), p(6) + "00000000 01"),
    (s.SuccessResponse(1, 2, 3), p(7)),
    (s.FailureResponse(1, 2, 3, FAILURE), p(8) + FAILURE_HEX),
    (s.FailureResponse(1, 2, 3, s.StorageRpcFailure("", ())), p(8) + "00000000 00000000"),
    (s.RecordHeaderRequest(1, 2, 3, 5), p(9) + "0000000000000005"),
    (s.RecordHeaderResponse(1, 2, 3, HDR), p(10) + "01 " + HDR_HEX),
    (s.RecordHeaderResponse(1, 2, 3, None), p(10) + "00"),
    (s.RecordRequest(1, 2, 3, 5), p(11) + "0000000000000005"),
    (s.RecordResponse(1, 2, 3, REC), p(12) + "01 " + REC_HEX),
    (s.RecordResponse(1, 2, 3, None), p(12) + "00"),
    (s.MaxTransactionIdRequest(1, 2, 3, True), p(13) + "01"),
    (s.MaxTransactionIdResponse(1, 2, 3, -1), p(14) + "ffffffffffffffff"),
    (s.RecordHeaderListRequest(1, 2, 3, 5, 20), p(15) + "0000000000000005 00000014"),
    (s.RecordHeaderListResponse(1, 2, 3, (HDR, HDR)), p(16) + f"00000002 {HDR_HEX} {HDR_HEX}"),
    (s.RecordHeaderListResponse(1, 2, 3, ()), p(16) + "00000000"),
    (s.RecordListRequest(1, 2, 3, 5, 20), p(17) + "0000000000000005 00000014"),
    (s.RecordListResponse(1, 2, 3, (REC,)), p(18) + f"00000001 {REC_HEX}"),
    (s.RecordRunRequest(1, 2, 3, 5, 20, 4096), p(19) + "0000000000000005 00000014 00001000"),
    (
        s.RecordRunResponse(1, 2, 3, 1, bytes.fromhex(STORED_REC_HEX)),
        p(20) + f"00000001 0000002a {STORED_REC_HEX}",
    ),
    (s.RecordRunResponse(1, 2, 3, 0, b""), p(20) + "00000000 00000000"),
    (s.RepairRequest(1, 2, 3, (REC,)), p(21) + f"00000001 {REC_HEX}"),
    (s.DamagedRecordsRequest(1, 2, 3, 1000), p(22) + "000003e8"),
    (s.DamagedRecordsResponse(1, 2, 3, (17, 2000)), p(23) + "00000002 0000000000000011 00000000000007d0"),
    (s.DamagedRecordsResponse(1, 2, 3, ()), p(23) + "00000000"),
    (s.TrimRequest(1, 2, 3, 100, False), p(24) + "0000000000000064 00"),
    (s.TrimRequest(1, 2, 3, 0, True), p(24) + "0000000000000000 01"),
    (s.TrimResponse(1, 2, 3, 100), p(25) + "0000000000000064"),
    (s.SegmentSizesRequest(1, 2, 3, 4096), p(26) + "00001000"),
    (
        s.SegmentSizesResponse(1, 2, 3, ((0, 4096), (10, 512))),
        p(27) + "00000002 0000000000000000 0000000000001000 000000000000000a 0000000000000200",
    ),
    (s.SegmentSizesResponse(1, 2, 3, ()), p(27) + "00000000"),
]


def test_every_message_type_has_a_golden_case() -> None:
    assert {type(msg).TYPE for msg, _ in CASES} == set(range(1, 28))


@pytest.mark.parametrize(("msg", "hex_"), CASES, ids=case_id)
def test_golden_bytes(msg: s.StorageMessage, hex_: str) -> None:
    raw = bytes.fromhex(hex_)
    assert s.encode(msg) == raw
    assert s.decode(raw) == msg
    assert s.decode(bytearray(raw)) == msg
    assert s.decode(memoryview(raw)) == msg


@pytest.mark.parametrize(("msg", "hex_"), CASES, ids=case_id)
def test_decoded_from_frames_fed_one_byte_at_a_time(msg: s.StorageMessage, hex_: str) -> None:
    framed = encode_frame(MAGIC_STORAGE, 0, bytes.fromhex(hex_)) * 2
    decoder = FrameDecoder(1024)
    decoded = []
    for i in range(len(framed)):
        decoder.receive_data(framed[i : i + 1])
        while (frame := decoder.next_frame()) is not None:
            decoded.append(s.decode(frame.payload))
    assert decoded == [msg, msg]


@pytest.mark.parametrize(("msg", "hex_"), CASES, ids=case_id)
def test_trailing_and_truncated_payloads_are_refused(msg: s.StorageMessage, hex_: str) -> None:
    raw = bytes.fromhex(hex_)
    with pytest.raises(RemoteProtocolError, match="trailing"):
        s.decode(raw + b"\x00")
    for n in range(len(raw)):
        try:
            got = s.decode(raw[:n])
        except RemoteProtocolError:
            continue
        # Only an optional trailer (ours, see the module docstring) may be cut off, and only whole: what is
        # left is the message without it. A frame carries its length, so a payload never arrives cut.
        assert isinstance(got, (s.LastSessionInfoResponse, s.TruncateRequest)), n
        assert s.encode(got) == raw[:n], n


def test_unknown_type_and_bad_fields_are_refused() -> None:
    for code in (0, 28, 255):
        with pytest.raises(RemoteProtocolError, match="unknown"):
            s.decode(bytes.fromhex(p(code)))
    with pytest.raises(RemoteProtocolError, match="boolean"):
        s.decode(bytes.fromhex(p(2) + "02"))
    # A count the payload cannot possibly hold is refused before anything is allocated for it.
    for code in (6, 16, 18, 27):
        with pytest.raises(RemoteProtocolError, match="count"):
            s.decode(bytes.fromhex(p(code) + "7fffffff 00"))
    with pytest.raises(RemoteProtocolError):
        s.decode(
            bytes.fromhex(p(6) + "00000001 " + REC_HEX.replace("00000002 6162", "ffffffff 6162") + " 00")
        )
    with pytest.raises(RemoteProtocolError, match="count"):
        s.decode(bytes.fromhex(p(8) + "00000000 7fffffff"))


def test_failure_strings_null_from_a_java_peer_decode_as_empty() -> None:
    raw = bytes.fromhex(p(8) + "ffffffff 00000001 ffffffff ffffffff ffffffff 00000000")
    msg = s.decode(raw)
    assert msg == s.FailureResponse(1, 2, 3, s.StorageRpcFailure("", (s.StackFrame("", "", "", 0),)))


def test_encoder_refuses_values_the_wire_cannot_carry() -> None:
    for bad in (
        s.SuccessResponse(2**63, 0, 0),
        s.SuccessResponse(0, 0, 2**31),
        s.MaxTransactionIdResponse(0, 0, 0, 2**63),
        s.AppendRequest(0, 0, 0, (REC._replace(header=2**31),), False),
        s.AppendRequest(0, 0, 0, (REC._replace(transaction_id=-(2**63) - 1),), False),
        s.RecordHeaderListResponse(0, 0, 0, (HDR._replace(header=2**31),)),
    ):
        with pytest.raises(LocalProtocolError):
            s.encode(bad)
    with pytest.raises(LocalProtocolError):
        s.encode(s.StorageMessage(0, 0, 0))


def test_failure_round_trip_keeps_the_error_class() -> None:
    try:
        raise SessionFencedError("session 4 fenced by 5")
    except SessionFencedError as e:
        msg = s.failure_from_error(1, 2, 3, e)
    decoded = s.decode(s.encode(msg))
    assert isinstance(decoded, s.FailureResponse)
    assert decoded.failure.class_name == "SessionFencedError"
    assert decoded.failure.frames[0].method == "test_failure_round_trip_keeps_the_error_class"
    assert decoded.failure.frames[0].file == "test_storage_codec.py"
    error = s.failure_to_error(decoded)
    assert type(error) is SessionFencedError
    assert str(error) == "session 4 fenced by 5"
    # Never raised: no traceback, still one frame naming the class.
    fresh = s.failure_from_error(0, 0, 0, TransactionOutOfOrderError("gap"))
    assert fresh.failure.frames == (s.StackFrame("TransactionOutOfOrderError", "", "", 0),)
    assert type(s.failure_to_error(fresh.failure)) is TransactionOutOfOrderError


def test_trimmed_error_keeps_its_numbers_across_the_wire() -> None:
    msg = s.failure_from_error(1, 2, 3, TrimmedError.below(3, 10, 500))
    error = s.failure_to_error(s.decode(s.encode(msg)))  # type: ignore[arg-type]
    assert type(error) is TrimmedError
    assert (error.partition_id, error.transaction_id, error.trim_point) == (3, 10, 500)
    assert not error.retriable
    assert "partition 3: transaction 10 is below the trim point 500" in str(error)
    # A client reads it back out of a server's text-only answer (a transaction data response).
    quoted = TrimmedError.from_message(f"could not read transaction 10: {error}")
    assert quoted is not None
    assert (quoted.partition_id, quoted.transaction_id, quoted.trim_point) == (3, 10, 500)
    assert TrimmedError.from_message("transaction not found") is None


def test_foreign_errors_become_storage_rpc_errors() -> None:
    msg = s.failure_from_error(0, 0, 0, ValueError())
    assert msg.failure.class_name == "StorageRpcError"
    assert msg.failure.message == "ValueError"  # an empty message is replaced by the class name
    assert type(s.failure_to_error(msg)) is StorageRpcError
    java = s.StorageRpcFailure("x", (s.StackFrame("com.wepay.Foo", "m", "F.java", 1),))
    assert type(s.failure_to_error(java)) is StorageRpcError


def test_failure_frames_are_bounded() -> None:
    def recurse(n: int) -> None:
        if n == 0:
            raise StorageRpcError("deep")
        recurse(n - 1)

    try:
        recurse(100)
    except StorageRpcError as e:
        msg = s.failure_from_error(0, 0, 0, e)
    assert len(msg.failure.frames) == s.MAX_FAILURE_FRAMES
    assert msg.failure.frames[0].method == "recurse"


def test_seq_num_of() -> None:
    assert s.seq_num_of(s.SuccessResponse(1, 42, 3)) == 42


records_strategy = st.lists(
    st.builds(
        Record,
        st.integers(-(2**63), 2**63 - 1),
        st.builds(ReqId, st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)),
        st.integers(-(2**31), 2**31 - 1),
        st.binary(max_size=64),
        st.integers(0, 2**32 - 1),
    ),
    max_size=10,
).map(tuple)


@given(records_strategy, st.booleans())
def test_append_round_trip(records: tuple[Record, ...], offline: bool) -> None:
    msg = s.AppendRequest(-1, 2**40, 0, records, offline)
    assert s.decode(s.encode(msg)) == msg


@given(records_strategy, st.booleans(), st.integers(-(2**63), 2**63 - 1), st.integers(0, 2**63 - 1))
def test_append_encoded_once_is_the_append_request(
    records: tuple[Record, ...], offline: bool, session_id: int, seq_num: int
) -> None:
    body = s.append_request_body(records, offline)
    msg = s.AppendRequest(session_id, seq_num, 7, records, offline)
    assert s.encode_append_request(session_id, seq_num, 7, body) == s.encode(msg)


def test_append_encoded_once_refuses_what_encode_refuses() -> None:
    with pytest.raises(LocalProtocolError):
        s.append_request_body((REC._replace(header=2**31),))
    with pytest.raises(LocalProtocolError):
        s.encode_append_request(0, 2**63, 0, b"")


@given(st.binary(max_size=300))
def test_random_bytes_decode_or_raise_protocol_error(data: bytes) -> None:
    try:
        s.decode(data)
    except RemoteProtocolError:
        pass


@given(st.integers(1, 18), st.binary(max_size=200))
def test_random_bodies_decode_or_raise_protocol_error(type_code: int, body: bytes) -> None:
    try:
        s.decode(bytes.fromhex(p(type_code)) + body)
    except RemoteProtocolError:
        pass


def test_record_run_response_that_cannot_hold_its_records_is_refused() -> None:
    good = bytes.fromhex(STORED_REC_HEX)
    prefix = bytes.fromhex(p(20))
    with pytest.raises(RemoteProtocolError, match="cannot hold"):
        s.decode(prefix + bytes.fromhex("00000002 0000002a") + good)  # two records announced, one sent
    with pytest.raises(RemoteProtocolError, match="cannot hold"):
        s.decode(prefix + bytes.fromhex("ffffffff 0000002a") + good)
    with pytest.raises(RemoteProtocolError, match="empty run"):
        s.decode(prefix + bytes.fromhex("00000000 00000001 00"))


def test_record_run_response_is_relayed_unwalked_and_its_reader_refuses_a_bad_shape() -> None:
    """The server only relays a run, so its decoder does not walk the records (a fifth of a server's CPU in a
    bulk read); the reader's run_bounds, which every consumer runs, refuses the same bytes."""
    good = bytes.fromhex(STORED_REC_HEX)
    prefix = bytes.fromhex(p(20))
    bad_length = bytearray(good)
    bad_length[31] = 0x09  # data length 9 runs past the end
    for run, problem in ((good + b"\x00", "left over"), (bytes(bad_length), "bad length")):
        msg = s.decode(prefix + bytes.fromhex("00000001") + len(run).to_bytes(4, "big") + run)
        assert isinstance(msg, s.RecordRunResponse)
        assert (msg.count, msg.run, msg.first) == (1, run, 5)
        with pytest.raises(RemoteProtocolError, match=problem):
            run_bounds(msg.run, msg.first, msg.count)


def test_a_decoded_record_run_response_run_is_a_view_of_the_payload_not_a_copy() -> None:
    """The server relays a storage node's run (megabytes) as it decoded it: a view of the received payload,
    not a copy; a payload in a buffer that can change is copied."""
    run = bytes.fromhex(STORED_REC_HEX)
    payload = bytes.fromhex(p(20)) + bytes.fromhex("00000001") + len(run).to_bytes(4, "big") + run
    msg = s.decode(payload)
    assert isinstance(msg, s.RecordRunResponse)
    assert isinstance(msg.run, memoryview)
    assert msg.run.obj is payload
    assert msg.run.readonly
    assert (msg.count, msg.run, msg.first) == (1, run, 5)
    assert run_bounds(msg.run, msg.first, msg.count) == [0, len(run)]
    mutable = bytearray(payload)
    copied = s.decode(mutable)
    mutable[-1] ^= 0xFF
    assert isinstance(copied, s.RecordRunResponse)
    assert copied.run == run


def test_append_records_decode_as_a_wire_record_list() -> None:
    """An AppendRequest keeps its records in the bytes they arrived in; they behave as a tuple of Records."""
    records = (REC, REC_EMPTY, REC._replace(transaction_id=7))
    payload = s.encode(s.AppendRequest(1, 2, 3, records, False))
    msg = s.decode(payload)
    assert isinstance(msg, s.AppendRequest)
    wire = msg.records
    assert isinstance(wire, s.WireRecordList)
    assert len(wire) == 3
    assert wire == records
    assert wire == list(records)
    assert records == wire
    assert hash(wire) == hash(records)
    assert wire[0] == REC
    assert wire[-1] == records[-1]
    assert wire[1:] == records[1:]
    with pytest.raises(IndexError):
        wire[3]
    assert wire.first_transaction_id == 5
    assert wire.data_bytes == 4
    assert s.encode(msg) == payload  # relayed as it came


def _records(sizes: list[int]) -> list[Record]:
    return [Record.build(i, ReqId.of(1, 2, 3, i), i, bytes(range(n))) for i, n in enumerate(sizes)]


@pytest.mark.parametrize(
    ("sizes", "record_bytes"),
    [
        ([5] * 4, 41),
        ([0] * 9, 36),
        ([5] * 3, 0),
        ([5] * 8 + [6], 0),
        ([6] + [5] * 8, 0),
        ([5, 5, 6, 5, 5], 0),
    ],
)
def test_a_record_list_of_one_size_is_decoded_in_bulk(sizes: list[int], record_bytes: int) -> None:
    """From 4 records of one size the lengths are checked in bulk and the list says its record size (what
    the storage node's bulk append needs); any other list is decoded record by record, to the same starts."""
    records = _records(sizes)
    payload = s.encode(s.AppendRequest(1, 2, 3, records, True))
    msg = s.decode(payload)
    assert isinstance(msg, s.AppendRequest)
    assert isinstance(msg.records, s.WireRecordList)
    assert msg.records.record_bytes == record_bytes
    assert msg.records == records
    assert msg.offline  # the field after the list is read where the list ends
    assert msg.records.starts[-1] - msg.records.starts[0] == sum(36 + n for n in sizes)
    assert s.encode(msg) == payload


@pytest.mark.parametrize("cut", [1, 4, 41, 200])
def test_a_record_list_of_one_size_cut_short_is_refused(cut: int) -> None:
    payload = s.encode(s.AppendRequest(1, 2, 3, _records([5] * 6), False))
    with pytest.raises(RemoteProtocolError):
        s.decode(payload[: len(payload) - 1 - cut])  # the offline flag and ``cut`` bytes of the records


@given(st.binary(max_size=300))
def test_a_decoded_append_always_yields_its_records(body: bytes) -> None:
    """The shape is checked on decoding, so reading the records later cannot fail."""
    try:
        msg = s.decode(bytes.fromhex(p(6)) + body)
    except RemoteProtocolError:
        return
    assert isinstance(msg, s.AppendRequest)
    assert len(list(msg.records)) == len(msg.records)


def test_a_record_run_response_in_parts_is_its_encoding_with_the_run_not_copied() -> None:
    run = bytes.fromhex(STORED_REC_HEX)
    head, body = s.record_run_response_parts(1, 2, 3, 1, run)
    assert body is run
    assert head + body == s.encode(s.RecordRunResponse(1, 2, 3, 1, run))
    with pytest.raises(LocalProtocolError, match="out of range"):
        s.record_run_response_parts(2**63, 2, 3, 1, run)


def test_the_truncate_and_replica_trailers_are_canonical_and_bounded() -> None:
    """A trailer is sent only when it says something; unknown flag bits, a null or oversized reason and an
    empty trailer are refused; an encoder refuses a reason the wire may not carry."""
    lsi = p(3) + "0000000000000009 000000000000000a 0000000000000008 "
    with pytest.raises(RemoteProtocolError, match="unknown replica flags"):
        s.decode(bytes.fromhex(lsi + "02"))
    with pytest.raises(RemoteProtocolError, match="trailing"):
        s.decode(bytes.fromhex(lsi + "00"))
    trunc = p(5) + "0000000000000063 00 "
    with pytest.raises(RemoteProtocolError, match="unknown truncate flags"):
        s.decode(bytes.fromhex(trunc + "02 00000000"))
    with pytest.raises(RemoteProtocolError, match="trailing"):
        s.decode(bytes.fromhex(trunc + "00 00000000"))
    with pytest.raises(RemoteProtocolError, match=r"0\.\.256 bytes, not null"):
        s.decode(bytes.fromhex(trunc + "01 ffffffff"))
    long_reason = bytes(257).hex()
    with pytest.raises(RemoteProtocolError, match="not 257"):
        s.decode(bytes.fromhex(trunc + "01 00000101 " + long_reason))
    with pytest.raises(RemoteProtocolError, match="UTF-8"):
        s.decode(bytes.fromhex(trunc + "01 00000001 ff"))
    with pytest.raises(LocalProtocolError, match="at most 256"):
        s.encode(s.TruncateRequest(1, 2, 3, 5, False, reason="é" * 129))
    assert s.encode(s.TruncateRequest(1, 2, 3, 5, False, reason="é" * 128))


def test_every_codec_version_is_the_messages_it_adds() -> None:
    """V0 is Waltz 0.1.0's whole message set (1-25); every later version must add a message type (V1:
    26/27, V2: 28 in storage_multi), and no message may be newer than the newest version this codec speaks
    (a new message is a new version)."""
    classes: set[type[s.StorageMessage] | type[sm.MultiAppendRequest]] = {type(msg) for msg, _ in CASES}
    classes.add(sm.MultiAppendRequest)
    assert {cls.TYPE for cls in classes if cls.MIN_VERSION == 0} == set(range(1, 26))
    assert {cls.TYPE for cls in classes if cls.MIN_VERSION == 1} == {26, 27}
    assert {cls.TYPE for cls in classes if cls.MIN_VERSION == 2} == {28}
    assert max(cls.MIN_VERSION for cls in classes) == max(s.STORAGE_VERSIONS)
    assert {cls.MIN_VERSION for cls in classes} == set(s.STORAGE_VERSIONS)


def test_a_v1_message_is_refused_by_a_v0_decoder() -> None:
    raw = s.encode(s.SegmentSizesRequest(1, 2, 3, 10))
    assert s.decode(raw, 1) == s.SegmentSizesRequest(1, 2, 3, 10)
    with pytest.raises(RemoteProtocolError, match="storage message type 26 is not in codec V0"):
        s.decode(raw, 0)
