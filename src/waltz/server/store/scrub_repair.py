"""Repairing the damage the storage nodes' scrub reports: the owner asks, and rewrites from good copies.

A storage node's background scrub finds damage that no read has met yet; only the owner knows which replicas
are clean and which ids are committed, so the owner asks (:class:`DamageWatch`, one task per open store
session). A read that meets damage is repaired by the session itself (``StoreSession._from_replica``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Sequence
from typing import Protocol, TypeVar

from waltz.errors import BrokenResourceError, CorruptionError, TrimmedError, WaltzError
from waltz.protocol.records import Record
from waltz.server.store.replica_session import ReplicaSession
from waltz.server.store.support import RepairStatistics, StoreConfig

__all__ = ["MAX_DAMAGED_IDS", "REPAIR_RETRY_POLLS", "DamageReporter", "DamageWatch", "check_records"]

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_DAMAGED_IDS = 1000
"""Damaged ids one poll asks a replica for (a storage node remembers at most this many per partition)."""
REPAIR_RETRY_POLLS = 6
"""After a failed repair of damage a replica reported, this many of its polls are skipped before the next try
(so a record no participant holds a good copy of costs a warning a minute, not one per poll)."""


class RepairSession(Protocol):
    """What the watch reads of its open store session."""

    partition_id: int
    config: StoreConfig
    high_water_mark: int
    participants: list[ReplicaSession]
    replica_sessions: dict[str, ReplicaSession]
    repairing: set[str]
    """Replicas a repair is running for (at most one at a time each, reads' repairs included)."""

    async def call(self, request: Awaitable[T]) -> T: ...


class DamageReporter(Protocol):
    """Where repairs are counted and damaged reads reported (the store partition)."""

    repairs: RepairStatistics
    trim_point: int
    """Ids below it need no repair: no one reads them, and every replica may delete them."""

    def replica_damaged(self, storage: str, detail: str) -> None: ...


class DamageWatch:
    """The task that polls a session's participants for damage their scrub found, and repairs it."""

    def __init__(self, session: RepairSession, reporter: DamageReporter) -> None:
        self._session = session
        self._reporter = reporter

    async def run(self) -> None:
        """Every ``damage_poll_interval_ms``, ask each participant which stored records it found damaged on
        its own, and repair the committed ones from the other participants.

        A storage node's background scrub finds damage that no read has met yet; only the owner knows which
        replicas are clean and which ids are committed, so the owner asks. Polling on the session's existing
        connection keeps the storage node passive (it never calls servers) and touches no message of the
        write path; one small request per replica per interval is the whole cost. Best effort: a failed poll
        is left to the replica's own requests, which notice a broken node; a failed repair is tried again
        :data:`REPAIR_RETRY_POLLS` polls later.
        """
        interval_s = self._session.config.damage_poll_interval_ms / 1000
        skip: dict[str, int] = {}
        failing = self._reporter.repairs.failing
        while True:
            await asyncio.sleep(interval_s)
            for gone in [s for s in failing if s not in self._session.replica_sessions]:
                del failing[gone]  # no longer a replica: its damage is not this partition's to repair
            for replica in list(self._session.participants):
                storage, conn = replica.storage, replica.connection
                if conn is None or storage in self._session.repairing:
                    continue
                if skip.get(storage, 0) > 0:
                    skip[storage] -= 1
                    continue
                try:
                    ids = await self._session.call(conn.damaged_records(MAX_DAMAGED_IDS))
                except WaltzError as e:
                    log.debug(
                        "partition %d: damage poll of %s failed: %r", self._session.partition_id, storage, e
                    )
                    continue
                # Ids above the committed mark are not settled: recovery decides them, not a repair. Ids below
                # the trim point were deleted everywhere (a replica not told yet may still report them).
                last = min(self._session.high_water_mark, replica.max_id)
                first = max(0, self._reporter.trim_point)
                committed = sorted(t for t in set(ids) if first <= t <= last)
                if not committed:
                    # Repaired meanwhile (by a read that met the damage) or truncated: nothing is failing.
                    failing.pop(storage, None)
                    continue
                self._session.repairing.add(storage)
                try:
                    if not await self._repair_reported(replica, committed):
                        skip[storage] = REPAIR_RETRY_POLLS
                finally:
                    self._session.repairing.discard(storage)

    async def _repair_reported(self, bad: ReplicaSession, ids: Sequence[int]) -> bool:
        """Rewrite ``bad``'s damaged copies of the committed ``ids`` (sorted) with verified copies read from
        other participants; True if every one was rewritten."""
        stats = self._reporter.repairs
        stats.started += 1
        what = _describe_ids(ids)
        stats.in_progress[bad.storage] = what
        try:
            return await self._rewrite_reported(bad, ids, what, stats)
        finally:
            stats.in_progress.pop(bad.storage, None)

    async def _rewrite_reported(
        self, bad: ReplicaSession, ids: Sequence[int], what: str, stats: RepairStatistics
    ) -> bool:
        """The body of :meth:`_repair_reported`: rewrite, count and log."""
        log.info(
            "partition %d: repairing %d damaged record(s) %s reported by %s, from the other replicas",
            self._session.partition_id,
            len(ids),
            what,
            bad.storage,
        )
        rewritten = 0
        try:
            for start, count in _runs(ids):
                position, end = start, start + count
                while position < end:
                    try:
                        records = await self._good_copies(bad, position, end - position)
                    except TrimmedError as e:
                        position = e.trim_point  # trimmed meanwhile: nothing below it needs a copy
                        continue
                    conn = bad.connection
                    if conn is None:
                        raise BrokenResourceError(f"{bad.storage} left the session")
                    await self._session.call(conn.repair(records))
                    position += len(records)
                    rewritten += len(records)
        except WaltzError as e:
            stats.failed += 1
            stats.records += rewritten
            stats.failing[bad.storage] = f"{what}: {e!r}"
            log.warning(
                "partition %d: repair of %s's damaged records %s failed after %d record(s); tried again "
                "later: %r",
                self._session.partition_id,
                bad.storage,
                what,
                rewritten,
                e,
            )
            return False
        stats.finished += 1
        stats.records += rewritten
        stats.failing.pop(bad.storage, None)
        log.info(
            "partition %d: repaired %d damaged record(s) %s on %s",
            self._session.partition_id,
            rewritten,
            what,
            bad.storage,
        )
        return True

    async def _good_copies(self, bad: ReplicaSession, start: int, count: int) -> list[Record]:
        """Verified records ``start..`` (at most ``count``) from a participant other than ``bad``."""
        error: WaltzError | None = None
        for src in self._session.participants:
            conn = src.connection
            if src is bad or conn is None or src.max_id < start:
                continue
            try:
                records = await self._session.call(conn.read_records(start, count))
            except CorruptionError as e:
                self._reporter.replica_damaged(src.storage, str(e))
                error = e
                continue
            problem = check_records(records, start, count)
            if problem is None:
                return records
            error = CorruptionError(f"{src.storage} returned bad records for {start}: {problem}")
        raise error or BrokenResourceError(f"no other participant holds transaction {start}")


def _runs(ids: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted distinct ids as ``(first, count)`` runs of consecutive ids."""
    runs: list[tuple[int, int]] = []
    for txn in ids:
        if runs and runs[-1][0] + runs[-1][1] == txn:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((txn, 1))
    return runs


def _describe_ids(ids: Sequence[int], max_runs: int = 5) -> str:
    """``17, 30..32`` for a log line (the first ``max_runs`` runs, then how many more)."""
    runs = _runs(ids)
    text = ", ".join(f"{a}" if n == 1 else f"{a}..{a + n - 1}" for a, n in runs[:max_runs])
    return text + (f" and {len(runs) - max_runs} more runs" if len(runs) > max_runs else "")


def check_records(records: Sequence[Record], start: int, max_count: int) -> str | None:
    """Why a read answer is unusable (None if it is fine): empty, too long, not dense from ``start``,
    corrupt."""
    if not records:
        return "no records"
    if len(records) > max_count:
        return f"{len(records)} records, asked for {max_count}"
    for i, rec in enumerate(records):
        if rec.transaction_id != start + i:
            return f"id {rec.transaction_id} at position {i}"
        if not rec.verify():
            return f"record {rec.transaction_id} fails its checksum"
    return None
