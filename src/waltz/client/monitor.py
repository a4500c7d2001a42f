"""The transaction monitor: decides, from what the server streams back, whether each append succeeded.

No I/O and no asyncio here: events go in, :class:`Resolution` values come out, and the caller (the client
core) acts on them. One monitor per partition. The rules:

* **Own request id in the feed** → that append committed; every *older* pending append failed. This is sound
  because the appends of a partition travel on one ordered stream: the server has seen, and resolved, every
  request sent before the one it just committed, and a failed append sends nothing back.
* **Lock failure** → the append failed. The resolution is held back until the application has applied the
  transaction that caused the conflict, so that the retry's ``execute`` reads fresh state.
* **Flush response** (partition high-water mark ``H``, echoing the request id of our last pending append at
  the time) → once the feed has delivered every transaction up to ``H``, every append registered up to that
  request id that has not shown up in the feed failed.
* **Nudge**: a partition with appends pending longer than ``client.longWaitThreshold`` gets a flush, so a lost
  request is noticed even when nothing else is appended.

Timestamps are passed in (seconds on any monotonic clock), so tests need no real time.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import NamedTuple, TypeAlias

from waltz.protocol.records import ReqId

MAX_FLUSHES_IN_FLIGHT = 16
"""Flushes remembered per partition; a newer flush covers everything an older one did."""


class Outcome(enum.Enum):
    """How an append ended."""

    COMMITTED = "committed"
    FAILED = "failed"
    LOCK_FAILED = "lock failed"


_COMMITTED = Outcome.COMMITTED  # A module constant: read once per feed entry (enum lookups are slow).


class Resolution(NamedTuple):
    """The fate of one append. ``transaction_id`` is the committed id (COMMITTED), the id of the conflicting
    transaction (LOCK_FAILED), or -1 (FAILED). A named tuple: one is made per append, and a frozen
    dataclass costs three times as much to build."""

    req_id: ReqId
    outcome: Outcome
    transaction_id: int = -1


_new_tuple = tuple.__new__
"""``_new_tuple(Resolution, (req_id, outcome, transaction_id))`` builds a Resolution in C, without the named
tuple's generated Python ``__new__`` (once per committed append)."""

_Entry: TypeAlias = tuple[int, float]
"""A pending append: (seq, registered_at). A tuple, not a class: one is made per append."""


