"""Concurrent request/response calls over one framed connection, matched by sequence number."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from types import TracebackType
from typing import Generic, Self, TypeVar

from waltz.errors import (
    BrokenResourceError,
    ClientTimeoutError,
    ClosedResourceError,
    LocalProtocolError,
    RemoteProtocolError,
)
from waltz.transport.connection import FramedConnection
from waltz.transport.limits import DEFAULT_MAX_IN_FLIGHT

__all__ = ["RpcClient"]

log = logging.getLogger("waltz.transport")

ReqT = TypeVar("ReqT")
RespT = TypeVar("RespT")


class RpcClient(Generic[ReqT, RespT]):
    """Concurrent request/response calls over one :class:`FramedConnection`, matched by sequence number.

    Guarantees:

    * At most ``max_in_flight`` requests are outstanding; further callers wait (within their timeout).
    * Every call ends: with its response, with :class:`~waltz.errors.ClientTimeoutError` after
      ``timeout_ms`` (a late response is then dropped), with the error ``error_of(response)`` returns, or with
      :class:`~waltz.errors.BrokenResourceError` for every pending and later call once the connection dies.
    * Responses are read from the client's construction on (which therefore must run in the event loop),
      from the transport's data callback (:meth:`FramedConnection.deliver_payloads`): each response
      resolves its caller's future in the loop pass that read it, with no task woken. A response that
      cannot be decoded fails every pending and later call and closes the connection (logged at WARNING);
      :meth:`aclose` stops the reading and closes the connection.

    The caller chooses sequence numbers (see :meth:`next_seq`); two requests with the same number may not be
    in flight at once. ``encode`` returns a request's payload, or its ``(head, body)`` parts: one frame whose
    body is written after the head without being joined to it (``FramedConnection.send(head, body)``), for a
    large body sent as it is (a server's batch of records, the same bytes for every replica). ``error_of``
    is not asked about a response of exactly ``ok_type`` (a success: most answers, which then cost no call).
    """

    def __init__(
        self,
        conn: FramedConnection,
        *,
        encode: Callable[[ReqT], bytes | tuple[bytes, bytes]],
        decode: Callable[[bytes], RespT],
        request_seq: Callable[[ReqT], int],
        response_seq: Callable[[RespT], int],
        error_of: Callable[[RespT], BaseException | None] | None = None,
        ok_type: type[object] | None = None,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        name: str = "rpc",
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self._conn = conn
        self._encode = encode
        self._decode = decode
        self._request_seq = request_seq
        self._response_seq = response_seq
        self._error_of = error_of
        self._ok_type = ok_type
        self._name = name
        self._loop = asyncio.get_running_loop()
        self._slots = asyncio.Semaphore(max_in_flight)
        self._pending: dict[int, asyncio.Future[RespT]] = {}
        self._on_answer: dict[int, Callable[[asyncio.Future[RespT]], None]] = {}
        """The ``on_answer`` of the start_call requests in :attr:`_pending` that have one."""
        self._seq = 0
        self._closed = False
        self._broken: str | None = None
        self.last_answer_s = float("-inf")
        """Loop time of the last read that brought responses: the peer was alive then."""
        self._loss_listeners: dict[Callable[[BaseException], None], None] = {}
        """Told once, with the error, when the connection is lost (see :meth:`add_loss_listener`)."""
        conn.deliver_payloads(self._on_payloads, self._lost)

    @property
    def connection(self) -> FramedConnection:
        return self._conn

    @property
    def in_flight(self) -> int:
        """Requests sent (or being sent) and not yet answered."""
        return len(self._pending)

    @property
    def is_usable(self) -> bool:
        """False once the client was closed or its connection died."""
        return not self._closed and self._broken is None

    def add_loss_listener(self, listener: Callable[[BaseException], None]) -> None:
        """Call ``listener(error)`` once when the connection is lost (at once if it already is); not after our
        own :meth:`aclose`, nor after :meth:`remove_loss_listener`. A listener must not raise."""
        if self._broken is not None:
            listener(BrokenResourceError(self._broken))
        elif not self._closed:
            self._loss_listeners[listener] = None

    def remove_loss_listener(self, listener: Callable[[BaseException], None]) -> None:
        self._loss_listeners.pop(listener, None)

    def next_seq(self) -> int:
        """A fresh per-client sequence number (0, 1, 2, ...)."""
        seq = self._seq
        self._seq += 1
        return seq

    def _check_usable(self) -> None:
        if self._closed:
            raise ClosedResourceError(f"{self._name} client closed")
        if self._broken is not None:
            raise BrokenResourceError(self._broken)

    async def call(self, request: ReqT, timeout_ms: int) -> RespT:
        """Send ``request`` and return its response (see the class docstring for how a call can end)."""
        self._check_usable()
        try:
            async with asyncio.timeout(timeout_ms / 1000), self._slots:
                self._check_usable()
                return await self._call_with_slot(request)
        except TimeoutError:
            raise ClientTimeoutError(
                f"{self._name}: no response from {self._conn.peername} within {timeout_ms} ms"
                f" to {type(request).__name__}"
            ) from None

    def start_call(
        self, request: ReqT, on_answer: Callable[[asyncio.Future[RespT]], None] | None = None
    ) -> asyncio.Future[RespT]:
        """Send ``request`` now and return the future of its response, for a caller that bounds its requests
        in flight and their time itself (no slot, no timeout, no task): the replica sessions of the server,
        whose requests then leave in the iteration that formed them instead of one task start later. With
        nothing else in flight on the connection the request is handed to the transport at once
        (``send(..., now=True)``); otherwise it joins the iteration's write.

        The future fails with the response's error (``error_of``) or as :meth:`call` would on a lost
        connection; cancelling it forgets the request (a late response is dropped). ``on_answer``, if given,
        is called with the future once the response or the connection's end resolved it, in the callback
        that did (a done callback runs a loop pass later: one more pass per answer of a replica), and not
        if the caller cancelled it first; an exception from it is logged."""
        if self._closed or self._broken is not None:
            self._check_usable()
        seq = self._request_seq(request)
        if seq in self._pending:
            raise LocalProtocolError(f"{self._name}: sequence number {seq} is already in flight")
        payload = self._encode(request)
        if isinstance(payload, tuple):
            # A large body (a batch of records, the same bytes for every replica) written from where it is.
            self._conn.send(*payload)
        elif self._pending:
            self._conn.send(payload)  # Joins this iteration's write (requests pipelined on a busy peer).
        else:
            # Nothing in flight to this peer (a lone append's replica request): written now rather than one
            # loop iteration later, with nothing to coalesce it with yet.
            self._conn.send(payload, now=True)
        return self._register(seq, on_answer)

    def expect(
        self, seq: int, on_answer: Callable[[asyncio.Future[RespT]], None] | None = None
    ) -> asyncio.Future[RespT]:
        """:meth:`start_call` of a request the caller sends itself with :meth:`send_payload`, inside a
        payload that carries several requests (each answered on its own, by its sequence number): the
        future of its response, registered now. The caller sends the payload in this loop pass or the next;
        until then the request counts as in flight."""
        if self._closed or self._broken is not None:
            self._check_usable()
        if seq in self._pending:
            raise LocalProtocolError(f"{self._name}: sequence number {seq} is already in flight")
        return self._register(seq, on_answer)

    def _register(
        self, seq: int, on_answer: Callable[[asyncio.Future[RespT]], None] | None
    ) -> asyncio.Future[RespT]:
        """The future of request ``seq``'s response, in flight from now (the caller checked it may be)."""
        future: asyncio.Future[RespT] = self._loop.create_future()
        self._pending[seq] = future
        if on_answer is not None:
            self._on_answer[seq] = on_answer
        return future

    def send_payload(self, payload: bytes) -> None:
        """Write ``payload`` (requests registered with :meth:`expect`) now, after every frame sent before it;
        if the connection cannot take it, it is lost and every pending call fails (as after a lost read)."""
        if not self.is_usable:
            return  # its requests failed with the connection already
        try:
            self._conn.send(payload, now=True)
        except Exception as e:  # noqa: BLE001 - whatever it was, the pending calls learn it
            self._lost(e)

    async def _call_with_slot(self, request: ReqT) -> RespT:
        seq = self._request_seq(request)
        if seq in self._pending:
            raise LocalProtocolError(f"{self._name}: sequence number {seq} is already in flight")
        payload = self._encode(request)
        future: asyncio.Future[RespT] = self._loop.create_future()
        self._pending[seq] = future
        try:
            if isinstance(payload, tuple):
                self._conn.send(*payload)
            else:
                self._conn.send(payload)
            await self._conn.drain()
            response = await future
        finally:
            if self._pending.get(seq) is future:
                del self._pending[seq]
            if future.done() and not future.cancelled():
                # Mark a failure set while we were being cancelled as seen, so it is not logged at GC.
                future.exception()
        return response  # a failure response raised above: the reader makes it the future's exception

    def _on_payloads(self, payloads: list[bytes]) -> None:
        """The responses of one socket read, from the transport's callback (see the constructor): each
        resolves its request's future, then the request's ``on_answer`` is called (see :meth:`start_call`)."""
        decode, response_seq = self._decode, self._response_seq
        error_of, ok_type = self._error_of, self._ok_type
        pending, on_answers = self._pending, self._on_answer
        self.last_answer_s = self._loop.time()
        try:
            for payload in payloads:
                response = decode(payload)
                seq = response_seq(response)
                # Popped here, so a start_call request is forgotten once answered (a call's own cleanup
                # finds it gone, which it allows for).
                future = pending.pop(seq, None)
                on_answer = on_answers.pop(seq, None) if on_answers else None
                if future is None or future.done():
                    # Normal after a caller timed out or was cancelled.
                    peer = self._conn.peername
                    log.debug("%s: dropping response %d from %s: no caller waits", self._name, seq, peer)
                    continue
                error = None if error_of is None or type(response) is ok_type else error_of(response)
                if error is None:
                    future.set_result(response)
                else:
                    future.set_exception(error)
                if on_answer is not None:
                    self._answered(on_answer, future)
        except RemoteProtocolError as e:
            # Garbage inside a well-formed frame: the peer's fault, logged (rate-limited) like bad framing.
            self._conn.reject(e)  # tells _lost
        except Exception as e:
            log.exception("%s: reading a response from %s failed", self._name, self._conn.peername)
            self._lost(e)

    def _lost(self, reason: BaseException) -> None:
        """Fail every pending and later call with ``reason`` and end the connection at once (no await: from
        a callback); :meth:`aclose` still releases it. Nothing to do after our own :meth:`aclose`."""
        if self._closed or self._broken is not None:
            return
        self._broken = f"{self._name}: connection with {self._conn.peername} lost: {reason}"
        self._fail_pending(lambda: BrokenResourceError(self._broken))
        self._conn._abort(BrokenResourceError(self._broken))
        listeners, self._loss_listeners = list(self._loss_listeners), {}
        for listener in listeners:
            try:
                listener(BrokenResourceError(self._broken))
            except Exception:
                log.exception("%s: a loss listener failed", self._name)

    def _answered(
        self, on_answer: Callable[[asyncio.Future[RespT]], None], future: asyncio.Future[RespT]
    ) -> None:
        try:
            on_answer(future)
        except Exception:
            log.exception(
                "%s: the answer callback of a request to %s failed", self._name, self._conn.peername
            )

    def _fail_pending(self, make_error: Callable[[], BaseException]) -> None:
        # A list: an answer callback may start another call (which fails at once: the client is unusable).
        for seq, future in list(self._pending.items()):
            if not future.done():
                future.set_exception(make_error())
                on_answer = self._on_answer.pop(seq, None)
                if on_answer is not None:
                    self._answered(on_answer, future)
        self._on_answer.clear()

    async def aclose(self) -> None:
        """Stop reading, fail pending calls with ClosedResourceError, close the connection. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._loss_listeners.clear()
        self._fail_pending(lambda: ClosedResourceError(f"{self._name} client closed"))
        await self._conn.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
