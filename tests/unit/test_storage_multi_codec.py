"""Storage codec V2's MultiAppendRequest: golden bytes, bounds, and the one-error decoding contract."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from waltz.errors import LocalProtocolError, RemoteProtocolError
from waltz.protocol import storage as s
from waltz.protocol import storage_multi as sm
from waltz.protocol.framing import MAGIC_STORAGE, FrameDecoder, encode_frame
from waltz.protocol.records import Record, ReqId, crc32

pytestmark = pytest.mark.timeout(120)

REC = Record(5, ReqId.of(1, 2, 3, 4), 7, b"ab", crc32(b"ab"))
REC_HEX = "0000000000000005 0000000100000002 0000000300000004 00000007 00000002 6162 9e83486d"
HEAD_HEX = "1c ffffffffffffffff ffffffffffffffff ffffffff"

GOLDEN = [
    (
        # As in the module docstring: one empty append (26 bytes).
        sm.MultiAppendRequest((s.AppendRequest(5, 6, 7, (), False),)),
        HEAD_HEX + " 00000001 0000001a 06 0000000000000005 0000000000000006 00000007 00000000 00",
    ),
    (
        # Two partitions' appends, each with its own session, sequence number and partition; one offline.
        sm.MultiAppendRequest(
            (s.AppendRequest(1, 10, 0, (REC,), False), s.AppendRequest(2, 11, 255, (), True))
        ),
        HEAD_HEX
        + " 00000002"
        + " 00000040 06 0000000000000001 000000000000000a 00000000 00000001 "
        + REC_HEX
        + " 00"
        + " 0000001a 06 0000000000000002 000000000000000b 000000ff 00000000 01",
    ),
]


def _decoded_appends(msg: s.StorageMessage | sm.MultiAppendRequest) -> tuple[s.AppendRequest, ...]:
    assert isinstance(msg, sm.MultiAppendRequest)
    return tuple(msg.appends)


@pytest.mark.parametrize(("msg", "hex_"), GOLDEN)
def test_golden_bytes(msg: sm.MultiAppendRequest, hex_: str) -> None:
    raw = bytes.fromhex(hex_)
    assert sm.encode(msg) == raw
    decoded = _decoded_appends(sm.decode(raw, 2))
    # Appends decode with their records kept as received (a wire record list): compare them as records.
    assert [(a.session_id, a.seq_num, a.partition_id, tuple(a.records), a.offline) for a in decoded] == [
        (a.session_id, a.seq_num, a.partition_id, tuple(a.records), a.offline) for a in msg.appends
    ]


@pytest.mark.parametrize(("msg", "hex_"), GOLDEN)
def test_decoded_from_frames_fed_one_byte_at_a_time(msg: sm.MultiAppendRequest, hex_: str) -> None:
    framed = encode_frame(MAGIC_STORAGE, 2, bytes.fromhex(hex_)) * 2
    decoder = FrameDecoder(1024)
    decoded = []
    for i in range(len(framed)):
        decoder.receive_data(framed[i : i + 1])
        while (frame := decoder.next_frame()) is not None:
            decoded.append(_decoded_appends(sm.decode(frame.payload, 2)))
    assert [len(d) for d in decoded] == [len(msg.appends)] * 2


@pytest.mark.parametrize(("msg", "hex_"), GOLDEN)
def test_trailing_and_truncated_payloads_are_refused(msg: sm.MultiAppendRequest, hex_: str) -> None:
    raw = bytes.fromhex(hex_)
    with pytest.raises(RemoteProtocolError):
        sm.decode(raw + b"\x00", 2)
    for cut in range(1, len(raw)):
        with pytest.raises(RemoteProtocolError):
            sm.decode(raw[:cut], 2)


def test_the_parts_encoder_is_the_message_encoder() -> None:
    appends = [s.AppendRequest(1, i, i, (REC,), False) for i in range(3)]
    body = s.append_request_body((REC,))
    parts = [s.encode_append_request(1, i, i, body) for i in range(3)]
    assert sm.encode_multi_append(parts) == sm.encode(sm.MultiAppendRequest(tuple(appends)))


def test_a_v2_message_is_refused_below_v2() -> None:
    raw = sm.encode(GOLDEN[0][0])
    for version in (0, 1):
        with pytest.raises(RemoteProtocolError, match="type 28 is not in codec V"):
            sm.decode(raw, version)
    # The V0/V1 decoder of storage.py does not know it at all.
    with pytest.raises(RemoteProtocolError, match="unknown storage message type 28"):
        s.decode(raw)


def test_other_messages_decode_as_storage_py_decodes_them() -> None:
    raw = s.encode(s.SegmentSizesRequest(1, 2, 3, 10))
    assert sm.decode(raw, 1) == s.decode(raw, 1)
    with pytest.raises(RemoteProtocolError, match="type 26 is not in codec V0"):
        sm.decode(raw, 0)
    with pytest.raises(RemoteProtocolError, match="truncated"):
        sm.decode(b"", 2)


def test_counts_out_of_bounds_are_refused_both_ways() -> None:
    with pytest.raises(LocalProtocolError, match="1 to 256 appends, not 0"):
        sm.encode_multi_append([])
    part = s.encode(s.AppendRequest(1, 2, 3, (), False))
    with pytest.raises(LocalProtocolError, match="not 257"):
        sm.encode_multi_append([part] * 257)
    assert sm.decode(sm.encode_multi_append([part] * 256), 2)
    head = bytes.fromhex(HEAD_HEX)
    with pytest.raises(RemoteProtocolError, match="not 0"):
        sm.decode(head + bytes.fromhex("00000000"), 2)
    body = (len(part).to_bytes(4, "big") + part) * 257
    with pytest.raises(RemoteProtocolError, match="not 257"):
        sm.decode(head + (257).to_bytes(4, "big") + body, 2)
    with pytest.raises(RemoteProtocolError, match="exceeds what the message can hold"):
        sm.decode(head + bytes.fromhex("7fffffff"), 2)  # a count the payload cannot hold


def test_a_contained_message_that_is_not_an_append_is_refused_by_name() -> None:
    other = s.encode(s.MaxTransactionIdRequest(1, 2, 3, False))
    raw = sm.encode_multi_append([s.encode(s.AppendRequest(1, 1, 0, (), False)), other])
    with pytest.raises(
        RemoteProtocolError, match=r"append 1 of a multi-append request is storage message type 13"
    ):
        sm.decode(raw, 2)
    bad = s.encode(s.AppendRequest(1, 1, 0, (), False)) + b"\x00"  # trailing byte inside the item
    with pytest.raises(RemoteProtocolError, match="append 0 of a multi-append request: "):
        sm.decode(sm.encode_multi_append([bad]), 2)
    nested = sm.encode_multi_append([s.encode(s.AppendRequest(1, 1, 0, (), False))])
    with pytest.raises(RemoteProtocolError, match="type 28"):
        sm.decode(sm.encode_multi_append([nested]), 2)
    with pytest.raises(LocalProtocolError, match="not MaxTransactionIdRequest"):
        sm.encode(sm.MultiAppendRequest((s.MaxTransactionIdRequest(1, 2, 3, False),)))  # type: ignore[arg-type]


def test_the_prefix_must_be_the_unused_one() -> None:
    raw = bytearray(sm.encode(GOLDEN[0][0]))
    raw[5] = 0  # the session id is no longer -1
    with pytest.raises(RemoteProtocolError, match=r"prefix must be \(28, -1, -1, -1\)"):
        sm.decode(bytes(raw), 2)


@given(st.binary(max_size=400))
def test_random_bodies_decode_or_raise_protocol_error(body: bytes) -> None:
    try:
        sm.decode(bytes.fromhex(HEAD_HEX) + body, 2)
    except RemoteProtocolError:
        pass


@given(st.lists(st.tuples(st.integers(0, 2**62), st.integers(0, 2**31 - 1)), min_size=1, max_size=20))
def test_any_appends_round_trip(ids: list[tuple[int, int]]) -> None:
    appends = tuple(s.AppendRequest(7, seq, pid, (REC,), False) for seq, pid in ids)
    decoded = _decoded_appends(sm.decode(sm.encode(sm.MultiAppendRequest(appends)), 2))
    assert [(a.seq_num, a.partition_id, tuple(a.records)) for a in decoded] == [
        (a.seq_num, a.partition_id, (REC,)) for a in appends
    ]
