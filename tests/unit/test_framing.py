"""Framing and hello negotiation: golden bytes, state machine transitions, the one-error contract."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from waltz.errors import FrameTooLargeError, LocalProtocolError, RemoteProtocolError
from waltz.protocol.framing import (
    FRAME_HEADER,
    FRAME_HEADER_BYTES,
    MAGIC_ADMIN,
    MAGIC_CLIENT,
    MAGIC_HELLO,
    MAGIC_STORAGE,
    MAX_HELLO_FRAME_BYTES,
    NEED_DATA,
    Event,
    Frame,
    FrameDecoder,
    HelloReceived,
    KeepAlive,
    NeedData,
    Payload,
    ProtocolConnection,
    decode_hello,
    encode_frame,
    encode_hello,
)

pytestmark = pytest.mark.timeout(60)


def drain(conn: ProtocolConnection) -> list[Event]:
    """Every event currently available."""
    events: list[Event] = []
    while (event := conn.next_event()) is not NEED_DATA:
        assert not isinstance(event, NeedData)
        events.append(event)
    return events


def pair(
    a_versions: tuple[int, ...] = (0,), b_versions: tuple[int, ...] = (0,), max_frame_bytes: int = 1024
) -> tuple[ProtocolConnection, ProtocolConnection]:
    """Two endpoints after a completed hello exchange."""
    a = ProtocolConnection(MAGIC_STORAGE, a_versions, "Waltz Storage Client", max_frame_bytes)
    b = ProtocolConnection(MAGIC_STORAGE, b_versions, "Waltz Storage Server", max_frame_bytes)
    b.receive_data(a.send_hello())
    a.receive_data(b.send_hello())
    assert isinstance(a.next_event(), HelloReceived)
    assert isinstance(b.next_event(), HelloReceived)
    return a, b


def test_magic_bytes() -> None:
    assert [ord(c) for c in "HLSA"] == [MAGIC_HELLO, MAGIC_CLIENT, MAGIC_STORAGE, MAGIC_ADMIN]


def test_frame_golden_bytes() -> None:
    assert encode_frame(MAGIC_STORAGE, 0, b"\x01\x02") == bytes.fromhex("53 0000 00000002 0102")
    assert encode_frame(MAGIC_CLIENT, 4, b"") == bytes.fromhex("4c 0004 00000000")
    assert encode_frame(MAGIC_ADMIN, -1, b"z") == bytes.fromhex("41 ffff 00000001 7a")
    with pytest.raises(LocalProtocolError):
        encode_frame(MAGIC_ADMIN, 2**15, b"")


def test_hello_golden_bytes() -> None:
    payload = encode_hello([0, 4], "Waltz")
    assert payload == bytes.fromhex("00000002 0000 0004 00000005 57616c747a")
    assert decode_hello(payload) == ((0, 4), "Waltz")
    conn = ProtocolConnection(MAGIC_STORAGE, [0], "Waltz Storage Server")
    assert conn.send_hello() == bytes.fromhex(
        "48 0000 0000001e  00000001 0000  00000014 57616c747a2053746f72616765205365727665 72"
    )


def test_hello_decoder_rejects_malformed() -> None:
    good = encode_hello([1], "x")
    for bad in (
        good[:-1],
        good + b"\x00",
        bytes.fromhex("00000000 00000000"),  # no versions
        bytes.fromhex("ffffffff 00000000"),  # negative count
        bytes.fromhex("7fffffff 0000"),  # count far beyond the payload
        bytes.fromhex("00000001 0000 ffffffff"),  # null text
        bytes.fromhex("00000001 0000 00000001 ff"),  # text not UTF-8
    ):
        with pytest.raises(RemoteProtocolError):
            decode_hello(bad)
    with pytest.raises(LocalProtocolError):
        encode_hello([], "x")
    with pytest.raises(LocalProtocolError):
        encode_hello([70000], "x")


def test_highest_common_version_is_chosen_by_both_ends() -> None:
    a = ProtocolConnection(MAGIC_CLIENT, [0, 1, 2, 3, 4], "Waltz Client")
    b = ProtocolConnection(MAGIC_CLIENT, [2, 3, 7], "Waltz Server")
    b.receive_data(a.send_hello())
    a.receive_data(b.send_hello())
    assert drain(a) == [HelloReceived((2, 3, 7), "Waltz Server", 3)]
    assert drain(b) == [HelloReceived((0, 1, 2, 3, 4), "Waltz Client", 3)]
    assert a.negotiated_version == b.negotiated_version == 3
    assert a.ready
    assert b.ready
    assert a.frame(b"hi") == bytes.fromhex("4c 0003 00000002 6869")


def test_no_common_version_fails_and_stays_failed() -> None:
    a = ProtocolConnection(MAGIC_STORAGE, [0], "a")
    b = ProtocolConnection(MAGIC_STORAGE, [1, 2], "b")
    a.receive_data(b.send_hello())
    with pytest.raises(RemoteProtocolError, match="no common version"):
        a.next_event()
    with pytest.raises(RemoteProtocolError, match="no common version"):
        a.next_event()
    assert a.negotiated_version is None


def test_second_hello_is_refused() -> None:
    a, _ = pair()
    other = ProtocolConnection(MAGIC_STORAGE, [0], "again")
    a.receive_data(other.send_hello())
    with pytest.raises(RemoteProtocolError, match="second hello"):
        a.next_event()


def test_payload_before_hello_is_refused() -> None:
    a = ProtocolConnection(MAGIC_STORAGE, [0], "a")
    a.receive_data(encode_frame(MAGIC_STORAGE, 0, b"early"))
    with pytest.raises(RemoteProtocolError, match="hello first"):
        a.next_event()


def test_wrong_magic_or_version_after_negotiation_is_refused() -> None:
    for frame in (encode_frame(MAGIC_ADMIN, 0, b"x"), encode_frame(MAGIC_STORAGE, 1, b"x")):
        a, _ = pair()
        a.receive_data(frame)
        with pytest.raises(RemoteProtocolError, match="negotiated"):
            a.next_event()


def test_oversized_frame_is_refused_from_its_header_alone() -> None:
    a, _ = pair(max_frame_bytes=1024)
    a.receive_data(bytes.fromhex("53 0000 00000401"))  # 1025 bytes announced, none sent
    with pytest.raises(FrameTooLargeError, match="1025"):
        a.next_event()
    # A frame of exactly the limit is fine.
    a, b = pair(max_frame_bytes=1024)
    a.receive_data(b.frame(bytes(1024)))
    assert drain(a) == [Payload(bytes(1024))]


def test_oversized_hello_is_refused_before_negotiation() -> None:
    a = ProtocolConnection(MAGIC_STORAGE, [0], "a", max_frame_bytes=1 << 20)
    a.receive_data(b"\x48\x00\x00" + (MAX_HELLO_FRAME_BYTES + 1).to_bytes(4, "big"))
    with pytest.raises(FrameTooLargeError):
        a.next_event()


def test_negative_length_is_refused() -> None:
    a, _ = pair()
    a.receive_data(bytes.fromhex("53 0000 ffffffff"))
    with pytest.raises(RemoteProtocolError, match="negative"):
        a.next_event()


def test_keep_alive() -> None:
    a, b = pair()
    assert b.keep_alive() == bytes.fromhex("53 0000 00000000")
    a.receive_data(b.keep_alive() + b.frame(b"x") + b.keep_alive())
    assert drain(a) == [KeepAlive(), Payload(b"x"), KeepAlive()]


def test_sending_rules() -> None:
    a = ProtocolConnection(MAGIC_STORAGE, [0], "a", max_frame_bytes=16)
    with pytest.raises(LocalProtocolError):
        a.frame(b"x")  # nothing negotiated
    with pytest.raises(LocalProtocolError):
        a.keep_alive()
    b = ProtocolConnection(MAGIC_STORAGE, [0], "b")
    a.receive_data(b.send_hello())
    assert isinstance(a.next_event(), HelloReceived)
    with pytest.raises(LocalProtocolError):
        a.frame(b"x")  # our own hello not sent yet: the peer would see a payload before it
    a.send_hello()
    with pytest.raises(LocalProtocolError):
        a.send_hello()
    with pytest.raises(LocalProtocolError):
        a.frame(bytes(17))
    with pytest.raises(LocalProtocolError):
        a.frame(b"")  # would read as a keep-alive
    assert a.frame(bytes(16))[:7] == bytes.fromhex("53 0000 00000010")


@pytest.mark.parametrize(
    "payloads",
    [[], [b"a"], [b"abc"] * 5, [b"a", b"bb", b"ccc"], [bytearray(b"xy"), memoryview(b"zw"), b"uv"]],
)
def test_frame_many_is_frame_of_each_in_order(payloads: list[bytes]) -> None:
    a, b = pair()
    framed = a.frame_many(payloads)
    assert framed == b"".join(a.frame(p) for p in payloads)
    assert a.frame_many(iter(payloads)) == framed  # any iterable
    b.receive_data(framed)
    out: list[bytes] = []
    b.take_payloads(out)
    assert out == [bytes(p) for p in payloads]


@pytest.mark.parametrize(
    "payloads", [[b"ok", b""], [b""], [b"x" * 1025], [b"x" * 1025] * 2, [b"a", bytes(1025)]]
)
def test_frame_many_refuses_what_frame_refuses_and_frames_none(payloads: list[bytes]) -> None:
    a, _ = pair()
    with pytest.raises(LocalProtocolError):
        a.frame_many(payloads)
    unready = ProtocolConnection(MAGIC_STORAGE, [0], "a")
    with pytest.raises(LocalProtocolError):
        unready.frame_many([b"x"])


def test_constructor_limits() -> None:
    with pytest.raises(LocalProtocolError):
        ProtocolConnection(MAGIC_HELLO, [0], "x")
    with pytest.raises(LocalProtocolError):
        ProtocolConnection(MAGIC_STORAGE, [], "x")
    with pytest.raises(LocalProtocolError):
        ProtocolConnection(MAGIC_STORAGE, [0], "x", max_frame_bytes=0)
    with pytest.raises(LocalProtocolError):
        FrameDecoder(2**31)


def test_stream_split_at_every_byte_gives_the_same_events() -> None:
    a = ProtocolConnection(MAGIC_STORAGE, [0, 1], "a", max_frame_bytes=4096)
    b = ProtocolConnection(MAGIC_STORAGE, [1], "b", max_frame_bytes=4096)
    b.receive_data(a.send_hello())
    assert isinstance(b.next_event(), HelloReceived)
    stream_from_b = b.send_hello()
    payloads = [b"one", bytes(range(256)) * 3, b"\x00"]
    for p in payloads:
        stream_from_b += b.frame(p)
    stream_from_b += b.keep_alive()
    expected: list[Event] = [HelloReceived((1,), "b", 1), *(Payload(p) for p in payloads), KeepAlive()]
    events: list[Event] = []
    for i in range(len(stream_from_b)):
        a.receive_data(stream_from_b[i : i + 1])
        events.extend(drain(a))
    assert events == expected


def test_frame_decoder_many_frames_in_one_read_and_partial_tail() -> None:
    d = FrameDecoder(100)
    data = b"".join(encode_frame(MAGIC_STORAGE, 0, bytes([i]) * i) for i in range(1, 50))
    d.receive_data(data + data[:5])
    frames = []
    while (f := d.next_frame()) is not None:
        frames.append(f)
    assert frames == [Frame(MAGIC_STORAGE, 0, bytes([i]) * i) for i in range(1, 50)]
    assert d.buffered_bytes == 5
    d.receive_data(data[5:8])
    assert d.next_frame() == Frame(MAGIC_STORAGE, 0, b"\x01")
    assert d.buffered_bytes == 0
    assert d.next_frame() is None


def test_large_frames_between_small_ones_in_any_read_sizes() -> None:
    """Large payloads (range-read runs) are copied out and the buffer restarted their own way: every way of
    taking frames gives the same payloads, whether reads end on a frame boundary or not."""
    sizes = [3, 200_000, 0, 17, 70_000, 1, 300_000]
    payloads = [bytes([i + 1]) * n for i, n in enumerate(sizes)]
    data = b"".join(encode_frame(MAGIC_STORAGE, 0, p) for p in payloads)
    for read_bytes in (1000, 65_536, 262_144, len(data)):
        for take in ("next_frame", "next_payload", "take_payloads"):
            d = FrameDecoder(1 << 20)
            d.expected = (MAGIC_STORAGE, 0)
            got: list[bytes] = []
            for i in range(0, len(data), read_bytes):
                d.receive_data(data[i : i + read_bytes])
                if take == "take_payloads":
                    d.take_payloads(got)  # skips the empty (keep-alive) payload
                elif take == "next_payload":
                    while (p := d.next_payload()) is not None:
                        got.append(p)
                else:
                    while (f := d.next_frame()) is not None:
                        got.append(f.payload)
            expected = [p for p in payloads if p] if take == "take_payloads" else payloads
            assert got == expected, (read_bytes, take)
            assert all(type(p) is bytes for p in got)
            assert d.buffered_bytes == 0


@given(st.binary(max_size=200))
def test_hello_decoder_raises_only_protocol_errors(data: bytes) -> None:
    try:
        decode_hello(data)
    except RemoteProtocolError:
        pass


@given(st.lists(st.binary(max_size=40), max_size=8))
def test_connection_fed_random_bytes_raises_only_protocol_errors(chunks: list[bytes]) -> None:
    a = ProtocolConnection(MAGIC_STORAGE, [0, 1], "a", max_frame_bytes=64)
    try:
        for chunk in chunks:
            a.receive_data(chunk)
            drain(a)
    except RemoteProtocolError:
        pass


@given(st.lists(st.binary(max_size=40), max_size=8))
def test_negotiated_connection_fed_random_frames_raises_only_protocol_errors(chunks: list[bytes]) -> None:
    a, _ = pair(max_frame_bytes=32)
    try:
        for chunk in chunks:
            # Mostly well-formed headers, so the payload and length paths are exercised too.
            a.receive_data(b"\x53\x00\x00" + len(chunk).to_bytes(4, "big") + chunk)
            drain(a)
    except RemoteProtocolError:
        pass


def drain_payloads(conn: ProtocolConnection) -> list[bytes]:
    payloads: list[bytes] = []
    while (payload := conn.next_payload()) is not None:
        payloads.append(payload)
    return payloads


def test_next_payload_gives_the_payload_events_split_at_every_byte_keep_alives_skipped() -> None:
    a, b = pair(max_frame_bytes=4096)
    payloads = [b"one", bytes(range(256)) * 3, b"\x00"]
    stream = b.keep_alive() + b"".join(b.frame(p) for p in payloads) + b.keep_alive() + b.frame(b"x")
    received: list[bytes] = []
    for i in range(len(stream)):
        a.receive_data(stream[i : i + 1])
        received.extend(drain_payloads(a))
    assert received == [*payloads, b"x"]
    a.receive_data(stream)  # All at once, with a partial frame behind.
    a.receive_data(b.frame(b"tail")[:5])
    assert drain_payloads(a) == [*payloads, b"x"]


def test_next_payload_refuses_what_next_event_refuses_and_stays_failed() -> None:
    cases = [
        (encode_frame(MAGIC_ADMIN, 0, b"x"), RemoteProtocolError, "negotiated"),
        (bytes.fromhex("53 0000 ffffffff"), RemoteProtocolError, "negative"),
        (bytes.fromhex("53 0000 00000401"), FrameTooLargeError, "1025"),
    ]
    for data, error, match in cases:
        a, _ = pair(max_frame_bytes=1024)
        a.receive_data(data)
        with pytest.raises(error, match=match):
            a.next_payload()
        with pytest.raises(error, match=match):
            a.next_payload()  # Dead: the same error again.
    with pytest.raises(LocalProtocolError):
        ProtocolConnection(MAGIC_STORAGE, [0], "a").next_payload()  # Before the hello exchange.


@given(st.lists(st.binary(max_size=40), max_size=8))
def test_next_payload_fed_random_frames_raises_only_protocol_errors(chunks: list[bytes]) -> None:
    a, _ = pair(max_frame_bytes=32)
    try:
        for chunk in chunks:
            a.receive_data(b"\x53\x00\x00" + len(chunk).to_bytes(4, "big") + chunk)
            drain_payloads(a)
    except RemoteProtocolError:
        pass


def test_take_payloads_drains_what_next_payload_gives_in_one_call() -> None:
    a, b = pair(max_frame_bytes=4096)
    payloads = [b"one", bytes(range(256)) * 3, b"\x00"]
    stream = b.keep_alive() + b"".join(b.frame(p) for p in payloads) + b.keep_alive() + b.frame(b"x")
    received: list[bytes] = []
    for i in range(len(stream)):
        a.receive_data(stream[i : i + 1])
        a.take_payloads(received)
    assert received == [*payloads, b"x"]
    a.receive_data(stream)  # All at once, with a partial frame behind: kept for the next call.
    a.receive_data(b.frame(b"tail")[:5])
    out: list[bytes] = []
    a.take_payloads(out)
    assert out == [*payloads, b"x"]
    a.receive_data(b.frame(b"tail")[5:])
    a.take_payloads(out)
    assert out[-1] == b"tail"


def test_take_payloads_keeps_the_payloads_before_an_error_and_stays_failed() -> None:
    a, b = pair(max_frame_bytes=1024)
    a.receive_data(b.frame(b"good") + bytes.fromhex("53 0000 00000401"))
    out: list[bytes] = []
    with pytest.raises(FrameTooLargeError, match="1025"):
        a.take_payloads(out)
    assert out == [b"good"]
    with pytest.raises(FrameTooLargeError, match="1025"):
        a.take_payloads(out)  # Dead: the same error again.
    with pytest.raises(LocalProtocolError):
        ProtocolConnection(MAGIC_STORAGE, [0], "a").take_payloads(out)  # Before the hello exchange.


def test_payloads_never_alias_a_buffer_the_reader_overwrites() -> None:
    """The decoder keeps the read itself as its buffer when it can (no copy): a payload handed out must still
    be its own bytes after the caller reuses a bytearray or memoryview it read into, and after later reads
    (small or large tails joined or assembled)."""
    sizes = [60, 600, 5, 70_000, 60, 600]
    payloads = [bytes([i + 1]) * n for i, n in enumerate(sizes)]
    data = b"".join(encode_frame(MAGIC_STORAGE, 0, p) for p in payloads)
    for read_bytes in (7, 100, 1000, 65_536, len(data)):
        for kind in (bytes, bytearray, memoryview):
            d = FrameDecoder(1 << 20)
            d.expected = (MAGIC_STORAGE, 0)
            got: list[bytes] = []
            scratch = bytearray(read_bytes)
            for i in range(0, len(data), read_bytes):
                chunk = data[i : i + read_bytes]
                scratch[: len(chunk)] = chunk
                view = memoryview(scratch)[: len(chunk)]
                d.receive_data(
                    bytes(view) if kind is bytes else view if kind is memoryview else scratch[: len(chunk)]
                )
                view.release()
                d.take_payloads(got)
                scratch[:] = b"\xee" * read_bytes  # The caller reuses its read buffer.
            assert got == payloads, (read_bytes, kind)
            assert all(type(p) is bytes for p in got)


def test_a_large_frame_across_reads_is_collected_then_handed_out_before_what_follows_it() -> None:
    """A frame of 16 KiB or more that straddles reads is collected read by read and joined once: what it has
    received counts as buffered all along, and the frames after it in its last read come right after it."""
    big = bytes(range(256)) * 1200  # 307,200 bytes
    data = b"".join(encode_frame(MAGIC_STORAGE, 0, p) for p in (b"a", big, b"bc", b"", b"d"))
    for take in ("next_frame", "next_payload", "take_payloads"):
        d = FrameDecoder(1 << 20)
        d.expected = (MAGIC_STORAGE, 0)
        got: list[bytes] = []
        fed = taken = 0
        for i in range(0, len(data), 65_536):
            chunk = data[i : i + 65_536]
            d.receive_data(chunk)
            fed += len(chunk)
            if take == "take_payloads":
                d.take_payloads(got)
            elif take == "next_payload":
                while (p := d.next_payload()) is not None:
                    got.append(p)
            else:
                while (f := d.next_frame()) is not None:
                    assert (f.magic, f.version) == (MAGIC_STORAGE, 0)
                    got.append(f.payload)
            taken = sum(FRAME_HEADER_BYTES + len(p) for p in got)
            if take == "take_payloads" and len(got) == 4:
                taken += FRAME_HEADER_BYTES  # the keep-alive it skipped
            assert d.buffered_bytes == fed - taken, (take, i)
        expected = [b"a", big, b"bc", b"d"] if take == "take_payloads" else [b"a", big, b"bc", b"", b"d"]
        assert got == expected, take
        assert type(got[1]) is bytes
        assert d.buffered_bytes == 0


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.sampled_from([0, 1, 100, 16_383, 16_384, 20_000, 70_000]), min_size=1, max_size=6),
    cuts=st.lists(st.integers(min_value=1, max_value=50_000), min_size=1, max_size=12),
)
def test_frames_of_any_sizes_cut_anywhere_are_decoded_whole_and_in_order(
    sizes: list[int], cuts: list[int]
) -> None:
    payloads = [bytes([i + 1]) * n for i, n in enumerate(sizes)]
    data = b"".join(encode_frame(MAGIC_STORAGE, 0, p) for p in payloads)
    reads = []
    pos = 0
    for n in itertools.cycle(cuts):
        if pos >= len(data):
            break
        reads.append(data[pos : pos + n])
        pos += n
    d = FrameDecoder(1 << 20)
    d.expected = (MAGIC_STORAGE, 0)
    got: list[bytes] = []
    for i, chunk in enumerate(reads):
        d.receive_data(bytearray(chunk) if i % 2 else chunk)
        if i % 3 == 0:
            continue  # not drained after every read: several frames may wait in the buffer
        d.take_payloads(got)
    d.take_payloads(got)
    assert got == [p for p in payloads if p]
    assert d.buffered_bytes == 0


@given(
    size=st.integers(min_value=0, max_value=40),
    count=st.integers(min_value=0, max_value=40),
    tail=st.sampled_from(["none", "partial", "other size", "keep-alive"]),
    data=st.data(),
)
def test_take_payloads_of_a_read_of_same_size_frames_is_the_frame_by_frame_result(
    size: int, count: int, tail: str, data: st.DataObject
) -> None:
    """A read of many frames of one size (which ``take_payloads`` slices out in one pass) gives the payloads
    and leaves the bytes that ``next_payload`` one by one would, whatever follows them."""
    a, _ = pair(max_frame_bytes=4096)
    payloads = [data.draw(st.binary(min_size=size, max_size=size)) for _ in range(count)]
    stream = b"".join(a.frame(p) if p else a.keep_alive() for p in payloads)
    if tail == "partial":
        stream += a.frame(b"z" * (size + 3))[:-1]
    elif tail == "other size":
        stream += a.frame(b"z" * (size + 3))
    elif tail == "keep-alive":
        stream += a.keep_alive()
    fast, slow = pair(max_frame_bytes=4096)[1], pair(max_frame_bytes=4096)[1]
    fast.receive_data(stream)
    slow.receive_data(stream)
    got: list[bytes] = []
    fast.take_payloads(got)
    want = []
    while (payload := slow.next_payload()) is not None:
        if payload:
            want.append(payload)
    assert got == want
    assert fast.buffered_bytes == slow.buffered_bytes


def test_take_payloads_of_same_size_frames_of_another_codec_raises_as_one_by_one() -> None:
    """Frames of one size and a header the connection did not negotiate are refused, not sliced out."""
    _, b = pair()
    b.receive_data(encode_frame(MAGIC_CLIENT, 0, b"abc") * 20)
    with pytest.raises(RemoteProtocolError):
        b.take_payloads([])


_LIMIT = 64
_GOOD = (MAGIC_CLIENT, 3)


def _frame_of(kind: str, size: int, body: bytes) -> bytes:
    magic, version, length = MAGIC_CLIENT, 3, size
    if kind == "magic":
        magic = MAGIC_STORAGE
    elif kind == "version":
        version = 2
    elif kind == "neg":
        length = -size - 1
    return FRAME_HEADER.pack(magic, version, length) + body


@st.composite
def _runs_with_faults(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    """Runs of frames of one header (what ``take_payloads`` slices out at once: of a size at, over or under
    the limit, keep-alives among them) and single odd frames between them (another size, a bad magic or
    version, a negative length), the stream cut into reads at frame boundaries or anywhere."""
    frames: list[bytes] = []
    segments = [0]  # Where each run and each odd frame after it ends: reads cut there end on a run.
    for _ in range(draw(st.integers(min_value=0, max_value=4))):
        size = draw(st.sampled_from([0, 1, 5, 12, _LIMIT, _LIMIT + 1]))
        count = draw(st.integers(min_value=0, max_value=12))
        frames.extend(
            _frame_of("same", size, draw(st.binary(min_size=size, max_size=size))) for _ in range(count)
        )
        segments.append(sum(map(len, frames)))
        kind = draw(st.sampled_from(["none", "other", "magic", "version", "neg"]))
        if kind == "other":
            other = draw(st.integers(min_value=0, max_value=_LIMIT + 1))
            frames.append(_frame_of(kind, other, bytes(other)))
        elif kind != "none":
            frames.append(_frame_of(kind, size, bytes(size)))
        segments.append(sum(map(len, frames)))
    stream = b"".join(frames)
    bounds = [0]
    for f in frames:
        bounds.append(bounds[-1] + len(f))
    anywhere = st.integers(min_value=0, max_value=len(stream))
    cuts = sorted(draw(st.lists(st.sampled_from(segments) | st.sampled_from(bounds) | anywhere, max_size=5)))
    return stream, cuts


@example((b"".join(_frame_of("same", 5, b"abcde") for _ in range(8)) + _frame_of("magic", 5, bytes(5)), []))
@example((_frame_of("same", _LIMIT + 1, bytes(_LIMIT + 1)) * 8, []))
@given(_runs_with_faults())
def test_take_payloads_over_any_reads_of_runs_and_faults_is_next_payload_one_by_one(
    case: tuple[bytes, list[int]],
) -> None:
    """Whatever the reads and wherever a bad header sits (inside a same-size run, at its end, in the next
    read), ``take_payloads`` gives the payloads, the error and the leftover bytes that ``next_payload``
    called one frame at a time gives."""
    stream, cuts = case
    reads = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    fast, slow = FrameDecoder(_LIMIT), FrameDecoder(_LIMIT)
    fast.expected = slow.expected = _GOOD
    got: list[bytes] = []
    want: list[bytes] = []
    fast_error: type[Exception] | None = None
    slow_error: type[Exception] | None = None
    for data in reads:
        if fast_error is None:
            fast.receive_data(data)
            try:
                fast.take_payloads(got)
            except RemoteProtocolError as e:
                fast_error = type(e)
        if slow_error is None:
            slow.receive_data(data)
            try:
                while (payload := slow.next_payload()) is not None:
                    if payload:
                        want.append(payload)
            except RemoteProtocolError as e:
                slow_error = type(e)
    assert got == want
    assert fast_error == slow_error
    if fast_error is None:
        assert fast.buffered_bytes == slow.buffered_bytes
