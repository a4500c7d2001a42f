"""A framed connection after its hello exchange: whole payloads in and out.

**Reading.** Every byte the peer sends arrives in the transport's data callback
(:meth:`FramedConnection._data_received`), is decoded there, and each read's payloads go to the connection's
receiver in that same callback: no StreamReader, no task woken per read. A receiver is one of

* :meth:`FramedConnection.deliver_payloads`: a callback per read with its payloads (a connecting side: the
  server's storage RPC clients, the client's stream connection);
* :meth:`FramedConnection.serve_payloads`: a handler per payload, in a serving task that is woken only when
  a handler has to wait (an accepting side: the server's client connections, a storage node's data port);
* :meth:`FramedConnection.receive`: one payload at a time, for a reader that is not on a hot path (an admin
  port, tools, tests): with no receiver in the callback, a read wakes the waiting task, which decodes it.

Whatever the receiver, the same bounds hold: while more of our frames than the accepting side's high-water
mark are unsent, nothing more is read until they drain; the idle timeout counts while waiting for the peer.

**Sending.** :meth:`FramedConnection.send` is the one send path. The frames sent in one loop iteration are
joined and leave in one write when the loop runs its callbacks (or, while a handler runs in the data
callback, when it returns); ``now=True`` writes at once (with what was queued before), a large payload is
written as it is, a ``body`` is written after its head without being joined to it, and ``framed=True``
takes frames the caller framed itself.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
from collections.abc import Awaitable, Callable, Coroutine
from types import TracebackType
from typing import Any, Self

from waltz.errors import (
    BrokenResourceError,
    BusyResourceError,
    ClosedResourceError,
    ConnectionError_,
    LocalProtocolError,
    RemoteProtocolError,
)
from waltz.protocol.framing import ProtocolConnection
from waltz.transport.hello import close_writer, source_of
from waltz.transport.limits import (
    COALESCE_MAX_BYTES,
    HEADER_CACHE_SIZE,
    RateLimitedLog,
    peer_warnings,
    reason_kind,
)

__all__ = ["FramedConnection", "PayloadHandler", "PayloadSink"]

log = logging.getLogger("waltz.transport")

PayloadHandler = Callable[[bytes], Awaitable[None] | None]
"""What :meth:`FramedConnection.serve_payloads` calls per payload: None when done with it, or an awaitable
to run (in the serving task, reading paused) before the next payload."""
PayloadSink = Callable[[list[bytes]], None]
"""What receives each read's payloads in the data callback (the list is reused: take what you need)."""
Buffer = bytes | bytearray | memoryview


