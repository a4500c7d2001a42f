"""Storage admin codec: golden bytes for every message type and the one-error decoding contract."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from waltz.errors import LocalProtocolError, PartitionNotAssignedError, RemoteProtocolError
from waltz.protocol import admin as a
from waltz.protocol.framing import MAGIC_ADMIN, FrameDecoder, encode_frame
from waltz.protocol.records import Record, ReqId, crc32
from waltz.protocol.storage import SessionInfo, StackFrame, StorageRpcFailure

pytestmark = pytest.mark.timeout(120)

KEY = uuid.UUID("00112233-4455-6677-8899-aabbccddeeff")
REC = Record(5, ReqId.of(1, 2, 3, 4), 7, b"ab", crc32(b"ab"))
REC_HEX = "0000000000000005 0000000100000002 0000000300000004 00000007 00000002 6162 9e83486d"
FAILURE = StorageRpcFailure("no", (StackFrame("PartitionNotAssignedError", "f", "x.py", 1),))
FAILURE_HEX = (
    "00000002 6e6f  00000001"
    "  00000019 506172746974696f6e4e6f7441737369676e65644572726f72  00000001 66  00000004 782e7079  00000001"
)


def p(type_code: int) -> str:
    """The prefix of a message with seq 7."""
    return f"{type_code:02x} 0000000000000007 "


CASES: list[tuple[a.AdminMessage, str]] = [
    (a.AdminSuccessResponse(7), p(1)),
    (a.AdminFailureResponse(7, FAILURE), p(2) + FAILURE_HEX),
    (a.AdminOpenRequest(-1, KEY, 4), "03 ffffffffffffffff 00112233445566778899aabbccddeeff 00000004"),
    (a.PartitionAvailableRequest(7, (1, 2), True), p(4) + "00000002 00000001 00000002 01"),
    (a.PartitionAvailableRequest(7, (), False), p(4) + "00000000 00"),
    (a.PartitionAssignmentRequest(7, (0,), False, True), p(6) + "00000001 00000000 00 01"),
    (a.RecordListRequest(7, 3, 5, 20), p(7) + "00000003 0000000000000005 00000014"),
    (a.RecordListResponse(7, 3, (REC,)), p(8) + f"00000003 00000001 {REC_HEX}"),
    (a.RecordListResponse(7, 3, ()), p(8) + "00000003 00000000"),
    (a.LastSessionInfoRequest(7, 3), p(9) + "00000003"),
    (
        a.LastSessionInfoResponse(7, 3, SessionInfo(9, 10, -1)),
        p(10) + "00000003 0000000000000009 000000000000000a ffffffffffffffff",
    ),
    (  # A damaged replica: the data port's replica-flags trailer, so the operator tools can refuse it.
        a.LastSessionInfoResponse(7, 3, SessionInfo(9, 10, 8, damaged=True)),
        p(10) + "00000003 0000000000000009 000000000000000a 0000000000000008 01",
    ),
    (a.MetricsRequest(7), p(11)),
    (a.MetricsResponse(7, '{"a":1}'), p(12) + "00000007 7b2261223a317d"),
    (a.AssignedPartitionStatusRequest(7), p(13)),
    (
        a.AssignedPartitionStatusResponse(7, (a.PartitionStatus(0, True), a.PartitionStatus(5, False))),
        p(14) + "00000002 00000000 01 00000005 00",
    ),
    (a.MaxTransactionIdRequest(7, 3), p(15) + "00000003"),
    (a.MaxTransactionIdResponse(7, 3, 99), p(16) + "00000003 0000000000000063"),
    (a.NodeIdentityRequest(7), p(17)),
    (
        a.NodeIdentityResponse(7, KEY, 4, 6000),
        p(18) + "00112233445566778899aabbccddeeff 00000004 00001770",
    ),
    (a.NodeVersionRequest(7), p(19)),
    (a.NodeVersionResponse(7, "0.2.0", 1, 2), p(20) + "00000005 302e322e30 00000001 00000002"),
]


def case_id(value: object) -> str:
    return "" if isinstance(value, str) else type(value).__name__


def test_every_message_type_has_a_golden_case() -> None:
    assert {type(msg).TYPE for msg, _ in CASES} == set(range(1, 21)) - {5}


@pytest.mark.parametrize(("msg", "hex_"), CASES, ids=case_id)
def test_golden_bytes(msg: a.AdminMessage, hex_: str) -> None:
    raw = bytes.fromhex(hex_)
    assert a.encode(msg) == raw
    assert a.decode(raw) == msg
    assert a.decode(memoryview(raw)) == msg


@pytest.mark.parametrize(("msg", "hex_"), CASES, ids=case_id)
def test_decoded_from_frames_fed_one_byte_at_a_time(msg: a.AdminMessage, hex_: str) -> None:
    framed = encode_frame(MAGIC_ADMIN, 0, bytes.fromhex(hex_)) * 2
    decoder = FrameDecoder(1024)
    decoded = []
    for i in range(len(framed)):
        decoder.receive_data(framed[i : i + 1])
        while (frame := decoder.next_frame()) is not None:
            decoded.append(a.decode(frame.payload))
    assert decoded == [msg, msg]


@pytest.mark.parametrize(("msg", "hex_"), CASES, ids=case_id)
def test_trailing_and_truncated_payloads_are_refused(msg: a.AdminMessage, hex_: str) -> None:
    raw = bytes.fromhex(hex_)
    with pytest.raises(RemoteProtocolError, match="trailing"):
        a.decode(raw + b"\x00")
    for n in range(len(raw)):
        try:
            got = a.decode(raw[:n])
        except RemoteProtocolError:
            continue
        # Only the optional replica-flags trailer may be cut off, and only whole (a frame carries its length,
        # so a payload never arrives cut): what is left is the message without it.
        assert isinstance(got, a.LastSessionInfoResponse), n
        assert a.encode(got) == raw[:n], n


def test_unknown_replica_flags_are_refused() -> None:
    with pytest.raises(RemoteProtocolError, match="unknown replica flags 0x2"):
        a.decode(bytes.fromhex(p(10) + "00000003 0000000000000009 000000000000000a 0000000000000008 02"))


def test_unknown_type_null_lists_and_impossible_counts_are_refused() -> None:
    for code in (0, 5, 21, 255):
        with pytest.raises(RemoteProtocolError, match="unknown"):
            a.decode(bytes.fromhex(p(code)))
    with pytest.raises(RemoteProtocolError, match="null"):
        a.decode(bytes.fromhex(p(4) + "ffffffff 01"))
    with pytest.raises(RemoteProtocolError):
        a.decode(bytes.fromhex(p(4) + "7fffffff 01"))
    with pytest.raises(RemoteProtocolError, match="count"):
        a.decode(bytes.fromhex(p(14) + "7fffffff 00000000 01"))
    with pytest.raises(RemoteProtocolError, match="count"):
        a.decode(bytes.fromhex(p(8) + "00000003 7fffffff"))
    with pytest.raises(RemoteProtocolError, match="null"):
        a.decode(bytes.fromhex(p(12) + "ffffffff"))
    with pytest.raises(RemoteProtocolError, match="boolean"):
        a.decode(bytes.fromhex(p(14) + "00000001 00000000 02"))


def test_a_message_newer_than_the_negotiated_version_is_refused() -> None:
    """V1 messages (19/20) are protocol errors on a V0 connection (Waltz 0.1.0 never sends them either)."""
    assert a.ADMIN_VERSIONS == (0, 1)
    for msg in (a.NodeVersionRequest(7), a.NodeVersionResponse(7, "0.2.0", 1, 2)):
        raw = a.encode(msg)
        assert a.decode(raw, 1) == msg
        with pytest.raises(
            RemoteProtocolError, match=rf"type {msg.TYPE} \({type(msg).__name__}\) is not in codec V0"
        ):
            a.decode(raw, 0)
        assert not a.available(type(msg), 0)
        assert a.available(type(msg), 1)
    assert all(a.available(type(m), 0) for m, _ in CASES if type(m).TYPE <= 18)


def test_encoder_refuses_values_the_wire_cannot_carry() -> None:
    for bad in (
        a.AdminSuccessResponse(2**63),
        a.PartitionAvailableRequest(0, (2**31,), True),
        a.LastSessionInfoRequest(0, -(2**31) - 1),
        a.AssignedPartitionStatusResponse(0, (a.PartitionStatus(2**31, True),)),
    ):
        with pytest.raises(LocalProtocolError):
            a.encode(bad)
    with pytest.raises(LocalProtocolError):
        a.encode(a.AdminMessage(0))


def test_failure_round_trip_keeps_the_error_class() -> None:
    msg = a.failure_from_error(7, PartitionNotAssignedError("Partition:3 is not assigned."))
    decoded = a.decode(a.encode(msg))
    assert isinstance(decoded, a.AdminFailureResponse)
    error = a.failure_to_error(decoded)
    assert type(error) is PartitionNotAssignedError
    assert str(error) == "Partition:3 is not assigned."
    assert type(a.failure_to_error(FAILURE)) is PartitionNotAssignedError
    assert a.seq_num_of(decoded) == 7


@given(st.binary(max_size=300))
def test_random_bytes_decode_or_raise_protocol_error(data: bytes) -> None:
    try:
        a.decode(data)
    except RemoteProtocolError:
        pass


@given(st.integers(1, 16), st.binary(max_size=200))
def test_random_bodies_decode_or_raise_protocol_error(type_code: int, body: bytes) -> None:
    try:
        a.decode(bytes.fromhex(p(type_code)) + body)
    except RemoteProtocolError:
        pass


@given(st.lists(st.tuples(st.integers(-(2**31), 2**31 - 1), st.booleans()), max_size=20))
def test_partition_status_round_trip(statuses: list[tuple[int, bool]]) -> None:
    msg = a.AssignedPartitionStatusResponse(1, tuple(a.PartitionStatus(i, b) for i, b in statuses))
    assert a.decode(a.encode(msg)) == msg


def test_every_admin_codec_version_is_the_messages_it_adds() -> None:
    classes = {type(msg) for msg, _ in CASES}
    assert {cls.MIN_VERSION for cls in classes} == set(a.ADMIN_VERSIONS)
