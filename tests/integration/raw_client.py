"""A small asyncio client over the raw client<->server protocol, for integration tests and the benchmark.

It is deliberately independent of :mod:`waltz.client` (tests must not rely on the code they help judge).
One :class:`RawClient` follows one partition:

* It finds the owner and generation of its partition with a
  :class:`~waltz.cluster.membership.ClusterWatcher`, connects, and mounts with
  ``ReqId.of(client, generation, partition, seq)`` and its high-water mark. Every transaction the feed
  delivers (during the mount and afterwards) is checked to be dense (``id == hwm + 1``) and recorded in
  :attr:`RawClient.log`. FeedSuspended is answered with a FeedRequest from the last id received.
* :meth:`RawClient.append` sends an AppendRequest carrying the mounted generation (at most ``max_in_flight``
  unanswered) and returns a future: its id when the client sees its own ReqId in the feed (*acknowledged*:
  the only way the protocol acknowledges an append), :class:`LockFailed` on a LockFailure, or
  :class:`NotCommitted` when a later mount proves it is not in the log.
* An append the server failed (its store session lost the batch) gets no answer at all: the protocol says
  the client finds out with a flush. An append unanswered for ``FLUSH_AFTER_S`` triggers a FlushRequest;
  once the feed has delivered up to the FlushResponse's high-water mark, every append sent before the flush
  and still unacknowledged fails with :class:`NotCommitted` (the server resolved everything queued before
  the flush).
* When the connection breaks, the watcher shows another owner or generation, or the server answers
  NOT_READY, it reconnects and mounts again. A mount answers READY only after the server has resolved every
  append it had queued (and, at a new owner, after its store session recovered and fenced the old one), and
  streams every committed transaction first; so an append still unacknowledged at READY is not in the log
  and never will be.

Violations of the protocol's promises (a gap or a repeat in the feed, an acknowledged id changing) are kept
in :attr:`RawClient.violations` instead of raised, so a test can report all of them at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from waltz.cluster.membership import ClusterWatcher
from waltz.errors import ConnectionError_, WaltzError
from waltz.protocol import client_server as cs
from waltz.protocol.framing import MAGIC_CLIENT
from waltz.protocol.records import ReqId
from waltz.transport import FramedConnection, open_connection

log = logging.getLogger(__name__)

RECONNECT_DELAY_S = 0.1
FLUSH_AFTER_S = 1.0


class NotCommitted(Exception):
    """The append is definitely not in the log (a later mount completed without it)."""


class LockFailed(NotCommitted):
    """The server rejected the append for a lock conflict (LockFailure)."""

    def __init__(self, req_id: ReqId, lock_high_water_mark: int) -> None:
        super().__init__(f"{req_id!r}: lock conflict at {lock_high_water_mark}")
        self.lock_high_water_mark = lock_high_water_mark


@dataclass(eq=False)
class PendingAppend:
    req_id: ReqId
    data: bytes
    sent_s: float
    future: asyncio.Future[int]


@dataclass
class ClientStats:
    acknowledged: int = 0
    lock_failures: int = 0
    not_committed: int = 0
    mounts: int = 0
    latencies_s: list[float] = field(default_factory=list)


class RawClient:
    """One client of one partition over the raw protocol (see the module docstring).

    ``endpoint`` pins the server (``(host, port, generation)``) instead of following the watcher: the
    fencing test uses it to keep talking to a server that no longer owns the partition.
    """

    def __init__(
        self,
        watcher: ClusterWatcher | None,
        client_id: int,
        partition: int = 0,
        *,
        max_in_flight: int = 64,
        endpoint: tuple[str, int, int] | None = None,
        keep_latencies: bool = True,
        keep_data: bool = True,
        keep_log: bool = True,
    ) -> None:
        if watcher is None and endpoint is None:
            raise ValueError("give a watcher or a fixed endpoint")
        self.watcher = watcher
        self.client_id = client_id
        self.partition = partition
        self.max_in_flight = max_in_flight
        self.fixed_endpoint = endpoint
        self.keep_latencies = keep_latencies
        self.keep_data = keep_data
        self.keep_log = keep_log  # False (a long load run): no per-transaction record, no duplicate checks
        self.hwm = -1
        self.log: dict[int, ReqId] = {}
        """Every transaction seen in the feed: id -> request id."""
        self.acked: dict[ReqId, int] = {}
        """Own appends acknowledged: request id -> transaction id."""
        self.sent_data: dict[ReqId, bytes] = {}
        self.violations: list[str] = []
        self.stats = ClientStats()
        self.generation = -1
        self.server = ""
        self._pending: dict[ReqId, PendingAppend] = {}
        self._slots = asyncio.Semaphore(max_in_flight)
        self._seq = 0
        self._conn_seq = 0
        self._conn: FramedConnection | None = None
        self._mount_rid: ReqId | None = None
        self._mounted = asyncio.Event()
        self._progress = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._closed = False
        self._hwm_waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._hwm_answers: dict[ReqId, asyncio.Future[int]] = {}
        self._flush: tuple[ReqId, list[ReqId]] | None = None
        """The FlushRequest in flight and the appends pending when it was sent."""
        self._flushed: tuple[int, list[ReqId]] | None = None
        """A FlushResponse's high-water mark and the appends to fail once the feed reached it."""
        self._flusher: asyncio.Task[None] | None = None

    # -- life cycle ------------------------------------------------------------------------------------------

    async def start(self, timeout_s: float = 30.0) -> RawClient:
        """Start following the partition and wait for the first mount."""
        self._task = asyncio.create_task(self._run(), name=f"raw-client-{self.client_id}")
        if self.watcher is not None and self.fixed_endpoint is None:
            self._watch_task = asyncio.create_task(self._watch(), name=f"raw-client-watch-{self.client_id}")
        self._flusher = asyncio.create_task(self._flush_stale(), name=f"raw-client-flush-{self.client_id}")
        await self.wait_mounted(timeout_s)
        return self

    async def wait_mounted(self, timeout_s: float = 30.0) -> None:
        async with asyncio.timeout(timeout_s):
            await self._mounted.wait()

    async def aclose(self) -> None:
        self._closed = True
        for t in (self._task, self._watch_task, self._flusher):
            if t is not None:
                t.cancel()
        for t in (self._task, self._watch_task, self._flusher):
            if t is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await t
        if self._conn is not None:
            await self._conn.aclose()
        for p in list(self._pending.values()):
            if not p.future.done():
                p.future.cancel()
        self._pending.clear()

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    # -- appends ---------------------------------------------------------------------------------------------

    async def append(
        self, data: bytes, *, write_locks: tuple[int, ...] = (), header: int = 0
    ) -> asyncio.Future[int]:
        """Send one append once mounted (waiting for an in-flight slot) and return its outcome's future."""
        await self._slots.acquire()
        try:
            await self._mounted.wait()
            conn = self._conn
            assert conn is not None
            self._seq += 1
            rid = ReqId.of(self.client_id, self.generation, self.partition, self._seq)
            msg = cs.AppendRequest.build(rid, self.hwm, header, data, write_locks=write_locks)
            future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            pending = PendingAppend(rid, data, time.perf_counter(), future)
            self._pending[rid] = pending
            if self.keep_data:
                self.sent_data[rid] = data
            future.add_done_callback(lambda _f: self._slots.release())
            with contextlib.suppress(ConnectionError_):
                # A broken connection is noticed by the reader; the append stays pending until a mount
                # decides it.
                conn.send(cs.encode(msg, conn.negotiated_version))
        except BaseException:
            self._slots.release()
            raise
        return future

    async def append_and_wait(self, data: bytes, *, write_locks: tuple[int, ...] = ()) -> int:
        return await (await self.append(data, write_locks=write_locks))

    async def drain(self) -> None:
        """Write buffer back pressure (the benchmark calls it now and then)."""
        conn = self._conn
        if conn is not None:
            with contextlib.suppress(ConnectionError_):
                await conn.drain()

    async def wait_idle(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until no append is waiting for its outcome."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while self._pending:
                    fut = next(iter(self._pending.values())).future
                    await asyncio.wait([fut])

    async def wait_for_hwm(self, transaction_id: int, timeout_s: float = 30.0) -> None:
        """Wait until the feed delivered ``transaction_id``."""
        if self.hwm >= transaction_id:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._hwm_waiters.append((transaction_id, fut))
        async with asyncio.timeout(timeout_s):
            await fut

    async def high_water_mark(self, timeout_s: float = 10.0) -> int:
        """Ask the server for its high-water mark."""
        await self._mounted.wait()
        conn = self._conn
        assert conn is not None
        self._seq += 1
        rid = ReqId.of(self.client_id, self.generation, self.partition, self._seq)
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._hwm_answers[rid] = fut
        conn.send(cs.encode(cs.HighWaterMarkRequest(rid), conn.negotiated_version))
        async with asyncio.timeout(timeout_s):
            return await fut

    async def _flush_stale(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_AFTER_S / 2)
            conn = self._conn
            if conn is None or not self._mounted.is_set() or self._flush is not None or not self._pending:
                continue
            oldest = min(p.sent_s for p in self._pending.values())
            if time.perf_counter() - oldest < FLUSH_AFTER_S:
                continue
            self._seq += 1
            rid = ReqId.of(self.client_id, self.generation, self.partition, self._seq)
            self._flush = (rid, list(self._pending))
            with contextlib.suppress(ConnectionError_):
                conn.send(cs.encode(cs.FlushRequest(rid), conn.negotiated_version))

    def _flush_answered(self, msg: cs.FlushResponse) -> None:
        if self._flush is None or self._flush[0] != msg.req_id:
            return
        self._flushed = (msg.transaction_id, self._flush[1])
        self._flush = None
        self._resolve_flushed()

    def _resolve_flushed(self) -> None:
        if self._flushed is None or self.hwm < self._flushed[0]:
            return
        _, rids = self._flushed
        self._flushed = None
        for rid in rids:
            p = self._pending.pop(rid, None)
            if p is not None and not p.future.done():
                self.stats.not_committed += 1
                p.future.set_exception(NotCommitted(f"{rid!r} not in the log after a flush"))
                p.future.exception()

    # -- connection loop -------------------------------------------------------------------------------------

    async def _endpoint(self) -> tuple[str, int, int]:
        if self.fixed_endpoint is not None:
            return self.fixed_endpoint
        assert self.watcher is not None
        endpoints = await self.watcher.wait_for(lambda e: self.partition in e, 60.0)
        server, generation = endpoints[self.partition]
        host, _, port = server.rpartition(":")
        return host, int(port), generation

    async def _watch(self) -> None:
        """Drop the connection when the partition's owner or generation changes (the server will not)."""
        assert self.watcher is not None
        async for endpoints in self.watcher.updates():
            entry = endpoints.get(self.partition)
            conn = self._conn
            if conn is None or entry is None:
                continue
            if entry != (self.server, self.generation) and self._mounted.is_set():
                log.info(
                    "client %d: partition %d now at %s; remounting", self.client_id, self.partition, entry
                )
                await conn.aclose()

    async def _run(self) -> None:
        while not self._closed:
            host, port, generation = await self._endpoint()
            try:
                conn = await open_connection(
                    host,
                    port,
                    magic=MAGIC_CLIENT,
                    versions=cs.SUPPORTED_VERSIONS,
                    hello_text="Waltz Test Client",
                    connect_timeout_ms=3000,
                )
            except WaltzError:
                await asyncio.sleep(RECONNECT_DELAY_S)
                continue
            self._conn = conn
            self.server, self.generation = f"{host}:{port}", generation
            try:
                await self._session(conn, generation)
            except WaltzError as e:
                log.info("client %d: connection to %s:%d ended: %r", self.client_id, host, port, e)
            finally:
                self._mounted.clear()
                self._conn = None
                await conn.aclose()
            if not self._closed:
                await asyncio.sleep(RECONNECT_DELAY_S)

    async def _session(self, conn: FramedConnection, generation: int) -> None:
        version = conn.negotiated_version
        self._conn_seq += 1
        self._seq += 1
        mount_rid = ReqId.of(self.client_id, generation, self.partition, self._seq)
        self._mount_rid = mount_rid
        self._flush = self._flushed = None  # a mount resolves them all
        conn.send(cs.encode(cs.MountRequest(mount_rid, self.hwm, self._conn_seq), version))
        while True:
            msg = cs.decode(await conn.receive(), version)
            if isinstance(msg, cs.FeedData):
                self._feed_data(msg)
            elif isinstance(msg, cs.FeedSuspended):
                if msg.req_id == mount_rid:
                    conn.send(cs.encode(cs.FeedRequest(mount_rid, self.hwm), version))
            elif isinstance(msg, cs.LockFailure):
                p = self._pending.pop(msg.req_id, None)
                if p is not None and not p.future.done():
                    self.stats.lock_failures += 1
                    p.future.set_exception(LockFailed(msg.req_id, msg.transaction_id))
                    p.future.exception()  # retrieved: callers may not wait for every outcome
            elif isinstance(msg, cs.MountResponse):
                if msg.req_id != mount_rid:
                    continue
                if msg.state is cs.PartitionState.READY:
                    self._mount_ready(mount_rid)
                    conn.send(cs.encode(cs.FeedRequest(mount_rid, self.hwm), version))
                else:
                    if msg.state is cs.PartitionState.CLIENT_AHEAD:
                        self.violations.append(f"CLIENT_AHEAD at hwm {self.hwm} from {self.server}")
                    return  # NOT_READY: reconnect (the owner may be moving)
            elif isinstance(msg, cs.FlushResponse):
                self._flush_answered(msg)
            elif isinstance(msg, cs.HighWaterMarkResponse):
                fut = self._hwm_answers.pop(msg.req_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg.transaction_id)

    def _mount_ready(self, mount_rid: ReqId) -> None:
        # Every append of an earlier connection or generation that the mount did not deliver is not in the
        # log and never will be (see the module docstring).
        # Appends are only sent while mounted, so everything pending now went out on an earlier connection.
        self.stats.mounts += 1
        pending, self._pending = self._pending, {}
        for rid, p in pending.items():
            if not p.future.done():
                self.stats.not_committed += 1
                p.future.set_exception(NotCommitted(f"{rid!r} not in the log at mount {mount_rid!r}"))
                p.future.exception()
        self._mounted.set()

    def _feed_data(self, msg: cs.FeedData) -> None:
        txn = msg.transaction_id
        if txn != self.hwm + 1:
            self.violations.append(f"feed gave {txn} after {self.hwm} (from {self.server})")
            if txn <= self.hwm:
                if self.log.get(txn) != msg.req_id:
                    self.violations.append(
                        f"transaction {txn} changed: {self.log.get(txn)!r} -> {msg.req_id!r}"
                    )
                return
        self.hwm = txn
        if self.keep_log:
            self.log[txn] = msg.req_id
        if msg.req_id.client_id == self.client_id:
            if msg.req_id in self.acked:
                self.violations.append(f"{msg.req_id!r} appears twice ({self.acked[msg.req_id]} and {txn})")
            p = self._pending.pop(msg.req_id, None)
            if p is not None:
                if self.keep_log:
                    self.acked[msg.req_id] = txn
                self.stats.acknowledged += 1
                if self.keep_latencies:
                    self.stats.latencies_s.append(time.perf_counter() - p.sent_s)
                if not p.future.done():
                    p.future.set_result(txn)
            elif self.keep_log and msg.req_id.seq_num <= self._seq and msg.req_id not in self.acked:
                # Committed after a mount had declared it lost: the worst kind of violation.
                self.violations.append(f"{msg.req_id!r} committed at {txn} after being declared lost")
        if self._flushed is not None:
            self._resolve_flushed()
        if self._hwm_waiters:
            still = []
            for target, fut in self._hwm_waiters:
                if txn >= target:
                    if not fut.done():
                        fut.set_result(None)
                else:
                    still.append((target, fut))
            self._hwm_waiters = still


async def append_stream(
    client: RawClient,
    count: int | None,
    *,
    size_bytes: int = 512,
    stop: asyncio.Event | None = None,
    locks: bool = False,
) -> list[asyncio.Future[int]]:
    """Append ``count`` transactions (or until ``stop`` is set) as fast as the in-flight limit allows."""
    futures: list[asyncio.Future[int]] = []
    i = 0
    payload = bytes(size_bytes)
    while (count is None or i < count) and (stop is None or not stop.is_set()):
        data = i.to_bytes(8, "big") + payload[8:]
        wl = (hash((client.client_id, i)) & 0x7FFFFFFF,) if locks else ()
        futures.append(await client.append(data, write_locks=wl))
        i += 1
    return futures
