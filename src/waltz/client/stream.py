"""The stream connection to one server, and the per-partition state that the connection feeds.

One :class:`StreamLink` per server endpoint ("network client" in the original), created when a partition is
placed there: the **stream** connection (mount, append, feed, flush), opened as long as a mounted partition
lives on the endpoint. Its reader routes every message to the partition it names (``req_id.partition_id``)
and only if that partition is currently attached to this link. Each connection gets a new *incarnation*
number (sent as the MountRequest's ``seqNum``; the server then ignores the older connection of this client).
Losing the connection, for whatever reason, makes every partition on it report ``NOT_READY``; the link
reconnects at once, waiting (0.2 s doubling to 1 s) only when the connect itself fails, and has its owner
(the :class:`~waltz.client.network.NetworkDriver`, through the narrow :class:`LinkOwner`) re-mount each
partition from the last transaction id it delivered.

A mounted partition (:class:`Mount`) has an inbox of :data:`MountEvent` and a delivery task (the driver's)
that awaits the listener for one event at a time, in arrival order, so partitions never wait on one
another's application. A partition's own back pressure is its feed window: the next FeedRequest leaves only
once the core took everything before the FeedSuspended, and a window
(:data:`~waltz.protocol.client_server.FEED_WINDOW_MAX`) fits in the inbox, so a partition whose application
lags stops its own feed, not the connection. The inbox still holds at most :data:`INBOX_FEED_LIMIT` feed
entries (plus what the socket read that filled it carried), for what has no window (a mount's catch-up,
before READY; a server with larger windows): beyond that the connection reads nothing more until every
partition on it has room again (TCP back pressure towards the server, which stalls the connection's other
partitions meanwhile).

The connection's payloads are routed from the transport's data callback
(``FramedConnection.deliver_payloads``), in the loop pass that read them: no reader
task woken per read, no StreamReader. A payload that cannot be decoded ends the connection
(``FramedConnection.reject``), as bad framing does; the link then reconnects as after any loss.

The common case skips the inbox: the feed entries of one partition in one read are decoded in one pass, and
those that follow the partition's position, with nothing of the partition queued before them (nor held by
its delivery task), go from the reader straight to the listener in one call (``feed_run_nowait``) as far as it
has room, without an event object or a task hop. Anything else
(other messages, gaps, repeats, what a full listener did not take) goes through the inbox, so the order of a
partition's events never changes.

Appends (the bulk of what a client writes) are framed per loop iteration into one buffer, straight from the
:class:`~waltz.client.builder.TransactionBuilder` (:meth:`StreamLink.queue_built`), and written in one
``send(..., framed=True)``; every other write on the link writes them first.

Everything runs on the client's event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import operator
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from ssl import SSLContext
from typing import Any, Final, Protocol

from waltz.client.builder import TransactionBuilder
from waltz.client.driver import MountState
from waltz.client.rpc import connect_server
from waltz.errors import (
    BrokenResourceError,
    ConfigError,
    ConnectionError_,
    ProtocolError,
    RemoteProtocolError,
    TrimmedError,
)
from waltz.protocol import client_server as cs
from waltz.protocol.framing import FRAME_HEADER, MAGIC_CLIENT
from waltz.protocol.records import ReqId
from waltz.transport import FramedConnection

__all__ = [
    "INBOX_FEED_LIMIT",
    "Feed",
    "Flushed",
    "LinkOwner",
    "LockFailed",
    "Mount",
    "MountEvent",
    "MountReply",
    "StreamLink",
    "Suspended",
    "Unready",
]

log = logging.getLogger(__name__)

RECONNECT_INITIAL_DELAY_S: Final = 0.2
RECONNECT_MAX_DELAY_S: Final = 1.0
"""Back-off between failed connects to one endpoint (a lost connection is re-opened at once)."""
INBOX_FEED_LIMIT: Final = 1024
"""Feed entries queued per partition before the connection stops reading until the application took some.
Above :data:`~waltz.protocol.client_server.FEED_WINDOW_MAX`: a feed window always fits (a lagging
partition's back pressure is its window: the next FeedRequest waits until the core took the window), so only
an unwindowed mount catch-up (or a server with windows larger than that) stops the connection's reads."""

FeedRunNowait = Callable[[int, list[cs.FeedEntry]], int]
"""``feed_run_nowait`` of a :class:`~waltz.client.driver.DriverListener` that offers it."""


class LinkOwner(Protocol):
    """What a :class:`StreamLink` may ask of the driver that owns it."""

    @property
    def ssl(self) -> SSLContext | None: ...

    @property
    def mounts(self) -> Mapping[int, Mount]:
        """The mounted partitions (the link delivers only to those attached to it)."""
        ...

    @property
    def listener(self) -> object:
        """The driver's listener (its ``feed_run_nowait``, if any, takes feed entries directly)."""
        ...

    def next_incarnation(self) -> int: ...

    def send_mount(self, mount: Mount) -> None:
        """Mount ``mount`` on its link (a new feed session)."""
        ...

    def abandon(self, mount: Mount) -> None:
        """End the partition's feed session (``NOT_READY``)."""
        ...

    def spawn(self, coro: Awaitable[None], name: str) -> None:
        """Run a housekeeping task of the link (closing a connection): its failure is only logged."""
        ...

    def spawn_vital(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Run a task the link cannot serve without: its failure (a bug) stops the driver."""
        ...


@dataclass(slots=True)
class Feed:
    session: ReqId
    transaction_id: int
    req_id: ReqId
    header: int


@dataclass(slots=True)
class MountReply:
    session: ReqId
    state: cs.PartitionState


@dataclass(slots=True)
class Suspended:
    session: ReqId


@dataclass(slots=True)
class Trimmed:
    """The server's TrimmedResponse to the mount ``session``: it starts below the trim point (final)."""

    session: ReqId
    error: TrimmedError


@dataclass(slots=True)
class LockFailed:
    req_id: ReqId
    transaction_id: int


@dataclass(slots=True)
class Flushed:
    req_id: ReqId
    transaction_id: int


@dataclass(slots=True)
class Unready:
    """The driver abandoned the session (connection lost, partition moved): report NOT_READY."""


MountEvent = Feed | MountReply | Suspended | LockFailed | Flushed | Unready | Trimmed


class Mount:
    """The driver's state for one mounted partition (event loop only)."""

    def __init__(self, partition_id: int, client_high_water_mark: int) -> None:
        self.partition_id = partition_id
        self.position = client_high_water_mark  # Last feed id delivered; kept across reconnects and moves.
        self.link: StreamLink | None = None
        self.generation = 0
        self.session: ReqId | None = None  # The current feed session (the latest MountRequest's ReqId).
        self.ready = False  # READY seen for the current session: appends may be sent.
        self.ahead = False  # CLIENT_AHEAD: final until unmounted or the owner or generation changes.
        self.closed = False
        self.reported: MountState | None = None
        self.inbox: deque[MountEvent] = deque()
        self.feed_queued = 0
        self.busy = False  # The delivery task holds an event it took from the inbox (order: after it).
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self.deliver_task: asyncio.Task[None] | None = None
        self.retry_task: asyncio.Task[None] | None = None
        self.answer_timer: asyncio.TimerHandle | None = None  # Bounds the wait for the MountResponse.
        self.fed = False  # Feed of the session arrived since the answer timer was (re)armed.

    def put(self, event: MountEvent) -> None:
        self.inbox.append(event)
        if isinstance(event, Feed):
            self.feed_queued += 1
        self._wake.set()

    def get_nowait(self) -> MountEvent | None:
        """The next event if one is queued (no coroutine), else None."""
        if not self.inbox:
            return None
        event = self.inbox.popleft()
        if isinstance(event, Feed):
            self.feed_queued -= 1
            if self.feed_queued <= INBOX_FEED_LIMIT // 2:
                self._room.set()
        return event

    async def get(self) -> MountEvent:
        while not self.inbox:
            self._wake.clear()
            await self._wake.wait()
        event = self.inbox.popleft()
        if isinstance(event, Feed):
            self.feed_queued -= 1
            if self.feed_queued <= INBOX_FEED_LIMIT // 2:
                self._room.set()
        return event

    async def wait_room(self, link: StreamLink) -> None:
        """Wait while the inbox is full and the partition still listens to ``link``."""
        while self.feed_queued >= INBOX_FEED_LIMIT and self.link is link and not self.closed:
            self._room.clear()
            await self._room.wait()

    def wake_readers(self) -> None:
        self._room.set()

    def cancel_answer_timer(self) -> None:
        timer, self.answer_timer = self.answer_timer, None
        if timer is not None:
            timer.cancel()


class StreamLink:
    """The stream connection to one server endpoint, kept open while partitions are attached."""

    def __init__(self, owner: LinkOwner, endpoint: str) -> None:
        self.owner = owner
        self.endpoint = endpoint
        self.attached: dict[int, Mount] = {}
        self.conn: FramedConnection | None = None
        self.version = 0
        self.incarnation = -1
        self.max_frame_bytes = 0  # The connection's limit (read once per connection, not per append).
        # Appends framed in this loop iteration (pieces of frames, in order), written to _appends_conn in one
        # write at its end (see queue_built); every other write on the link writes them first, so the link's
        # order holds.
        self._appends: list[bytes] = []
        self._appends_conn: FramedConnection | None = None
        self._loop = asyncio.get_running_loop()
        # Resumes reading once every partition's inbox has room again (see _wait_for_room).
        self._room_task: asyncio.Task[None] | None = None
        self._wanted = asyncio.Event()
        self._closed = False
        self._task = owner.spawn_vital(self._run(), f"waltz-link {endpoint}")

    @property
    def connected(self) -> bool:
        return self.conn is not None and not self.conn.is_closed

    def attach(self, mount: Mount) -> None:
        self.attached[mount.partition_id] = mount
        mount.link = self
        self._wanted.set()

    def detach(self, mount: Mount) -> None:
        if self.attached.get(mount.partition_id) is mount:
            del self.attached[mount.partition_id]
        if mount.link is self:
            mount.link = None
        mount.wake_readers()
        conn = self.conn
        if not self.attached and conn is not None and not conn.is_closed:
            # Nothing of ours lives here any more: let the connection go (the run loop then idles).
            self.owner.spawn(conn.aclose(), f"waltz-idle {self.endpoint}")

    def send(self, msg: cs.Message) -> None:
        """Encode and queue ``msg`` on the stream connection (BrokenResourceError if there is none), after
        the appends queued before it."""
        conn = self.conn
        if conn is None:
            raise BrokenResourceError(f"no connection to {self.endpoint}")
        payload = cs.encode(msg, self.version)
        if self._appends:
            self.flush_appends()
        try:
            conn.send(payload)
        except ConnectionError_ as e:
            raise BrokenResourceError(f"connection to {self.endpoint} lost: {e}") from None

    def queue_append(self, conn: FramedConnection, payload: bytes) -> None:
        """Queue an encoded AppendRequest for ``conn`` (the link's connection): the appends of one loop
        iteration are framed into one buffer and handed to the connection in one write when its callbacks
        run (see :meth:`queue_built`). An append the connection cannot take then (it broke meanwhile) is
        dropped, as the driver contract allows: the flush after the next READY resolves it. One over the
        frame limit is refused here, at once, as ``send`` refuses it."""
        if len(payload) > self.max_frame_bytes:
            self.flush_appends()  # Those before it keep their place.
            try:
                conn.send(payload)  # Raises LocalProtocolError, as for any message too large.
            except ConnectionError_ as e:
                raise BrokenResourceError(f"connection to {self.endpoint} lost: {e}") from None
            return
        pieces = self._pieces(conn)
        pieces.append(FRAME_HEADER.pack(MAGIC_CLIENT, self.version, len(payload)))
        pieces.append(payload)

    def queue_built(self, conn: FramedConnection, req_id: ReqId, builder: TransactionBuilder) -> None:
        """:meth:`queue_append` of ``builder.build(req_id)``, framed straight from the builder's fields
        (``cs.frame_append``: no AppendRequest, no payload copied before the frame's): the hot path, once per
        pipelined append. What the shortcut does not cover takes the general path."""
        pieces = self._appends
        if not pieces:  # self._pieces(conn), inline (once per append)
            if conn.is_closed:
                raise BrokenResourceError(f"connection to {self.endpoint} lost")
            self._appends_conn = conn
            self._loop.call_soon(self.flush_appends)
        if not builder.frame_append(pieces, MAGIC_CLIENT, self.version, self.max_frame_bytes, req_id):
            self.queue_append(conn, cs.append_payload(builder.build(req_id), self.version))

    def _pieces(self, conn: FramedConnection) -> list[bytes]:
        """The framed bytes queued for this loop iteration's write on ``conn`` (a write scheduled with the
        first of them)."""
        if not self._appends:
            if conn.is_closed:
                raise BrokenResourceError(f"connection to {self.endpoint} lost")
            self._appends_conn = conn
            self._loop.call_soon(self.flush_appends)
        return self._appends

    def flush_appends(self) -> None:
        """Hand the queued appends to the connection they were queued for (nothing if it is gone)."""
        appends = self._appends
        if not appends:
            return
        self._appends = []
        conn, self._appends_conn = self._appends_conn, None
        if conn is None or conn is not self.conn:
            return  # Lost with their connection: the READY after the reconnect resolves them.
        try:
            conn.send(b"".join(appends), framed=True, now=True)
        except ConnectionError_ as e:
            log.debug("appends to %s not sent: %s", self.endpoint, e)

    async def aclose(self) -> None:
        self._closed = True
        self._task.cancel()
        await asyncio.wait([self._task])
        conn, self.conn = self.conn, None
        if conn is not None:
            await conn.aclose()

    async def _run(self) -> None:
        delay_s = RECONNECT_INITIAL_DELAY_S
        while not self._closed:
            if not self.attached:
                self._wanted.clear()
                await self._wanted.wait()
                continue
            try:
                conn = await connect_server(self.endpoint, self.owner.ssl)
            except ConfigError as e:
                # Such as a plain client meeting a TLS server: retrying will not help, but the assignment may
                # move the partitions to a server that takes us, so keep the link (slowly).
                log.error("cannot connect to %s: %s", self.endpoint, e)
                await asyncio.sleep(RECONNECT_MAX_DELAY_S)
                continue
            except (ConnectionError_, ProtocolError) as e:
                log.info("cannot connect to %s (retrying in %.1f s): %s", self.endpoint, delay_s, e)
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, RECONNECT_MAX_DELAY_S)
                continue
            delay_s = RECONNECT_INITIAL_DELAY_S
            self.incarnation = self.owner.next_incarnation()
            self.conn, self.version = conn, conn.negotiated_version
            self.max_frame_bytes = conn.max_frame_bytes
            log.debug("connected to %s (incarnation %d)", self.endpoint, self.incarnation)
            try:
                for mount in list(self.attached.values()):
                    self.owner.send_mount(mount)
                await self._read(conn)
            except (ConnectionError_, ProtocolError) as e:
                if not self._closed:
                    log.info("connection to %s lost: %s", self.endpoint, e)
            finally:
                self.conn = None
                await conn.aclose()
            for mount in list(self.attached.values()):
                self.owner.abandon(mount)

    async def _read(self, conn: FramedConnection) -> None:
        """Route what ``conn`` receives until it ends (raises why): each socket read's payloads are routed
        from the transport's data callback (``FramedConnection.deliver_payloads``), in the loop pass that
        read them: no reader task woken per read, no StreamReader."""
        ended: asyncio.Future[BaseException] = self._loop.create_future()

        def on_end(reason: BaseException) -> None:
            if not ended.done():
                ended.set_result(reason)

        version = conn.negotiated_version
        decode = cs.decode
        decode_feed_runs = cs.decode_feed_runs
        mounts = self.owner.mounts
        listener = self.owner.listener
        # A listener that takes feed entries without a coroutine (the core does) gets them straight from here
        # when nothing of their partition is queued before them: no event object, no inbox, no task hop; one
        # that takes a whole run of them gets each run of one partition's entries in a read in one call.
        run_nowait: FeedRunNowait | None = getattr(listener, "feed_run_nowait", None)

        def on_payloads(burst: list[bytes]) -> None:
            """The payloads of one socket read, in order (from the transport's data callback)."""
            full = False
            try:
                # The feed entries of the read in one pass (most of a read), run by run of one partition.
                for partition_id, entries, i in decode_feed_runs(burst):
                    if not entries:
                        self._on_message(decode(burst[i], version))
                        continue
                    mount = mounts.get(partition_id)
                    if (
                        mount is not None
                        and mount.link is self
                        and not mount.closed
                        and _on_feed_run(run_nowait, mount, entries)
                    ):
                        full = True
            except RemoteProtocolError as e:
                # Garbage in a well-formed frame: the connection ends (logged as bad framing is), the link
                # reconnects; the messages before it were handled, as if read one by one.
                conn.reject(e)
                return
            if full:
                self._wait_for_room(conn)

        try:
            conn.deliver_payloads(on_payloads, on_end)
            raise await ended
        finally:
            room_task, self._room_task = self._room_task, None
            if room_task is not None:
                room_task.cancel()

    def _wait_for_room(self, conn: FramedConnection) -> None:
        """A partition's inbox is full: read nothing more from ``conn`` until every partition of the link has
        room again (TCP pushes back on the server meanwhile)."""
        conn.pause_delivery()
        if self._room_task is None:
            self._room_task = self.owner.spawn_vital(
                self._resume_with_room(conn), f"waltz-room {self.endpoint}"
            )

    async def _resume_with_room(self, conn: FramedConnection) -> None:
        try:
            while True:
                full = [m for m in self.attached.values() if m.feed_queued >= INBOX_FEED_LIMIT]
                if not full:
                    break
                for mount in full:
                    await mount.wait_room(self)
        finally:
            if self._room_task is asyncio.current_task():
                self._room_task = None
        conn.resume_delivery()

    def _on_message(self, msg: cs.Message) -> None:
        """Queue a message other than FeedData for its partition's delivery task."""
        mount = self.owner.mounts.get(msg.req_id.partition_id)
        if mount is None or mount.link is not self or mount.closed:
            return  # Not (or no longer) ours to hear from this server.
        if isinstance(msg, cs.MountResponse):
            if msg.req_id == mount.session:
                mount.cancel_answer_timer()  # Answered, even if the delivery task reaches it later.
                mount.put(MountReply(msg.req_id, msg.state))
        elif isinstance(msg, cs.FeedSuspended):
            if msg.req_id == mount.session:
                mount.put(Suspended(msg.req_id))
        elif isinstance(msg, cs.TrimmedResponse):
            if msg.req_id == mount.session:
                mount.cancel_answer_timer()
                mount.put(Trimmed(msg.req_id, msg.error()))
        elif isinstance(msg, cs.LockFailure):
            mount.put(LockFailed(msg.req_id, msg.transaction_id))
        elif isinstance(msg, cs.FlushResponse):
            mount.put(Flushed(msg.req_id, msg.transaction_id))
        elif isinstance(msg, cs.FeedData):  # pragma: no cover - decode_feed_data takes every FeedData
            raise RemoteProtocolError("a FeedData the fast decoder refused")
        else:
            log.debug("ignoring %s from %s on the stream connection", type(msg).__name__, self.endpoint)


_ID: Final = operator.itemgetter(0)
"""A feed entry's transaction id."""


def _on_feed_run(run_nowait: FeedRunNowait | None, mount: Mount, entries: list[cs.FeedEntry]) -> bool:
    """Feed entries for ``mount`` (attached to the link they came on), in arrival order: the leading ones
    that follow the partition's position are delivered at once when nothing of the partition is queued
    before them and the listener has room (repeats after a re-mount are dropped), the rest queued for the
    delivery task, which decides (repeats, gaps, waits for room). True if the link must stop reading until
    the inbox has room again."""
    session = mount.session
    if session is None:
        return False  # No feed session open: from an abandoned one.
    mount.fed = True  # The server is answering: a mount's MountResponse follows the backlog it streams.
    k, n = 0, len(entries)
    if run_nowait is not None and not mount.inbox and not mount.busy:
        position = mount.position
        if entries[0][0] == position + 1 and (
            n == 1 or list(map(_ID, entries)) == list(range(position + 1, position + n + 1))
        ):
            # The common case, the whole run follows the position one by one: checked in C, not by the
            # loops below (a dozen bytecodes per entry); a run of one (many partitions, one commit each) at
            # once.
            m = n
        else:
            while k < n and entries[k][0] <= position:
                k += 1  # Repeats after a re-mount.
            # The entries that follow the position one by one.
            m = k
            while m < n and entries[m][0] == position + 1:
                position += 1
                m += 1
        if m > k:
            try:
                taken = run_nowait(mount.partition_id, entries if k == 0 and m == n else entries[k:m])
            except Exception:
                # As the delivery task does: logged, and the position stays where it was, so the entries are
                # queued and the first of them delivered again by the delivery task.
                log.exception(
                    "partition %d: delivering transaction %d failed", mount.partition_id, entries[k][0]
                )
                taken = 0
            if taken:
                k += taken
                mount.position = entries[k - 1][0]
            if k == n:
                return False
    for transaction_id, req_id, header in itertools.islice(entries, k, None):
        mount.put(Feed(session, transaction_id, req_id, header))
    return mount.feed_queued >= INBOX_FEED_LIMIT
