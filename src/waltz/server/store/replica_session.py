"""One replica (one storage node's copy of the partition) within one store session.

A replica session is one task. Its life, in order:

1. **Connect**, retrying with backoff while the node is unreachable. The first request, LastSessionInfo, is
   also the message that fences every older session on that node.
2. **Recover** (``recovery.py`` says why each step is safe): classify; truncate if the class says so; register
   its high-water mark in the vote if it counts; while the vote is undecidable, copy from its *usher* (the
   counted replica with the smallest high-water mark above its own); once resolved, truncate anything above
   the resolved mark, set the low-water mark, and copy committed records from the others until it holds
   exactly the resolved mark; then report itself recovered (only VOTING and BEHIND replicas copy from an
   usher: see below).
3. **Take part.** Replicas recovered when the session opens are its participants. A replica recovering later
   first records itself clean in ZooKeeper, then copies committed records until it is close to the writer,
   then joins (and is sent the batches in flight); it never counted in a vote before that.
4. **Write**: each batch is sent as soon as it is delivered, with up to ``max_inflight_batches`` append
   requests unanswered (batches waiting beyond that go together in the next request); each request is a small
   task that votes for its batches when the node acknowledges them. One timer per replica, not a timeout per
   request, bounds them: the node answers in order, so only the oldest unanswered request can be the first
   to outlive ``rpc_timeout_ms``, which fails the replica as a timed-out request did. If the first batch
   starts beyond its max id (it joined late), the replica task first copies the missing records, all
   committed (they are below the oldest batch in flight), from another participant. An idle replica is
   looked at (see "idle probing" below): a lost link fails it at once, a hung node and a lost or extra
   record are found by a probe.

Failure policy: a participant's failure ends the session; before the session opens, the failure of a
replica counted in the vote ends it too (the vote relied on it). A replica that neither counts nor writes
retries with backoff, before the opening and after it alike: after it, it rejoins the way any late replica
does (recorded clean in ZooKeeper, copies, joins), so a storage node that failed (a full disk, a failed
fsync, a restart) is back in the session on its own once it serves again. (It used to sit the rest of the
session out, which could be hours: sessions end only on failures, replica-set changes and checkpoints.) Its
first failure is logged at WARNING (at most one line per 10 s), its return, once it recovered again, at
INFO; a replica that answers and is refused again in a loop is one outage, not a line per attempt.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
from collections import deque
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import islice
from typing import Protocol, TypeVar

from waltz.errors import BrokenResourceError, SessionFencedError, WaltzError
from waltz.protocol.records import Record
from waltz.server.store.interfaces import ReplicaConnection, ReplicaConnector, SessionInfo
from waltz.server.store.recovery import Classification, RecoveryState, classify_replica
from waltz.server.store.support import Backoff, InvariantViolation, RetryLog, StoreConfig
from waltz.server.store.voting import Voting

__all__ = ["Batch", "ReplicaContext", "ReplicaHost", "ReplicaRole", "ReplicaSession", "SessionOver"]

T = TypeVar("T")

_NOT_WRITING = -2
"""``_sent_max`` while the replica task is not writing: no batch continues it, so nothing is sent."""

log = logging.getLogger(__name__)


class SessionOver(Exception):
    """Raised inside a session's tasks once the session has ended; the task stops quietly."""


class _Reexamine(Exception):
    """An uncounted replica's control info changed while the vote waited: reconnect and classify it again."""


class ReplicaRole(enum.Enum):
    CONNECTING = "connecting"
    RECOVERING = "recovering"
    RECOVERED = "recovered"
    JOINING = "joining"
    PARTICIPANT = "participant"
    RETIRED = "retired"


class Batch:
    """Records ``first .. first+len-1`` sent to every participant, with the vote they answer (never changed
    once made: a plain slotted class rather than a frozen dataclass, whose generated ``__init__`` and
    ``__post_init__`` cost two calls and four ``object.__setattr__`` per batch)."""

    __slots__ = ("first", "last", "records", "voting")

    def __init__(self, first: int, records: tuple[Record, ...], voting: Voting) -> None:
        self.first = first
        self.records = records
        self.voting = voting
        self.last = first + len(records) - 1
        """The last record's id (an attribute: read several times per replica of every batch)."""

    def __repr__(self) -> str:
        return f"Batch({self.first}..{self.last}, {self.voting.outcome})"


