"""Framing and hello negotiation, sans-I/O: bytes in, events out; payloads in, bytes out.

Every Waltz connection (client<->server, server<->storage, storage admin) carries the same frames. All
integers are big-endian::

    frame      u8  magic        which codec the payload belongs to (table below)
               i16 version      the codec version
               i32 length       payload length in bytes, 0 <= length <= max_frame_bytes
               payload          exactly ``length`` bytes

    magic      0x48 'H' hello · 0x4C 'L' client<->server · 0x53 'S' storage · 0x41 'A' storage admin

    keep-alive a frame of the negotiated magic and version with length 0; the receiver ignores it

    hello      (magic 'H', version 0) payload:
               i32 n                    number of supported versions, 1 <= n <= MAX_HELLO_VERSIONS
               n x i16 version          the versions of the connection's codec this end supports
               string text              i32 length + UTF-8, e.g. "Waltz Storage Server"

Both ends send a hello as soon as the connection is up. On receiving the peer's hello each end independently
picks the highest version present in both sets; from then on every frame must carry the connection's magic
and that version. A second hello, a frame of any other codec, a payload before the hello, or hellos without a
common version are protocol errors: the connection must be closed.

:class:`FrameDecoder` splits a byte stream into frames and refuses an oversized or negative length as soon as
the 7-byte header arrives (before any of the payload is waited for). :class:`ProtocolConnection` is the
per-endpoint state machine in the style of h11: feed it bytes with :meth:`~ProtocolConnection.receive_data`,
pull events with :meth:`~ProtocolConnection.next_event`, and build outgoing bytes with
:meth:`~ProtocolConnection.send_hello`, :meth:`~ProtocolConnection.frame` and
:meth:`~ProtocolConnection.keep_alive`. Nothing here touches a socket.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, Literal

from waltz.errors import FrameTooLargeError, LocalProtocolError, RemoteProtocolError
from waltz.protocol.wire import I16, I32, I32_MAX, Reader

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "FRAME_HEADER_BYTES",
    "HELLO_VERSION",
    "MAGIC_ADMIN",
    "MAGIC_CLIENT",
    "MAGIC_HELLO",
    "MAGIC_STORAGE",
    "MAX_HELLO_FRAME_BYTES",
    "MAX_HELLO_VERSIONS",
    "NEED_DATA",
    "Event",
    "Frame",
    "FrameDecoder",
    "HelloReceived",
    "KeepAlive",
    "NeedData",
    "Payload",
    "ProtocolConnection",
    "decode_hello",
    "encode_frame",
    "encode_hello",
]

MAGIC_HELLO: Final = 0x48  # 'H'
MAGIC_CLIENT: Final = 0x4C  # 'L'
MAGIC_STORAGE: Final = 0x53  # 'S'
MAGIC_ADMIN: Final = 0x41  # 'A'
HELLO_VERSION: Final = 0

_MAGIC_NAMES: Final = {
    MAGIC_HELLO: "hello",
    MAGIC_CLIENT: "client",
    MAGIC_STORAGE: "storage",
    MAGIC_ADMIN: "admin",
}

FRAME_HEADER: Final = struct.Struct(">Bhi")
FRAME_HEADER_BYTES: Final = FRAME_HEADER.size  # 7

DEFAULT_MAX_FRAME_BYTES: Final = 32 * 1024 * 1024
"""Default bound on one frame's payload; large enough for a batch of hundreds of big records."""

MAX_HELLO_FRAME_BYTES: Final = 64 * 1024
"""A hello is a few dozen bytes. Until the peer's hello is in, frames are bounded by this (or by
``max_frame_bytes`` if smaller) so an unauthenticated peer cannot make us buffer a large frame."""

MAX_HELLO_VERSIONS: Final = 256
"""At most this many versions in one hello."""


def _magic_name(magic: int) -> str:
    return f"0x{magic:02X} ({_MAGIC_NAMES.get(magic, 'unknown')})"