class FramedConnection:
    """A connection after its hello exchange: whole payloads in and out.

    Guarantees: payloads reach the receiver in the order the peer framed them, keep-alives skipped; frames
    leave in :meth:`send` call order (never interleaved). One receiver at a time (a second one raises
    :class:`~waltz.errors.BusyResourceError`); :meth:`send` may be called from any task of the loop. A
    protocol violation by the peer aborts the connection and is logged once, with the peer's address, at
    WARNING. Created by :func:`~waltz.transport.open_connection` and :func:`~waltz.transport.serve`.
    """

    def __init__(
        self,
        writer: asyncio.StreamWriter,
        proto: ProtocolConnection,
        *,
        keep_alive_interval_s: float | None = None,
        idle_timeout_s: float | None = None,
        write_buffer_high_bytes: int | None = None,
        peer_log: RateLimitedLog | None = None,
    ) -> None:
        if proto.negotiated_version is None:
            raise LocalProtocolError("a FramedConnection needs a completed hello exchange")
        if keep_alive_interval_s is not None and keep_alive_interval_s <= 0:
            raise ValueError(f"keep_alive_interval_s must be positive, got {keep_alive_interval_s}")
        if idle_timeout_s is not None and idle_timeout_s <= 0:
            raise ValueError(f"idle_timeout_s must be positive, got {idle_timeout_s}")
        self._writer = writer
        self._transport = writer.transport
        """What ``writer.write`` and ``writer.is_closing`` call: used directly on the send path."""
        self._proto = proto
        self._loop = asyncio.get_running_loop()
        self._closed = False
        self._error: ConnectionError_ | RemoteProtocolError | None = None
        self._max_payload_bytes = proto.max_frame_bytes
        self._warnings = peer_log if peer_log is not None else peer_warnings
        self._init_reading()
        self._init_sending()
        self._pause_reading_above_bytes = write_buffer_high_bytes
        """The accepting side's bound (see serve()): while more than this is unsent, nothing more is read."""
        self._idle_timeout_s = idle_timeout_s
        self._keep_alive_task: asyncio.Task[None] | None = None
        if keep_alive_interval_s is not None:
            self._keep_alive_task = self._own(self._keep_alive_loop(keep_alive_interval_s), "keep-alive")
        self._idle_task: asyncio.Task[None] | None = None
        if idle_timeout_s is not None:
            self._idle_task = self._own(self._idle_watch(idle_timeout_s), "idle-watch")

    def _own(self, coro: Coroutine[Any, Any, None], what: str) -> asyncio.Task[None]:
        """A background task of this connection: cancelled by :meth:`aclose`; its failure (a bug) is logged
        and ends the connection, so the receiver hears of it instead of the connection living on without."""
        task = self._loop.create_task(coro, name=f"{what} {self.peername}")
        task.add_done_callback(self._background_ended)
        return task

    def _background_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        error = task.exception()
        log.error("%s failed", task.get_name(), exc_info=error)
        self._abort(
            BrokenResourceError(f"connection with {self.peername} ended: {task.get_name()} failed: {error}")
        )

    def _init_reading(self) -> None:
        self._receiving = False
        """A receiver has the payloads (for good once deliver_payloads was called)."""
        self._reading_paused = True
        """The protocol paused reading at the hello; the first receiver resumes it."""
        self._sink: PayloadSink | None = None
        """Who takes each read's payloads in the data callback; None: a task takes them (see receive)."""
        self._on_end: Callable[[BaseException], None] | None = None
        """Told once, with the reason, when the connection ends while :meth:`deliver_payloads` receives."""
        self._wake: asyncio.Future[Awaitable[None] | None] | None = None
        """What a reading task waits on: None (payloads to take, or the end), or a handler's awaitable."""
        self._handle: PayloadHandler | None = None
        """:meth:`serve_payloads`' handler."""
        self._taken: list[bytes] = []
        """The payloads decoded from one read, handed to the sink."""
        self._left: collections.deque[bytes] = collections.deque()
        """Payloads decoded but not yet handled when the callback stopped (a handler had to wait, our frames
        piled up): the serving task takes them first. At most one read's worth, since reading pauses then."""
        self._ahead = 0
        """Payloads decoded after the one being handled (for :attr:`read_ahead`)."""
        self._delivery_paused = False
        """:meth:`pause_delivery` in force (asked for before deliver_payloads, it outlives its start)."""
        self._read_started_s: float | None = None
        """When waiting for the peer began (None while not waiting): the idle clock."""

    def _init_sending(self) -> None:
        self._last_write_s = self._loop.time()
        self._out: bytearray | None = None
        """The frames of this loop iteration, written together (see :meth:`send`)."""
        self._headers: dict[int, bytes] = {}
        """Frame headers by payload size (see :meth:`_header`)."""
        self._dispatching = False
        """True while the data callback runs serve_payloads' handler: frames sent meanwhile leave in one
        write when it returns instead of in a callback of the next loop iteration."""

    @property
    def negotiated_version(self) -> int:
        """The codec version both ends agreed on."""
        version = self._proto.negotiated_version
        assert version is not None  # checked in __init__; never reset
        return version

    @property
    def peer_hello_text(self) -> str:
        """The text of the peer's hello, e.g. "Waltz Storage Server"."""
        hello = self._proto.peer_hello
        return hello.text if hello is not None else ""

    @property
    def peername(self) -> str:
        """``host:port`` of the peer (for logs)."""
        peer = self._writer.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            return f"{peer[0]}:{peer[1]}"
        return str(peer)

    @property
    def source(self) -> str:
        """The peer's address without its port (what rate-limited warnings and per-source limits key on)."""
        return source_of(self._writer)

    @property
    def peercert(self) -> dict[str, Any] | None:
        """The peer's verified TLS certificate (``ssl.SSLSocket.getpeercert`` form), None without one."""
        cert = self._writer.get_extra_info("peercert")
        return cert if isinstance(cert, dict) and cert else None

    @property
    def max_frame_bytes(self) -> int:
        return self._proto.max_frame_bytes

    @property
    def is_closed(self) -> bool:
        """True once :meth:`aclose` was called or the connection failed."""
        return self._closed or self._error is not None

    @property
    def read_ahead(self) -> bool:
        """True if the peer sent more after the payload being handled and it is read already: more requests
        are right behind it (a handler may leave this one to be batched with them)."""
        return self._ahead > 0 or bool(self._left) or self._proto.buffered_bytes > 0

    # Reading ------------------------------------------------------------------------------------------------

    async def receive(self) -> bytes:
        """The next payload. Raises BrokenResourceError at EOF or reset, RemoteProtocolError on garbage,
        ClosedResourceError after :meth:`aclose`, BusyResourceError while another receiver has the
        connection."""
        self._claim()
        try:
            return await self._next_payload(None)
        finally:
            self._receiving = False

    async def serve_payloads(self, handle: PayloadHandler) -> None:
        """Hand every payload the peer sends to ``handle``, in order, from the transport's data callback: no
        task wakes up and no coroutine resumes per socket read, so a request and its answer take one pass of
        the event loop.

        ``handle(payload)`` returns None once it dealt with the payload, or an awaitable when it has to wait:
        reading then pauses, the awaitable runs in this task, and the payloads after it are handed over once
        it finished, so they keep their order. An exception from ``handle`` or its awaitable ends serving and
        propagates from here. Frames :meth:`send` queues while the callback runs ``handle`` leave in one write
        when it returns. Never returns: raises as :meth:`receive` does when the connection ends.
        """
        self._claim()
        self._handle = handle
        try:
            while True:
                pending = handle(await self._next_payload(self._serve_read))
                if pending is not None:
                    await pending
                if self._write_backlogged():
                    await self.drain()
        finally:
            self._receiving = False
            self._handle = None

    def deliver_payloads(self, on_payloads: PayloadSink, on_end: Callable[[BaseException], None]) -> None:
        """From now on hand every read's payloads to ``on_payloads``, from the transport's data callback, in
        order (the list is reused: take what you need before returning); no task is involved. Payloads that
        came with the peer's hello are delivered before this returns.

        ``on_payloads`` must not block and should not raise (an exception is logged and ends the connection).
        ``on_end(reason)`` is called once when the connection ends: BrokenResourceError when the peer left
        or the network broke it, RemoteProtocolError on garbage (logged and aborted), ClosedResourceError
        after :meth:`aclose`; nothing is delivered after it."""
        self._claim()  # for good: no other receiver from now on
        self._sink = on_payloads
        self._on_end = on_end
        self._deliver(on_payloads)
        if self._sink is not on_payloads:
            return  # ended while delivering what came with the hello
        if self.is_closed:
            self._ended()
        elif not self._delivery_paused:  # the receiver may have paused on what came with the hello
            self._resume_reading()

    def pause_delivery(self) -> None:
        """For :meth:`deliver_payloads`' receiver that has no room for more: read nothing more from the peer
        (TCP then pushes back) until :meth:`resume_delivery`. The current read's payloads are all handed over
        first."""
        if self._sink is not None:
            self._delivery_paused = True
            self._pause_reading()

    def resume_delivery(self) -> None:
        """Read and deliver again after :meth:`pause_delivery` (nothing if the connection ended)."""
        if self._sink is not None and not self.is_closed:
            self._delivery_paused = False
            self._resume_reading()

    def reject(self, error: RemoteProtocolError) -> None:
        """For a receiver: the peer sent a payload it cannot decode (garbage in a well-formed frame). Logged
        and aborted as bad framing is, and the receiver told at once; nothing more is delivered."""
        if self.is_closed:
            return
        self._protocol_failure(error)
        self._ended()

    def _claim(self) -> None:
        if self._receiving:
            raise BusyResourceError("another task is already receiving on this connection")
        self._receiving = True

    async def _next_payload(self, sink: PayloadSink | None) -> bytes:
        """The next payload already buffered, else wait for the peer; meanwhile ``sink`` takes each read's
        payloads in the callback (serve_payloads), or, without one, the read wakes this task (receive)."""
        left = self._left
        while True:
            if self._closed:
                raise ClosedResourceError("connection closed")
            # What the peer sent before it left is still taken: the end is raised once nothing is buffered.
            if left:
                return left.popleft()
            try:
                payload = self._proto.next_payload()
            except RemoteProtocolError as e:
                if self._error is None:
                    self._protocol_failure(e)
                raise
            if payload is not None:
                return payload
            self._check_open()
            if self._write_backlogged():
                await self.drain()  # our answers pile up unsent: read no more until they drain
                continue
            pending = await self._wait_for_data(sink)
            if pending is not None:
                await pending

    async def _wait_for_data(self, sink: PayloadSink | None) -> Awaitable[None] | None:
        """Read from the peer until the callback wakes this task: with None (payloads to take, the end) or a
        handler's awaitable to run."""
        loop = self._loop
        wake: asyncio.Future[Awaitable[None] | None] = loop.create_future()
        self._wake = wake
        self._sink = sink
        self._read_started_s = loop.time()
        self._resume_reading()
        try:
            return await wake
        except asyncio.CancelledError:
            # Cancelled after the callback handed over a handler's awaitable and before this task woke up:
            # it never runs; closed, so it is not reported as never awaited.
            if wake.done() and not wake.cancelled() and wake.exception() is None:
                handed = wake.result()
                if inspect.iscoroutine(handed):
                    handed.close()
            raise
        finally:
            self._sink = self._wake = self._read_started_s = None

    def _data_received(self, data: bytes) -> None:
        """The transport's data callback: the one way the peer's bytes come in."""
        self._proto.receive_data(data)
        sink = self._sink
        if sink is None:
            # A task takes the payloads (or none reads yet): they stay buffered, nothing more is read until
            # it took them, and a waiting task wakes.
            self._hand_over(None)
            return
        if self._idle_task is not None:
            self._read_started_s = self._loop.time()  # waiting for the peer again: every read restarts it
        self._deliver(sink)

    def _deliver(self, sink: PayloadSink) -> None:
        """Every whole payload buffered to ``sink``, in one decoder call. A protocol error after some of them
        is handled once those were delivered, as if they had been decoded one by one."""
        taken = self._taken
        error: RemoteProtocolError | None = None
        try:
            self._proto.take_payloads(taken)
        except RemoteProtocolError as e:
            error = e
        try:
            if taken:
                sink(taken)
        except Exception as e:  # the receiver's bug: logged, and the connection ends
            log.exception("receiver of the payloads from %s failed", self.peername)
            self._abort(BrokenResourceError(f"connection with {self.peername} ended: receiver failed: {e}"))
            return
        finally:
            taken.clear()
        # (A serving task that took over finds the error in the decoder when it gets there.)
        if error is not None and self._sink is sink and not self.is_closed:
            self._protocol_failure(error)
            self._ended()

    def _serve_read(self, taken: list[bytes]) -> None:
        """:meth:`serve_payloads`' sink: each payload of one read to the handler, in order, in the callback.
        A handler that has to wait, or our frames piling up, hands the rest over to the serving task."""
        handle = self._handle
        assert handle is not None
        self._dispatching = True
        i, n = 0, len(taken)
        try:
            while i < n:
                self._ahead = n - i - 1
                pending = handle(taken[i])
                i += 1
                if pending is not None or self._write_backlogged():
                    self._left.extend(taken[i:])
                    self._hand_over(pending)  # None: the serving task drains before the next payload
                    return
        except Exception as e:  # noqa: BLE001 - the handler's: raised by serve_payloads, in its task
            self._hand_over(e)
        finally:
            self._ahead = 0
            self._dispatching = False
            if self._out is not None:
                self._flush_out()

    def _hand_over(self, what: Awaitable[None] | Exception | None) -> None:
        """Stop reading in the callback and wake the reading task (if one waits) with ``what``."""
        self._sink = None
        self._pause_reading()
        wake = self._wake
        if wake is None or wake.done():  # no task waits (busy, or cancelled meanwhile)
            if inspect.iscoroutine(what):
                what.close()  # never to run: closed, so it is not reported as never awaited
            return
        if isinstance(what, Exception):
            wake.set_exception(what)
        else:
            wake.set_result(what)

    def _ended(self) -> None:
        """Tell the receiver, once, that the connection ended: deliver_payloads' ``on_end``, or the task."""
        on_end = self._on_end
        self._on_end = None
        self._hand_over(None)
        if on_end is not None:
            on_end(self._error if self._error is not None else ClosedResourceError("connection closed"))

    def _connection_ended(self, exc: BaseException | None) -> None:
        """The transport reported end of file (None) or loss."""
        if self._error is None and not self._closed:
            if exc is None:
                self._error = BrokenResourceError(f"{self.peername} closed the connection")
            else:
                self._error = BrokenResourceError(f"connection with {self.peername} broken: {exc}")
        self._ended()

    def _abort(self, error: ConnectionError_ | RemoteProtocolError) -> None:
        """End the connection now, from a callback (no await): unsent frames are dropped, the keep-alive and
        idle tasks cancelled, the receiver told; :meth:`aclose` still releases it."""
        if self._error is None and not self._closed:
            self._error = error
        self._out = None
        self._transport.abort()
        for task in (self._keep_alive_task, self._idle_task):
            if task is not None:
                task.cancel()
        self._ended()

    def _check_open(self) -> None:
        """Raise why nothing more can be received: the connection failed (its error) or was closed."""
        if self._error is not None:
            raise self._error
        if self._closed:
            raise ClosedResourceError("connection closed")

    def _write_backlogged(self) -> bool:
        """More of our frames unsent than the accepting side's high-water mark (never on connecting sides)."""
        high = self._pause_reading_above_bytes
        if high is None:
            return False
        out = self._out
        return self._transport.get_write_buffer_size() + (len(out) if out is not None else 0) > high

    def _pause_reading(self) -> None:
        if not self._reading_paused:
            self._reading_paused = True
            # Any: a uvloop or an SSL transport is a read transport without saying so to the type checker.
            transport: Any = self._transport
            if not transport.is_closing():
                transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._reading_paused:
            self._reading_paused = False
            transport: Any = self._transport
            if not transport.is_closing():
                transport.resume_reading()

    def _protocol_failure(self, error: RemoteProtocolError) -> None:
        """The peer broke the protocol: log it (once per peer and reason), remember it, abort."""
        self._warnings.warning(
            self.source,
            reason_kind("protocol", error),
            "closing connection with %s: %s",
            self.peername,
            error,
        )
        self._error = error
        self._transport.abort()

    async def _idle_watch(self, timeout_s: float) -> None:
        # Closes the connection once the peer sent nothing for timeout_s while we waited for it. Time spent
        # not reading (our handler busy, or pushing back) does not count: the peer cannot be heard then.
        while not self.is_closed:
            started = self._read_started_s
            now = self._loop.time()
            if started is not None and now - started >= timeout_s:
                self._fail(f"no data for {timeout_s:g} s (idle timeout)", "idle")
                return
            await asyncio.sleep(timeout_s if started is None else started + timeout_s - now)

    def _fail(self, reason: str, kind: str) -> None:
        """Abort the connection for a local reason (a bound was hit), logged once per peer and kind."""
        if self.is_closed:
            return
        self._warnings.warning(self.source, kind, "closing connection with %s: %s", self.peername, reason)
        self._error = BrokenResourceError(f"connection with {self.peername} closed: {reason}")
        self._transport.abort()

    # Sending ------------------------------------------------------------------------------------------------

    def send(
        self, payload: Buffer, body: Buffer | None = None, *, now: bool = False, framed: bool = False
    ) -> None:
        """Queue one framed payload for writing (no wait; see :meth:`drain`). The frames of one loop iteration
        leave in one write, in call order.

        ``now``: hand it (and the frames queued before it) to the transport at once, for a lone message that
        nothing would join. ``body``: the payload is ``payload + body``, the body (megabytes: a range read's
        run) written after the head without being joined or copied. ``framed``: ``payload`` is whole frames
        the caller framed itself, with this connection's magic and version, each within ``max_frame_bytes``
        (unchecked). A payload of at least ``COALESCE_MAX_BYTES`` is written as it is.

        Raises LocalProtocolError if the payload is empty or larger than ``max_frame_bytes``,
        ClosedResourceError after :meth:`aclose`, BrokenResourceError if the connection is gone.
        """
        if self._closed or self._error is not None or self._transport.is_closing():
            self._check_writable()  # Raises the error that says why.
        if body is not None:
            self._send_unjoined(payload, body)
            return
        n = len(payload)
        if framed:
            header = b""
        else:
            if not 0 < n <= self._max_payload_bytes:
                self._proto.frame(payload)  # Raises the LocalProtocolError that says why.
            header = self._headers.get(n) or self._header(n)
        out = self._out
        if out is None:
            if now or n >= COALESCE_MAX_BYTES:
                self._transport.write(header + payload)
            else:
                # The first frame of this iteration: every frame sent until the loop runs its callbacks joins
                # it, and they leave in one socket write. The keep-alive clock is read here only.
                out = self._out = bytearray(header)
                out += payload
                if not self._dispatching:  # else the data callback writes it when its handler returns
                    self._loop.call_soon(self._flush_out)
        elif n >= COALESCE_MAX_BYTES:
            # Copying megabytes into the coalescing buffer would cost more than the write.
            self._flush_out()
            self._transport.write(header + payload)
        else:
            out += header
            out += payload
            if now or len(out) >= COALESCE_MAX_BYTES:
                self._flush_out()
            return
        self._last_write_s = self._loop.time()

    def _send_unjoined(self, head: Buffer, body: Buffer) -> None:
        """:meth:`send` of ``head + body`` written as two pieces after the frames queued before it."""
        header = self._proto.frame_header(len(head) + len(body))
        self._flush_out()
        self._writer.writelines((header + head, body))
        self._last_write_s = self._loop.time()

    def _header(self, n: int) -> bytes:
        """The frame header of an ``n``-byte payload, remembered for the next one of that size (messages of
        one kind mostly have one size); at most ``HEADER_CACHE_SIZE`` sizes are remembered."""
        header = self._proto.frame_header(n)
        if len(self._headers) < HEADER_CACHE_SIZE:
            self._headers[n] = header
        return header

    def _flush_out(self) -> None:
        """Hand the frames queued in this loop iteration to the transport, in order."""
        out, self._out = self._out, None
        if out and not self._transport.is_closing():
            self._transport.write(out)

    @property
    def drain_needed(self) -> bool:
        """True if more is unsent than the accepting side's high-water mark (see :func:`serve`), i.e. if
        :meth:`drain` may have to wait; always True on a connecting side."""
        return self._pause_reading_above_bytes is None or self._write_backlogged()

    async def drain(self) -> None:
        """Wait until the write buffer is below its high-water mark (back pressure)."""
        self._check_writable()
        self._flush_out()  # so the transport's buffer accounts for everything sent so far
        try:
            timeout_s = self._idle_timeout_s
            high = self._pause_reading_above_bytes
            if timeout_s is None or high is None or self._transport.get_write_buffer_size() <= high:
                await self._writer.drain()
                return
            # The peer is not reading: give it the idle timeout to start again, then let it go.
            try:
                async with asyncio.timeout(timeout_s):
                    await self._writer.drain()
            except TimeoutError:
                self._fail(f"read none of our data for {timeout_s:g} s (idle timeout)", "stalled")
                raise BrokenResourceError(f"{self.peername} does not read") from None
        except OSError as e:
            if self._closed:
                raise ClosedResourceError("connection closed") from None
            raise BrokenResourceError(f"connection with {self.peername} broken: {e}") from None

    def _check_writable(self) -> None:
        if self._closed:
            raise ClosedResourceError("connection closed")
        if self._error is not None:
            raise BrokenResourceError(f"connection with {self.peername} is gone: {self._error}")
        if self._transport.is_closing():
            raise BrokenResourceError(f"connection with {self.peername} is closing")

    async def _keep_alive_loop(self, interval_s: float) -> None:
        # Emits a keep-alive whenever nothing was written for interval_s; ends when the connection does.
        while not self._closed and self._error is None and not self._transport.is_closing():
            idle_s = self._loop.time() - self._last_write_s
            if idle_s >= interval_s:
                self._flush_out()
                self._transport.write(self._proto.keep_alive())
                self._last_write_s = self._loop.time()
                idle_s = 0.0
            await asyncio.sleep(interval_s - idle_s)

    # Closing ------------------------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close the connection (idempotent). Queued frames are flushed if the peer still reads."""
        if self._closed:
            return
        self._closed = True
        if self._error is None:
            self._flush_out()  # frames sent just before closing still leave, as a plain write() would
        # Release the socket and stop the keep-alives before the first await: if this task is cancelled while
        # waiting below, nothing is left open.
        close = close_writer(self._writer, abort=self._error is not None)
        tasks = [t for t in (self._keep_alive_task, self._idle_task) if t is not None]
        self._keep_alive_task = self._idle_task = None
        for task in tasks:
            task.cancel()
        try:
            if tasks:
                # wait() does not re-raise the task's CancelledError, but does propagate our own cancellation.
                await asyncio.wait(tasks)
        finally:
            await close

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