@dataclass(frozen=True)
class ReplicaContext:
    """What every replica of one store session shares and never changes."""

    partition_id: int
    session_id: int
    config: StoreConfig
    rng: random.Random
    connector: ReplicaConnector
    recovery: RecoveryState
    """The session's recovery vote: a replica registers its high-water mark and its recovery there."""


class ReplicaHost(Protocol):
    """What a replica may ask of its store session, and nothing more (the session is the implementation)."""

    is_open: bool
    """The session opened (recovered, writing) and has not ended."""
    high_water_mark: int
    """The session's committed high-water mark."""

    async def call(self, request: Awaitable[T]) -> T:
        """Await a storage request, bounded by ``rpc_timeout_ms`` (a timeout raises BrokenResourceError)."""
        ...

    def replica_failed(self, replica: ReplicaSession, detail: str) -> None:
        """``replica`` failed while load-bearing: the session ends."""
        ...

    def fenced(self, detail: str) -> None:
        """A newer session fenced this one on some replica: the session ends."""
        ...

    async def copy_records(
        self, requester: ReplicaSession, start: int, end: int, source: str | None = None
    ) -> list[Record]:
        """Records ``start..`` (at most ``end``) read from another replica (raises SessionOver)."""
        ...

    async def wait_open(self) -> None:
        """Return once the session opened."""
        ...

    async def mark_clean(self, replica: ReplicaSession) -> None:
        """Record ``replica``, recovered after the opening, as clean in ZooKeeper (raises SessionOver)."""
        ...

    def try_join(self, replica: ReplicaSession) -> bool:
        """Take ``replica`` in as a participant if it is close enough to the writer (it is sent the batches
        in flight with :meth:`ReplicaSession.join_writes`); False if not yet."""
        ...