def encode_frame(magic: int, version: int, payload: bytes | bytearray | memoryview) -> bytes:
    """One whole frame. Raises LocalProtocolError if a header field is out of range."""
    try:
        return FRAME_HEADER.pack(magic, version, len(payload)) + payload
    except struct.error:
        raise LocalProtocolError(
            f"frame header out of range: magic={magic}, version={version}, length={len(payload)}"
        ) from None


def encode_hello(versions: Iterable[int], text: str) -> bytes:
    """The hello payload (without its frame) announcing ``versions`` and ``text``."""
    vs = list(versions)
    if not 1 <= len(vs) <= MAX_HELLO_VERSIONS:
        raise LocalProtocolError(f"a hello carries 1 to {MAX_HELLO_VERSIONS} versions, got {len(vs)}")
    raw_text = text.encode("utf-8")
    try:
        return b"".join(
            (I32.pack(len(vs)), struct.pack(f">{len(vs)}h", *vs), I32.pack(len(raw_text)), raw_text)
        )
    except struct.error:
        raise LocalProtocolError(f"hello version out of the i16 range: {vs!r}") from None


def decode_hello(payload: bytes) -> tuple[tuple[int, ...], str]:
    """Decode a hello payload into (versions, text); raises RemoteProtocolError if malformed."""
    r = Reader(payload)
    n = r.count(I16.size)
    if not 1 <= n <= MAX_HELLO_VERSIONS:
        raise RemoteProtocolError(f"a hello must carry 1 to {MAX_HELLO_VERSIONS} versions, got {n}")
    versions = struct.unpack_from(f">{n}h", payload, r._take(2 * n))
    text = r.string_required()
    r.expect_end()
    return versions, text


@dataclass(frozen=True, slots=True)
class Frame:
    """One decoded frame. ``payload`` is empty for a keep-alive."""

    magic: int
    version: int
    payload: bytes

    @property
    def is_keep_alive(self) -> bool:
        return not self.payload


_LARGE_PAYLOAD_BYTES: Final = 16 * 1024
"""From this size on, a payload is copied out of an assembly bytearray through a memoryview (see _extract)."""


def _extract(buf: bytes | bytearray, start: int, end: int) -> bytes:
    """``bytes(buf[start:end])``, copied once where that is cheapest. A slice of bytes (the read itself) is
    bytes already. A slice of a bytearray is a fresh bytearray copied again into the bytes, whose pages are
    faulted in on every frame: a large payload (a range read's record run) is copied once through a
    memoryview instead; small payloads keep the slice, cheaper below a few KiB than making a memoryview."""
    if type(buf) is bytes:
        return buf[start:end]
    if end - start < _LARGE_PAYLOAD_BYTES:
        return bytes(buf[start:end])
    with memoryview(buf) as view:
        return view[start:end].tobytes()


_RUN_MIN_FRAMES: Final = 8
"""From this many frames of one header in one read on, :meth:`FrameDecoder.take_payloads` slices them out in
one comprehension (below it the checks cost more than the loop they save)."""

_ASSEMBLY_BYTES: Final = 16 * 1024
"""A partial frame this large or larger is assembled in a bytearray rather than joined to each new read."""