class TransactionMonitor:
    """Pending appends of one partition, in registration (= send) order."""

    def __init__(self, high_water_mark: int) -> None:
        self.feed_high_water_mark = high_water_mark
        """The id of the last transaction the feed delivered."""
        self.applied_high_water_mark = high_water_mark
        """The id of the last transaction the application applied."""
        self._pending: dict[ReqId, _Entry] = {}
        self._last_seq = 0
        self._last_registered_at = 0.0
        self._flushes_sent: dict[ReqId, int] = {}  # flush request id -> seq it covers
        self._flush_responses: list[tuple[int, int]] = []  # (seq covered, hwm to wait for), parked
        self._lock_failures: list[tuple[ReqId, int]] = []  # (req id, conflicting txn id), parked
        self._last_flush_at: float | None = None

    # -- registration ------------------------------------------------------------------------------------

    def register(self, req_id: ReqId, seq: int, now: float) -> None:
        """Record an append about to be sent. ``seq`` must grow with every registration."""
        if seq <= self._last_seq:
            raise ValueError(f"append seq {seq} registered after seq {self._last_seq}")
        if req_id in self._pending:
            raise ValueError(f"{req_id!r} registered twice")
        self._last_seq = seq
        self._last_registered_at = now
        self._pending[req_id] = (seq, now)

    @property
    def pending_count(self) -> int:
        """Appends sent and not yet resolved (held-back lock failures not included)."""
        return len(self._pending)

    @property
    def unresolved_count(self) -> int:
        """Pending appends plus lock failures held back until the conflicting transaction is applied."""
        return len(self._pending) + len(self._lock_failures)

    @property
    def oldest_pending_at(self) -> float | None:
        """When the oldest pending append was registered (None if nothing is pending)."""
        for entry in self._pending.values():
            return entry[1]
        return None

    def is_pending(self, req_id: ReqId) -> bool:
        return req_id in self._pending

    # -- events from the server ---------------------------------------------------------------------------

    def on_feed(self, transaction_id: int, req_id: ReqId) -> list[Resolution]:
        """A committed transaction arrived in the feed (in id order)."""
        if transaction_id > self.feed_high_water_mark:
            self.feed_high_water_mark = transaction_id
        pending = self._pending
        entry = pending.pop(req_id, None)
        if entry is None:
            resolutions: list[Resolution] = []
        elif pending and next(iter(pending.values()))[0] < entry[0]:
            # Older appends still pending: they were lost (the server commits in send order).
            resolutions = self._fail_up_to(entry[0] - 1)
            resolutions.append(Resolution(req_id, _COMMITTED, transaction_id))
        else:
            # The common case: the oldest pending append committed.
            resolutions = [_new_tuple(Resolution, (req_id, _COMMITTED, transaction_id))]
        if self._flush_responses or self._flushes_sent:
            resolutions.extend(self._release_flushes())
        return resolutions

    def on_feed_run(self, entries: Sequence[tuple[int, ReqId, int]]) -> list[Resolution]:
        """:meth:`on_feed` of each ``(transaction_id, req_id, header)`` of ``entries`` (in id order), in one
        pass: the resolutions in the order the calls one by one would have made them."""
        if self._flush_responses or self._flushes_sent:
            # Flushes are released as the feed high-water mark passes theirs, entry by entry.
            return [r for tid, req_id, _ in entries for r in self.on_feed(tid, req_id)]
        pending = self._pending
        resolutions: list[Resolution] = []
        for tid, req_id, _ in entries:
            entry = pending.pop(req_id, None)
            if entry is None:
                continue  # Not ours (another client's, or resolved already).
            if pending and next(iter(pending.values()))[0] < entry[0]:
                resolutions.extend(self._fail_up_to(entry[0] - 1))  # Older ones lost, as in on_feed.
            resolutions.append(_new_tuple(Resolution, (req_id, _COMMITTED, tid)))
        last = entries[-1][0] if entries else -1
        if last > self.feed_high_water_mark:
            self.feed_high_water_mark = last
        return resolutions

    def on_lock_failure(self, req_id: ReqId, transaction_id: int) -> list[Resolution]:
        """The server rejected ``req_id``; ``transaction_id`` took the conflicting lock."""
        if self._pending.pop(req_id, None) is None:
            return []  # Already resolved (for example by a flush after a remount): nothing to do.
        self._lock_failures.append((req_id, transaction_id))
        return self._release_lock_failures()

    def on_flush_response(self, req_id: ReqId, high_water_mark: int) -> list[Resolution]:
        """Every append sent before flush ``req_id`` is resolved; the log ends at ``high_water_mark``."""
        seq = self._flushes_sent.pop(req_id, None)
        if seq is None:
            return []  # Not a flush of ours, or answered twice.
        self._flush_responses.append((seq, high_water_mark))
        return self._release_flushes()

    def on_applied(self, transaction_id: int) -> list[Resolution]:
        """The application applied ``transaction_id``."""
        if transaction_id > self.applied_high_water_mark:
            self.applied_high_water_mark = transaction_id
        if not self._lock_failures:
            return []  # The common case: no lock failure waits for an apply.
        return self._release_lock_failures()

    def fail(self, req_id: ReqId) -> list[Resolution]:
        """The append could not be sent."""
        if self._pending.pop(req_id, None) is None:
            return []
        return [Resolution(req_id, Outcome.FAILED)]

    # -- flushes -----------------------------------------------------------------------------------------

    def flush_request(self, now: float) -> ReqId | None:
        """The request id to flush now (our last pending append), or None if nothing is pending.

        The caller must send a flush with that id; its response resolves everything up to it.
        """
        if not self._pending:
            return None
        req_id = next(reversed(self._pending))
        self._flushes_sent[req_id] = self._pending[req_id][0]
        while len(self._flushes_sent) > MAX_FLUSHES_IN_FLIGHT:
            # Forget the oldest: a newer flush covers everything it covered.
            del self._flushes_sent[next(iter(self._flushes_sent))]
        self._last_flush_at = now
        return req_id

    def nudge(self, now: float, threshold: float) -> ReqId | None:
        """A flush to send if the last registration (and the last flush) is older than ``threshold``."""
        if not self._pending or now - self._last_registered_at < threshold:
            return None
        if self._last_flush_at is not None and now - self._last_flush_at < threshold:
            return None
        return self.flush_request(now)

    # -- internals ---------------------------------------------------------------------------------------

    def _fail_up_to(self, seq: int) -> list[Resolution]:
        # _pending is in registration order, which is seq order: stop at the first newer entry, so a commit
        # of the oldest pending append (the common case) costs O(1), not O(pending).
        failed: list[ReqId] = []
        for req_id, entry in self._pending.items():
            if entry[0] > seq:
                break
            failed.append(req_id)
        if not failed:
            return []
        for req_id in failed:
            del self._pending[req_id]
        return [Resolution(req_id, Outcome.FAILED) for req_id in failed]

    def _release_flushes(self) -> list[Resolution]:
        resolutions: list[Resolution] = []
        still_parked: list[tuple[int, int]] = []
        for seq, hwm in self._flush_responses:
            if hwm <= self.feed_high_water_mark:
                resolutions.extend(self._fail_up_to(seq))
            else:
                still_parked.append((seq, hwm))
        self._flush_responses = still_parked
        # Flushes whose appends are all resolved can never resolve anything; forget them.
        if self._flushes_sent:
            # The first pending entry is the oldest (registration order).
            oldest_pending = next(iter(self._pending.values()))[0] if self._pending else None
            self._flushes_sent = {
                r: s
                for r, s in self._flushes_sent.items()
                if oldest_pending is not None and s >= oldest_pending
            }
        return resolutions

    def _release_lock_failures(self) -> list[Resolution]:
        ready = [(r, t) for r, t in self._lock_failures if t <= self.applied_high_water_mark]
        if not ready:
            return []
        self._lock_failures = [(r, t) for r, t in self._lock_failures if t > self.applied_high_water_mark]
        return [Resolution(r, Outcome.LOCK_FAILED, t) for r, t in ready]