class ReplicaSession:
    """The task of one replica in one store session (see the module docstring).

    Only the replica changes its own state (its role included): the session asks through
    :meth:`deliver`, :meth:`join_writes` and :meth:`become_participant`."""

    def __init__(
        self, host: ReplicaHost, context: ReplicaContext, storage: str, *, retiring: bool = False
    ) -> None:
        self._host = host
        self._ctx = context
        self.storage = storage
        self.retiring = retiring
        self._failures = 0
        """Failures since this replica last recovered (the first logged at WARNING, the return at INFO)."""
        self._retry_log = RetryLog(log)
        """The retry loop's lines: one per 10 s at most (a refusal retried every 100 ms wrote thousands)."""
        """A replica of the previous set that is no longer assigned: it only votes and serves copies."""
        self.role = ReplicaRole.CONNECTING
        self.connection: ReplicaConnection | None = None
        self.classification: Classification | None = None
        self.counted = False
        self.max_id = -1
        """The replica's max transaction id as of our last call (valid while connected)."""
        self.readable_max = -1
        """Highest id others may copy from this replica (-1 until its classification step is done)."""
        self._mailbox: deque[Batch] = deque()
        """Batches delivered and not yet acknowledged by the node, in id order."""
        self._unsent = 0
        """Index in the mailbox of the first batch not sent yet."""
        self._sent_max = _NOT_WRITING
        """The last id sent to the node; batches are sent only when they continue it (see :meth:`_send`)."""
        self._requests: deque[tuple[asyncio.Future[object], int, float]] = deque()
        """Append requests sent and not answered yet, oldest first: each one's future, how many batches of
        the mailbox it carries, and when it times out (loop time)."""
        self._on_answer = self._answered
        """The ``on_answer`` of every append request (bound once, not once per request)."""
        self._rpc_timeout_s = context.config.rpc_timeout_ms / 1000
        self._max_requests = context.config.max_inflight_batches
        self._max_behind = context.config.max_pending_batches
        self._idle_interval_s = context.config.idle_probe_interval_ms / 1000
        self._on_idle_tick = self._idle_tick
        """The idle timer's callback (bound once: every replica re-arms it once per interval)."""
        self._timer: asyncio.TimerHandle | None = None
        """Checks the oldest request's deadline (see :meth:`_check_deadline`); None while not armed."""
        self._loop: asyncio.AbstractEventLoop | None = None
        """The loop ``_write`` runs on (asyncio.get_running_loop() costs a getpid system call each time)."""
        self._failure: BaseException | None = None
        """The first failed append request (the replica task raises it)."""
        self._mail = asyncio.Event()
        """Wakes the replica task: a batch it has to send itself was delivered, a request failed, the link
        was lost or an idle probe is due."""
        self._idle_timer: asyncio.TimerHandle | None = None
        """The idle probing timer (see :meth:`_idle_tick`); None while not writing."""
        self._probe_due = False
        self._idle_seen = -1
        """:attr:`max_id` when the replica was last seen writing (a change is activity)."""
        self._check_gap_s = 0.0
        """The current interval between per-partition checks of an idle replica (doubles while it agrees)."""
        self._check_at = 0.0
        """When the next per-partition check is due (loop time)."""

    def __repr__(self) -> str:
        return f"ReplicaSession({self.storage}, session={self._ctx.session_id}, {self.role.value})"

    # -- called by the store session -------------------------------------------------------------------------

    def deliver(self, batch: Batch, in_flight: int) -> None:
        """Queue a new batch (one of ``in_flight`` the session has in flight) for this participant; a replica
        too far behind abstains and ends the session."""
        # The mailbox holds the session's other batches in flight (unless this replica already acknowledged
        # them) and before them the committed batches this replica still owes: how far behind it is.
        behind = len(self._mailbox) - (in_flight - 1)
        if behind >= self._max_behind:
            batch.voting.abstain()
            self._host.replica_failed(self, "cannot keep up with the writes")
            return
        self._mailbox.append(batch)
        if not self._send() and not self._requests:
            self._mail.set()  # a gap: the replica task copies it first

    def join_writes(self, in_flight: Iterable[Batch]) -> None:
        """Start taking part with the session's batches in flight (the replica just joined)."""
        self.role = ReplicaRole.PARTICIPANT
        self._mailbox.extend(in_flight)
        self._mail.set()

    def become_participant(self) -> None:
        """The session opened with this recovered replica as a participant."""
        if self.role is not ReplicaRole.RECOVERED:
            raise InvariantViolation(f"{self!r} made a participant")
        self.role = ReplicaRole.PARTICIPANT

    def _send(self) -> bool:
        """Send the batches not sent yet, in order, while fewer than ``max_inflight_batches`` requests are
        unanswered; False if some are left (a gap to copy first, or a full pipeline).

        Called when a batch is delivered (by the writer, so it leaves without waiting for the replica task to
        run) and when a request is answered. Only a batch continuing what was sent is sent: while the replica
        task copies records, or before it writes at all, ``_sent_max`` does not continue the mailbox.
        """
        mailbox = self._mailbox
        requests = self._requests
        while self._unsent < (count := len(mailbox)):
            if len(requests) >= self._max_requests:
                return False
            first = self._unsent
            batch = mailbox[first]
            if batch.first != self._sent_max + 1:
                return False
            # Every batch waiting here goes in one request (one fsync on the node): a replica slower than the
            # quorum then catches up instead of falling max_pending_batches behind. Mailbox batches are
            # contiguous (the writer gives them dense ids, in order).
            end = first + 1
            while end < count and mailbox[end].first == mailbox[end - 1].last + 1:
                end += 1
            records = (
                batch.records
                if end == first + 1
                else tuple(r for b in islice(mailbox, first, end) for r in b.records)
            )
            # _sent_max continues the mailbox only while _write runs, connected.
            conn, loop = self.connection, self._loop
            assert conn is not None
            assert loop is not None
            # Sent now, not from a task started on the next iteration: the batch leaves for every replica
            # in the iteration that formed it, the three writes back to back (a task per request cost a
            # loop iteration and ~40 us of the server's CPU each, and spaced the replicas' writes apart).
            try:
                future = conn.start_append(records, self._on_answer)
            except (WaltzError, OSError) as e:
                # The connection broke before the request could leave: this replica fails (its task raises
                # and retries it), not the writer that delivered the batch, which would end the session.
                if self._failure is None:
                    self._failure = e
                    self._mail.set()
                return False
            deadline = loop.time() + self._rpc_timeout_s
            requests.append((future, end - first, deadline))
            if self._timer is None:
                self._timer = loop.call_at(deadline, self._check_deadline)
            self._unsent = end
            self._sent_max = mailbox[end - 1].last
        return True

    def _check_deadline(self) -> None:
        """The timer fired: fail the replica if its oldest request is overdue, else wait for its deadline.

        The timer is armed when a request is sent with none armed, and moved lazily here rather than on
        every answer: one timer handle per ``rpc_timeout_ms`` under a steady load instead of a timeout (two
        timer operations) per request."""
        self._timer = None
        requests = self._requests
        if not requests:
            return
        loop = self._loop
        assert loop is not None  # armed only while _write runs
        deadline = requests[0][2]
        if deadline > loop.time():
            self._timer = loop.call_at(deadline, self._check_deadline)
            return
        if self._failure is None:
            ms = self._ctx.config.rpc_timeout_ms
            self._failure = BrokenResourceError(f"storage request timed out after {ms} ms")
            self._mail.set()

    def _answered(self, future: asyncio.Future[object]) -> None:
        """A request's response (or failure) arrived: vote for its batches, or fail the replica (its task
        raises)."""
        if future.cancelled():
            return
        error = future.exception()
        if error is None:
            mailbox = self._mailbox
            try:
                # The node answers one connection's requests in order: this is the oldest request unanswered,
                # and an acknowledgement means every earlier append of this session is durable on the node.
                requests = self._requests
                if requests[0][0] is not future:
                    raise InvariantViolation(
                        f"{self.storage} answered an append request before the one from {mailbox[0].first}"
                    )
                count = requests.popleft()[1]
                self._unsent -= count
                for _ in range(count):
                    done = mailbox.popleft()
                    self.max_id = self.readable_max = done.last
                    done.voting.vote()  # (a broken invariant of the commit it decides fails this replica)
                if self._unsent < len(mailbox):  # (_send's own first test: most answers leave nothing unsent)
                    self._send()
                return
            except InvariantViolation as e:
                error = e
        if self._failure is None:
            self._failure = error
            self._mail.set()

    # -- the task --------------------------------------------------------------------------------------------

    async def run(self) -> None:
        config = self._ctx.config
        backoff = Backoff(
            self._ctx.rng,
            config.initial_retry_interval_ms,
            config.max_retry_interval_ms,
        )
        try:
            while True:
                conn, info = await self._connect(backoff)
                try:
                    if self.retiring:
                        await self._vote_only(conn, info)
                        return
                    await self._recover(conn, info)
                    self._recovered_again()
                    await self._take_part(conn)
                except SessionFencedError as e:
                    self._host.fenced(f"{self.storage}: {e}")
                    return
                except _Reexamine as e:
                    log.info("%r is classified again: %s", self, e)
                    self._ctx.recovery.forget_recovered(self.storage)
                    self.readable_max = -1
                    self.role = ReplicaRole.CONNECTING
                except (WaltzError, TimeoutError) as e:
                    if not self._may_retry(e):
                        return
                    backoff.reset()
                    await backoff.sleep()
                finally:
                    self.connection = None
                    await conn.aclose()
        except SessionOver:
            return

    def _may_retry(self, error: BaseException) -> bool:
        """After a failure of this replica: end the session, or sit out / retry (see the module docstring)."""
        load_bearing = self.role is ReplicaRole.PARTICIPANT or (not self._host.is_open and self.counted)
        if load_bearing:
            self._host.replica_failed(self, f"failed: {error!r}")
            return False
        self._note_failure(error)
        self._ctx.recovery.forget_recovered(self.storage)
        self.readable_max = -1
        self.counted = False
        self.role = ReplicaRole.CONNECTING
        return True

    def _recovered_again(self) -> None:
        """One INFO line when a replica that failed is back: only once it recovered, not on every answer, so
        a replica that answers and is then refused again (a retry every 100 ms) stays one outage, one
        WARNING line, until it really is back."""
        if self._failures:
            log.info("%r answers again after %d failed attempts and recovered", self, self._failures)
            self._failures = 0

    def _note_failure(self, error: BaseException) -> None:
        self._failures += 1
        if self._failures == 1:
            self._retry_log.log(
                logging.WARNING,
                "%r is out of the session (%r); retrying it every %d ms at most",
                self,
                error,
                self._ctx.config.max_retry_interval_ms,
            )
        else:
            log.debug("%r still failing: %r", self, error)

    async def _connect(self, backoff: Backoff) -> tuple[ReplicaConnection, SessionInfo]:
        host, ctx = self._host, self._ctx
        while True:
            if self.retiring and host.is_open:
                raise SessionOver  # its vote is no longer needed
            conn: ReplicaConnection | None = None
            try:
                conn = await ctx.connector.connect(self.storage, ctx.partition_id, ctx.session_id)
                info = await host.call(conn.last_session_info())
            except SessionFencedError as e:
                if conn is not None:
                    await conn.aclose()
                host.fenced(f"{self.storage}: {e}")
                raise SessionOver from None
            except (WaltzError, TimeoutError) as e:
                if conn is not None:
                    await conn.aclose()
                self._note_failure(e)
                await backoff.sleep()
                continue
            self.connection = conn
            self.role = ReplicaRole.RECOVERING
            return conn, info

    async def _recover(self, conn: ReplicaConnection, info: SessionInfo) -> None:
        session = self._host
        recovery = self._ctx.recovery
        max_id = await session.call(conn.max_transaction_id())
        classification = classify_replica(recovery.previous, self.storage, info, max_id)
        self.classification = classification
        if classification.truncate_to is not None and max_id > classification.truncate_to:
            max_id = await session.call(
                conn.truncate(
                    classification.truncate_to,
                    reason=f"recovery of session {self._ctx.session_id}: replica classified "
                    f"{classification.kind.value}",
                )
            )
        self.max_id = self.readable_max = max_id
        log.debug("%r classified %s, max id %d", self, classification.kind.value, max_id)
        if classification.counted:
            self.counted = True
            recovery.update(self.storage, max_id)

        # While the closing high-water mark is undecidable, laggards catch up from their usher: this is one of
        # the two ways ("Replica C catches up with Replica A") the vote becomes decidable.
        # Only a replica whose class keeps its log may raise its high-water mark this way: a later recovery
        # would truncate a CLOSED or UNTRUSTED replica again, discarding copies an earlier decision counted,
        # and the decision could then go down (a replica would hold a low-water mark above the committed log).
        may_copy = self.counted and classification.truncate_to is None
        while recovery.resolved is None:
            usher = recovery.usher(self.storage) if may_copy else None
            if usher is None:
                if self.counted:
                    await recovery.wait_for_change()
                else:
                    await self._wait_uncounted(conn, info)
                continue
            name, usher_hwm = usher
            records = await session.copy_records(self, self.max_id + 1, usher_hwm, source=name)
            await self._append_copies(conn, records)  # none if it restarted at the trim point
            recovery.update(self.storage, self.max_id)

        low_water_mark = await self._truncate_to_resolved(conn, recovery.resolved)
        self.readable_max = self.max_id
        await session.call(conn.set_low_water_mark(low_water_mark))
        await self._copy_until(conn, low_water_mark)
        self.role = ReplicaRole.RECOVERED
        recovery.mark_recovered(self.storage)

    async def _truncate_to_resolved(self, conn: ReplicaConnection, resolved: int) -> int:
        """Cut the replica to ``resolved``; returns the low-water mark it is to persist.

        A replica that restarted at a trim point above ``resolved + 1`` (raised after this session opened,
        then the replica recovered again in it) keeps its log up to below that trim point: a node never cuts
        below it, and every id below a trim point is committed, so its mark is its max id, not ``resolved``.
        """
        if self.max_id <= resolved:
            return resolved
        session = self._host
        self.max_id = await session.call(
            conn.truncate(
                resolved,
                reason=f"recovery of session {self._ctx.session_id}: above the resolved high-water mark",
            )
        )
        if self.max_id == resolved:
            return resolved
        # Answers the replica's trim point; a log that ends below it restarts there (storage handlers).
        in_force = await session.call(conn.trim(0))
        self.max_id = await session.call(conn.max_transaction_id())
        if resolved < self.max_id < in_force:
            log.info(
                "partition %d: replica %s holds nothing between %d and its trim point %d; it recovers at %d",
                self._ctx.partition_id,
                self.storage,
                resolved,
                in_force,
                self.max_id,
            )
            return self.max_id
        raise InvariantViolation(f"{self.storage} truncated to {resolved} reports max id {self.max_id}")

    async def _wait_uncounted(self, conn: ReplicaConnection, info: SessionInfo) -> None:
        """Wait for a change of the vote; every ``idle_probe_interval_ms``, look at the replica again.

        A replica that is not counted (restored, or wiped and re-added) may be repaired while the vote waits:
        ``waltz storage recover-partition`` takes it offline, copies a healthy replica into it and brings it
        back. Its class must then be decided again, or the vote would wait for a new session that nothing
        starts. A changed control info raises :class:`_Reexamine`; a failed probe (the replica went offline)
        takes the ordinary retry path, which reconnects and classifies it afresh.
        """
        try:
            async with asyncio.timeout(self._ctx.config.idle_probe_interval_ms / 1000):
                await self._ctx.recovery.wait_for_change()
            return
        except TimeoutError:
            pass
        now = await self._host.call(conn.last_session_info())
        if now != info:
            raise _Reexamine(f"control info changed from {info} to {now}")

    async def _vote_only(self, conn: ReplicaConnection, info: SessionInfo) -> None:
        """A retiring replica: count in the vote with the records it validly holds, serve copies, never write.

        Nothing is truncated: the high-water mark it counts with is cut where truncation would have cut it.
        """
        session, recovery = self._host, self._ctx.recovery
        max_id = await session.call(conn.max_transaction_id())
        classification = classify_replica(recovery.previous, self.storage, info, max_id)
        self.classification = classification
        if classification.truncate_to is not None:
            max_id = min(max_id, classification.truncate_to)
        self.max_id = self.readable_max = max_id
        if classification.counted:
            self.counted = True
            recovery.update(self.storage, max_id)
        await session.wait_open()

    async def _copy_until(self, conn: ReplicaConnection, last: int) -> None:
        """Copy committed records from the others until this replica holds ``last``."""
        while self.max_id < last:
            records = await self._host.copy_records(self, self.max_id + 1, last)
            if not records and self.max_id >= last:
                return  # it restarted at the trim point, past ``last`` (see trimming.py)
            if not records:
                raise InvariantViolation(f"{self.storage} at {self.max_id} cannot copy up to {last}")
            await self._append_copies(conn, records)

    async def _append_copies(self, conn: ReplicaConnection, records: Sequence[Record]) -> None:
        if not records:
            return
        if records[0].transaction_id != self.max_id + 1:
            raise InvariantViolation(
                f"copy to {self.storage} starts at {records[0].transaction_id}, its max id is {self.max_id}"
            )
        await self._host.call(conn.append(records))
        self.max_id = self.readable_max = records[-1].transaction_id

    async def _take_part(self, conn: ReplicaConnection) -> None:
        session = self._host
        await session.wait_open()
        if self.role is not ReplicaRole.PARTICIPANT:
            # Recovered after the session opened: be recorded clean before counting in any write vote.
            self.role = ReplicaRole.JOINING
            await session.mark_clean(self)
            while True:
                await self._copy_until(conn, session.high_water_mark)
                if session.try_join(self):
                    break
        await self._write(conn)

    async def _write(self, conn: ReplicaConnection) -> None:
        session = self._host
        mailbox = self._mailbox
        loop = self._loop = asyncio.get_running_loop()
        self._sent_max = self.max_id
        conn.on_lost(partial(self._link_lost, conn))
        self._idle_active(loop.time())
        try:
            while True:
                if self._failure is not None:
                    raise self._failure  # an append request failed: this replica is out of the session
                self._mail.clear()
                # The requests under way vote and send the rest themselves. With none, a batch left unsent
                # does not continue the log: the replica joined late, and the gap below it is committed.
                if not self._send() and not self._requests:
                    first = mailbox[0].first
                    if first <= self._sent_max:
                        raise InvariantViolation(f"{self.storage} at {self._sent_max} was sent batch {first}")
                    await self._copy_until(conn, first - 1)
                    self._sent_max = self.max_id
                    continue
                if not mailbox and self.max_id < session.high_water_mark:
                    # A replica may join a few committed ids behind (try_join allows it) and normally copies
                    # them before its first batch; an idle partition has no next batch, so copy them now and
                    # every replica ends complete. A batch delivered meanwhile waits: it continues them.
                    self._sent_max = _NOT_WRITING
                    await self._copy_until(conn, session.high_water_mark)
                    self._sent_max = self.max_id
                    continue
                if not self._probe_due:  # (set by the timer, maybe while the task was copying)
                    await self._mail.wait()
                if self._probe_due:
                    self._probe_due = False
                    if not self._requests:
                        await self._probe(conn)
                    self._arm_idle(loop.time() + self._idle_interval_s)
        finally:
            self._sent_max = _NOT_WRITING
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if self._idle_timer is not None:
                self._idle_timer.cancel()
                self._idle_timer = None
            requests = [future for future, _, _ in self._requests]
            for future in requests:
                future.cancel()
            if requests:
                await asyncio.wait(requests)

    # -- idle probing ----------------------------------------------------------------------------------------
    # Failures are seen on use, so an idle participant is looked at, or a dead one would keep the partition
    # looking healthy until the next write. Two questions, answered apart: is the node alive (shared by
    # every partition on its link: a lost link is reported at once by on_lost, and a node that answered
    # anyone within idle_probe_interval_ms is alive), and does this replica still hold exactly what it
    # acknowledged (per partition: checked 1 interval after the last write, then ever more rarely, doubling
    # up to idle_probe_max_interval_ms while it agrees). One timer per replica checks both on its own and
    # wakes the task only when a probe is due; a write does not touch it (it is moved lazily, as _timer is).

    def _link_lost(self, conn: ReplicaConnection, error: BaseException) -> None:
        """The link to the node (shared with other partitions) was lost: fail now, not at the next probe."""
        if self.connection is conn and self._failure is None:
            self._failure = error
            self._mail.set()

    def _idle_active(self, now: float) -> None:
        """The replica wrote (or starts writing): the per-partition check starts its backoff again."""
        interval_s = self._idle_interval_s
        self._idle_seen = self.max_id
        self._check_gap_s = interval_s
        self._check_at = now + interval_s
        self._arm_idle(now + interval_s)

    def _arm_idle(self, when: float) -> None:
        loop = self._loop
        assert loop is not None  # armed only while _write runs
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self._idle_timer = loop.call_at(when, self._on_idle_tick)

    def _idle_tick(self) -> None:
        """The idle timer fired: nothing to do while busy; else wake the task if a probe is due."""
        self._idle_timer = None
        loop, conn = self._loop, self.connection
        assert loop is not None
        if conn is None:
            return
        now = loop.time()
        if self._requests or self._mailbox or self.max_id != self._idle_seen:
            self._idle_active(now)  # busy: a failure shows on the requests under way
            return
        interval_s = self._idle_interval_s
        heard_s = conn.last_answer_s()
        if heard_s + interval_s / 2 > now and self._check_at > now:
            # Alive. Look again before the answer is an interval old, each replica of the link at a random
            # point of its second half: the first to find it stale probes, and its answer spares the others
            # (ticks at one instant would all probe: one probe per replica again, not about two per link).
            again = heard_s + interval_s * (0.5 + self._ctx.rng.random() / 2)
            self._arm_idle(min(again, self._check_at))
            return
        self._probe_due = True
        self._mail.set()

    async def _probe(self, conn: ReplicaConnection) -> None:
        """Ask the idle replica its max id: it must hold what it acknowledged, nothing more, nothing less."""
        expected = self.max_id
        max_id = await self._host.call(conn.max_transaction_id())
        # A batch delivered meanwhile is sent at once, and its acknowledgement may be handled before this
        # coroutine resumes (both answers in one read): the replica then answered what it held when asked.
        # Anything outside that range is a lost or an extra record.
        if not expected <= max_id <= self.max_id:
            raise InvariantViolation(
                f"{self.storage} holds {max_id}, expected {expected}"
                + (f"..{self.max_id}" if self.max_id != expected else "")
            )
        assert self._loop is not None
        now = self._loop.time()
        if self.max_id != self._idle_seen:
            self._idle_active(now)
            return
        self._check_gap_s = min(self._check_gap_s * 2, self._ctx.config.idle_probe_max_interval_ms / 1000)
        self._check_at = now + self._check_gap_s