class FrameDecoder:
    """Splits a byte stream into :class:`Frame` objects.

    Guarantees: a header announcing a negative length, or more than :attr:`max_frame_bytes`, raises as soon as
    its 7 bytes are buffered (:class:`~waltz.errors.FrameTooLargeError` for too large), so memory held for the
    current frame never exceeds the limit. If :attr:`expected` is set, a header of any other (magic, version)
    raises :class:`~waltz.errors.RemoteProtocolError` before the payload is awaited too. After an error the
    decoder is dead: every later call raises the same error again.

    Callers should drain :meth:`next_frame` until it returns None after each :meth:`receive_data`; buffered
    bytes are then bounded by one frame plus one read.
    """

    __slots__ = (
        "_buf",
        "_error",
        "_header",
        "_length",
        "_need",
        "_parts",
        "_pos",
        "_ready",
        "expected",
        "max_frame_bytes",
    )

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        if not 0 < max_frame_bytes <= I32_MAX:
            raise LocalProtocolError(f"max_frame_bytes must be in 1..{I32_MAX}, got {max_frame_bytes}")
        self.max_frame_bytes = max_frame_bytes
        self.expected: tuple[int, int] | None = None
        self._buf: bytes | bytearray = b""
        """The bytes received and not yet taken from :attr:`_pos` on: the last read itself (bytes), or a
        bytearray while a frame straddles reads."""
        self._pos = 0
        self._error: RemoteProtocolError | None = None
        self._parts: list[bytes | memoryview] | None = None
        """The payload received so far of a large frame that straddles reads (see :meth:`_collect`)."""
        self._need = 0
        """Bytes of that payload still to come."""
        self._length = 0
        """That payload's length."""
        self._header = (0, 0)
        """(magic, version) of that frame."""
        self._ready: bytes | None = None
        """The payload of a large frame completed by a read, handed out before the bytes after it."""

    @property
    def buffered_bytes(self) -> int:
        """Bytes received but not yet returned as a frame."""
        n = len(self._buf) - self._pos
        if self._parts is not None:
            n += FRAME_HEADER_BYTES + self._length - self._need
        if self._ready is not None:
            n += FRAME_HEADER_BYTES + len(self._ready)
        return n

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Append bytes read from the stream.

        When nothing is pending (reads end on frame boundaries, the common case) the read itself becomes the
        buffer, without a copy, and each payload is then sliced out of it in one copy: bytes are immutable, so
        a payload can never see bytes a later read wrote. Only a large frame that straddles reads is assembled
        in a bytearray, until the buffer is empty again; a frame of at least 16 KiB that straddles reads is
        collected read by read and joined once when its last byte arrives (see :meth:`_collect`)."""
        parts = self._parts
        if parts is not None:
            need = self._need
            n = len(data)
            if type(data) is not bytes:
                data = bytes(data)  # the caller may reuse its buffer: keep our own bytes
            if n < need:
                parts.append(data)
                self._need = need - n
                return
            parts.append(data if n == need else memoryview(data)[:need])
            # The frame's one copy: into a bytes object of exactly its size (no growing, no slicing out).
            self._ready = b"".join(parts)
            self._parts = None
            self._need = 0
            # What follows the frame in this read is the buffer, read in place as any read is.
            self._buf = data if n > need else b""
            self._pos = need if n > need else 0
            return
        buf = self._buf
        pos = self._pos
        pending = len(buf) - pos
        if not pending:
            self._buf = data if type(data) is bytes else bytes(data)
            self._pos = 0
            return
        if pending < _ASSEMBLY_BYTES:
            # The tail of a frame cut by the end of a read (usual under a steady stream): joined with the new
            # read into bytes again, so that the payloads after it are still sliced out in one copy.
            with memoryview(buf) as view:
                self._buf = b"".join((view[pos:], data))
            self._pos = 0
            return
        # A large frame arriving over many reads: a bytearray grows by amortised appends, where joining bytes
        # would copy everything received so far on every read.
        if type(buf) is not bytearray:
            with memoryview(buf) as view:
                assembly = bytearray(view[pos:])
            assembly += data
            self._buf = assembly
        else:
            if pos:
                # Drop consumed bytes before growing; deleting a bytearray's head is cheap in CPython.
                del buf[:pos]
            buf += data
        self._pos = 0

    def next_frame(self) -> Frame | None:
        """The next complete frame, or None if more bytes are needed."""
        if self._error is not None:
            raise self._error
        ready = self._ready
        if ready is not None:
            self._ready = None
            return Frame(*self._header, ready)
        buf = self._buf
        pos = self._pos
        if len(buf) - pos < FRAME_HEADER_BYTES:
            return None
        magic, version, length = FRAME_HEADER.unpack_from(buf, pos)
        self._check_header(magic, version, length)
        start = pos + FRAME_HEADER_BYTES
        end = start + length
        if end > len(buf):
            self._collect(start, end, magic, version)
            return None
        payload = _extract(buf, start, end)
        if end == len(buf):
            # Common case: the read ended on a frame boundary, so reuse the buffer from its start.
            self._restart()
        else:
            self._pos = end
        return Frame(magic, version, payload)

    def next_payload(self) -> bytes | None:
        """The next complete frame's payload alone, without a :class:`Frame` (for a reader that set
        :attr:`expected`, to whom magic and version say nothing more), or None if more bytes are needed.
        Checks and errors as :meth:`next_frame`."""
        if self._error is not None:
            raise self._error
        ready = self._ready
        if ready is not None:
            self._ready = None
            return ready
        buf = self._buf
        pos = self._pos
        n = len(buf)
        if n - pos < FRAME_HEADER_BYTES:
            return None
        magic, version, length = FRAME_HEADER.unpack_from(buf, pos)
        if (magic, version) != self.expected or not 0 <= length <= self.max_frame_bytes:
            self._check_header(magic, version, length)
        start = pos + FRAME_HEADER_BYTES
        end = start + length
        if end > n:
            self._collect(start, end, magic, version)
            return None
        payload = _extract(buf, start, end)
        if end == n:
            self._restart()
        else:
            self._pos = end
        return payload

    def take_payloads(self, out: list[bytes]) -> None:
        """Append the payload of every complete frame buffered to ``out``, in order, skipping empty ones
        (keep-alives): :meth:`next_payload` drained in one call (a client reads a burst of small feed frames
        per socket read). Checks and errors as :meth:`next_payload`; on an error, the payloads of the frames
        before it are in ``out`` already."""
        if self._error is not None:
            raise self._error
        ready = self._ready
        if ready is not None:
            self._ready = None
            out.append(ready)  # (a large frame: never a keep-alive)
        buf = self._buf
        pos = self._pos
        n = len(buf)
        expected = self.expected
        limit = self.max_frame_bytes
        unpack = FRAME_HEADER.unpack_from
        read = buf if type(buf) is bytes else None  # the read itself: payloads are slices of it
        if read is not None and n - pos >= _RUN_MIN_FRAMES * (FRAME_HEADER_BYTES + 1):
            # A read of many frames of one size (a client's feed, a burst of same-size appends): when every
            # frame header in it is the same valid one, the payloads are sliced out by one comprehension
            # (the headers compared in C, a strided slice per header byte) instead of a loop per frame.
            magic, version, length = unpack(read, pos)
            step = FRAME_HEADER_BYTES + length
            if length > 0 and (n - pos) % step == 0 and (magic, version) == expected and length <= limit:
                count = (n - pos) // step
                if count >= _RUN_MIN_FRAMES and all(
                    read[pos + i :: step] == read[pos + i : pos + i + 1] * count
                    for i in range(FRAME_HEADER_BYTES)
                ):
                    out.extend([read[s : s + length] for s in range(pos + FRAME_HEADER_BYTES, n, step)])
                    self._restart()
                    return
        try:
            while n - pos >= FRAME_HEADER_BYTES:
                magic, version, length = unpack(buf, pos)
                if (magic, version) != expected or not 0 <= length <= limit:
                    self._check_header(magic, version, length)
                start = pos + FRAME_HEADER_BYTES
                end = start + length
                if end > n:
                    if self._collect(start, end, magic, version):
                        pos = n  # all of it taken: the buffer restarts below
                    break
                if length:
                    # Slicing bytes (the read itself) copies the payload once; see _extract for a bytearray.
                    out.append(read[start:end] if read is not None else _extract(buf, start, end))
                pos = end
        finally:
            if pos == n:
                self._restart()  # Ended on a frame boundary (the common case): start the buffer over.
            else:
                self._pos = pos

    def _collect(self, start: int, end: int, magic: int, version: int) -> bool:
        """The frame whose payload is ``[start, end)`` of the buffer is at its head and incomplete: if it is
        large, take what there is of it out of the buffer and collect the rest read by read
        (:meth:`receive_data`), to join its payload once, when its last byte arrives. Returns whether it did
        (the buffer is then empty).

        A range read's record run (megabytes, arriving in reads of 64-256 KiB) used to be assembled in a
        bytearray grown read by read and then copied out into the payload: two copies of every byte and the
        reallocations; joining the reads is one copy into a buffer of the right size."""
        if end - start < _ASSEMBLY_BYTES:
            return False
        buf = self._buf
        # The head of the payload: a view of the read itself (bytes) or of our own assembly bytearray, which
        # nothing writes once the buffer restarts.
        self._parts = [memoryview(buf)[start:]]
        self._need = end - len(buf)
        self._length = end - start
        self._header = (magic, version)
        self._restart()
        return True

    def _restart(self) -> None:
        """Empty the buffer once every byte in it was taken. An assembly bytearray is dropped rather than
        cleared: the next read becomes the buffer itself, where after ``bytearray.clear()`` a large frame
        would grow it again by reallocations."""
        self._buf = b""
        self._pos = 0

    def _check_header(self, magic: int, version: int, length: int) -> None:
        error: RemoteProtocolError | None = None
        if self.expected is not None and (magic, version) != self.expected:
            want_magic, want_version = self.expected
            if want_magic == MAGIC_HELLO:
                error = RemoteProtocolError(
                    f"expected the peer's hello first, got a frame with magic {_magic_name(magic)}"
                    f" version {version}"
                )
            elif magic == MAGIC_HELLO:
                error = RemoteProtocolError("second hello received after version negotiation")
            else:
                error = RemoteProtocolError(
                    f"frame with magic {_magic_name(magic)} version {version}; the connection negotiated"
                    f" magic {_magic_name(want_magic)} version {want_version}"
                )
        elif length < 0:
            error = RemoteProtocolError(f"frame announces a negative length {length}")
        elif length > self.max_frame_bytes:
            error = FrameTooLargeError(
                f"frame of {length} bytes exceeds the limit of {self.max_frame_bytes} bytes"
                f" (magic {_magic_name(magic)}, version {version})"
            )
        if error is not None:
            self._error = error
            raise error


@dataclass(frozen=True, slots=True)
class HelloReceived:
    """The peer's hello arrived; ``negotiated_version`` is now in force for both directions."""

    versions: tuple[int, ...]
    text: str
    negotiated_version: int


@dataclass(frozen=True, slots=True)
class Payload:
    """One frame of the negotiated codec (the codec's message bytes, without the frame header)."""

    data: bytes


@dataclass(frozen=True, slots=True)
class KeepAlive:
    """The peer sent a keep-alive frame; nothing to do."""


class NeedData(enum.Enum):
    """Sentinel type of :data:`NEED_DATA`."""

    NEED_DATA = "NEED_DATA"


NEED_DATA: Final = NeedData.NEED_DATA
"""Returned by :meth:`ProtocolConnection.next_event` when no complete frame is buffered."""

Event = HelloReceived | Payload | KeepAlive

_KEEP_ALIVE: Final = KeepAlive()


class ProtocolConnection:
    """One endpoint's framing state machine (either side of a connection; the protocol is symmetric).

    States and transitions (anything else raises)::

        state          input                           result
        -------------  ------------------------------  --------------------------------------------------
        AWAIT_HELLO    peer hello with a common        HelloReceived; state NEGOTIATED
                       version
        AWAIT_HELLO    peer hello, nothing in common   RemoteProtocolError
        AWAIT_HELLO    any other frame                 RemoteProtocolError ("payload before hello")
        NEGOTIATED     frame (magic, negotiated)       Payload, or KeepAlive if empty
        NEGOTIATED     a hello                         RemoteProtocolError ("second hello")
        NEGOTIATED     any other magic or version      RemoteProtocolError
        any            RemoteProtocolError raised      ERROR: every later next_event raises it again

    Sending: :meth:`send_hello` exactly once, first; :meth:`frame` and :meth:`keep_alive` only after our hello
    was sent and the peer's received (both ends must agree on the version before any payload is written),
    otherwise :class:`~waltz.errors.LocalProtocolError`.
    """

    __slots__ = (
        "_decoder",
        "_hello_sent",
        "hello_text",
        "magic",
        "max_frame_bytes",
        "negotiated_version",
        "peer_hello",
        "versions",
    )

    def __init__(
        self,
        magic: int,
        versions: Iterable[int],
        hello_text: str,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    ) -> None:
        if magic == MAGIC_HELLO or not 0 <= magic <= 0xFF:
            raise LocalProtocolError(f"invalid codec magic {magic}")
        vs = tuple(sorted(set(versions)))
        if not vs or len(vs) > MAX_HELLO_VERSIONS or vs[0] < -(2**15) or vs[-1] >= 2**15:
            raise LocalProtocolError(f"supported versions must be 1 to {MAX_HELLO_VERSIONS} i16 values: {vs}")
        if not 0 < max_frame_bytes <= I32_MAX:
            raise LocalProtocolError(f"max_frame_bytes must be in 1..{I32_MAX}, got {max_frame_bytes}")
        self.magic = magic
        self.versions = vs
        self.hello_text = hello_text
        self.max_frame_bytes = max_frame_bytes
        self.negotiated_version: int | None = None
        self.peer_hello: HelloReceived | None = None
        self._hello_sent = False
        self._decoder = FrameDecoder(min(max_frame_bytes, MAX_HELLO_FRAME_BYTES))
        self._decoder.expected = (MAGIC_HELLO, HELLO_VERSION)

    @property
    def ready(self) -> bool:
        """True once our hello was sent and the peer's received: payloads may flow both ways."""
        return self._hello_sent and self.negotiated_version is not None

    @property
    def buffered_bytes(self) -> int:
        """Bytes received from the peer and not yet returned as an event or payload."""
        return self._decoder.buffered_bytes

    def send_hello(self) -> bytes:
        """Our hello frame; call exactly once, before sending anything else."""
        if self._hello_sent:
            raise LocalProtocolError("hello already sent")
        self._hello_sent = True
        return encode_frame(MAGIC_HELLO, HELLO_VERSION, encode_hello(self.versions, self.hello_text))

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Feed bytes received from the peer; events come out of :meth:`next_event`."""
        self._decoder.receive_data(data)

    def next_event(self) -> Event | Literal[NeedData.NEED_DATA]:
        """The next event, or :data:`NEED_DATA`. Raises RemoteProtocolError if the peer broke the protocol."""
        frame = self._decoder.next_frame()
        if frame is None:
            return NEED_DATA
        if self.negotiated_version is not None:
            # The decoder already checked magic and version against the negotiated codec.
            return Payload(frame.payload) if frame.payload else _KEEP_ALIVE
        return self._on_hello(frame.payload)

    def next_payload(self) -> bytes | None:
        """After the hello exchange: the next payload (keep-alives skipped), or None if more bytes are
        needed; the :class:`Payload` events of :meth:`next_event` without an event object each (a client's
        feed is one small frame per committed transaction). Raises as :meth:`next_event` does."""
        if self.negotiated_version is None:
            raise LocalProtocolError("no payloads before the hello exchange completed")
        decoder = self._decoder
        while True:
            payload = decoder.next_payload()
            if payload is None or payload:
                return payload
            # An empty payload is a keep-alive: nothing to return.

    def take_payloads(self, out: list[bytes]) -> None:
        """After the hello exchange: every whole payload already buffered, appended to ``out`` (keep-alives
        skipped); :meth:`next_payload` until None, in one call. Raises as :meth:`next_payload` does, the
        payloads before the error appended."""
        if self.negotiated_version is None:
            raise LocalProtocolError("no payloads before the hello exchange completed")
        self._decoder.take_payloads(out)

    def _on_hello(self, payload: bytes) -> HelloReceived:
        try:
            versions, text = decode_hello(payload)
            common = set(versions).intersection(self.versions)
            if not common:
                raise RemoteProtocolError(
                    f"no common version with peer {text!r}: it supports {sorted(versions)},"
                    f" we support {list(self.versions)}"
                )
        except RemoteProtocolError as e:
            # Poison the decoder so that the connection stays dead, as after a framing error.
            self._decoder._error = e
            raise
        version = max(common)
        self.negotiated_version = version
        self._decoder.max_frame_bytes = self.max_frame_bytes
        self._decoder.expected = (self.magic, version)
        self.peer_hello = HelloReceived(versions, text, version)
        return self.peer_hello

    def frame(self, payload: bytes | bytearray | memoryview) -> bytes:
        """``payload`` framed with the negotiated codec. Raises LocalProtocolError if too large or not ready.

        An empty payload would read as a keep-alive on the other end, so it is refused too.
        """
        return self.frame_header(len(payload)) + payload

    def frame_header(self, n: int) -> bytes:
        """The frame header of a payload of ``n`` bytes, for a caller that writes the payload after it
        without joining them (``FramedConnection.send``). Raises as :meth:`frame`."""
        version = self.negotiated_version
        if version is None or not self._hello_sent:
            raise LocalProtocolError("cannot send a payload before the hello exchange completed")
        if not 0 < n <= self.max_frame_bytes:
            raise LocalProtocolError(
                f"payload of {n} bytes is outside 1..{self.max_frame_bytes} (max_frame_bytes)"
            )
        return FRAME_HEADER.pack(self.magic, version, n)

    def frame_many(self, payloads: Iterable[bytes | bytearray | memoryview]) -> bytes:
        """:meth:`frame` of each of ``payloads``, in order, in one buffer (many small frames at a time, such
        as a feed's). Raises as :meth:`frame` does, and then frames none of them."""
        version = self.negotiated_version
        if version is None or not self._hello_sent:
            raise LocalProtocolError("cannot send a payload before the hello exchange completed")
        magic = self.magic
        limit = self.max_frame_bytes
        pack = FRAME_HEADER.pack
        if not isinstance(payloads, list | tuple):
            payloads = list(payloads)
        sizes = set(map(len, payloads))
        if len(sizes) == 1:
            # Payloads of one size (a feed's FeedData) share one frame header: joined in C.
            (n,) = sizes
            if not 0 < n <= limit:
                raise LocalProtocolError(f"payload of {n} bytes is outside 1..{limit} (max_frame_bytes)")
            header = pack(magic, version, n)
            return header + header.join(payloads)
        parts: list[bytes | bytearray | memoryview] = []
        append = parts.append
        for payload in payloads:
            n = len(payload)
            if not 0 < n <= limit:
                raise LocalProtocolError(f"payload of {n} bytes is outside 1..{limit} (max_frame_bytes)")
            append(pack(magic, version, n))
            append(payload)
        return b"".join(parts)

    def keep_alive(self) -> bytes:
        """A keep-alive frame (negotiated magic and version, no payload)."""
        version = self.negotiated_version
        if version is None or not self._hello_sent:
            raise LocalProtocolError("cannot send a keep-alive before the hello exchange completed")
        return FRAME_HEADER.pack(self.magic, version, 0)
