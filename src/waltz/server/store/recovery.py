"""Recovery: classify each replica, resolve the previous session's closing high-water mark, record the
outcome.

This module holds the decisions; ``replica_session.py`` performs the storage calls they imply. The algorithm
is seed 000's recovery procedure and REFERENCE §4.6 ``RecoveryManagerImpl``; the notes below say why each rule
is safe, and where this implementation is stricter than the original.

Classification (:func:`classify_replica`), from the ZooKeeper metadata of the previous session (``previous``)
and the storage's persisted control info:

======== ============================================== =================================== ===============
class     condition                                      action                              in the vote
======== ============================================== =================================== ===============
EMPTY     ZooKeeper lists no replica at all              (new partition: resolved HWM = -1)  no vote held
DAMAGED   its node reports it lost records it held       none                                unknown
NEW       not in ZooKeeper's replica set                 truncate to its storage LWM         not counted
UNTRUSTED ZooKeeper state has session id -1              truncate to its storage LWM         its max id
RESTORED  storage session id < ZooKeeper's for it        truncate to its storage LWM         unknown
CLOSED    ZooKeeper has its closing high-water mark      truncate to that mark (or its LWM)  its max id
BEHIND    max id < storage low-water mark                none                                its max id
VOTING    otherwise                                      none                                its max id
======== ============================================== =================================== ===============

* A replica's records at or below its storage low-water mark are always clean: SetLowWaterMark is only sent
  after the replica was truncated to the resolved (committed) high-water mark, and afterwards it only receives
  committed records by catch-up until it starts taking writes above that mark.
* UNTRUSTED is stricter than the original, which treats ``(-1, closing)`` (written for a brand-new replica
  that had not recovered when the session opened) like CLOSED and truncates to the closing mark; but such a
  replica may hold a dirty tail from long ago below that mark (it was never cleaned), so we cut it at its own
  clean point.
* DAMAGED replicas (the storage node found records missing that its control file says it held: a power cut
  wiped its partition directory, say; see ``docs/replication.md``) count as *unknown*, as RESTORED ones do,
  for the same reason: their max id says nothing about what they acknowledged. Nothing is truncated (what
  they still hold is at or below their clean point). Once the vote is resolved they are caught up like any
  laggard, and the node clears the damage once they hold its new low-water mark.
* Nothing is ever truncated below the replica's own storage low-water mark: the records at or below it are
  committed, and the storage node refuses such a truncation (only an operator's repair may). A CLOSED
  replica's mark can be above its closing mark when a later session recovered it (set its low-water mark) but
  ended before it was recorded clean in ZooKeeper; it is then cut at its own mark, and counted with what it
  holds, all of it committed.
* RESTORED replicas count as *unknown* in the vote, not as holders of their (rolled-back) max id: before the
  restore they may have been part of a write quorum, and counting them as "does not hold it" could settle on a
  high-water mark below an acknowledged transaction. As unknown, they make such a mark undecidable until a
  laggard catches up from the replica that still holds it (the seed's "Replica C catches up with Replica A").
* While the vote is undecidable, only VOTING and BEHIND replicas copy from their usher. The decision must
  never go down from one recovery to the next (a replica may already hold the decided mark as its low-water
  mark); copies made by a CLOSED or UNTRUSTED replica would be truncated away again by the next recovery's
  classification, taking support away from a mark an earlier (failed) recovery decided.
* Every other replica of the previous set is counted with its max id after any truncation: it holds exactly
  the records at or below it, and those agree with the newest writing session's records.

The vote (:func:`waltz.server.store.voting.resolve_high_water_mark`) runs over the previous replica set.
Replicas that are unknown (offline, not classified yet, restored, or no longer assigned) make a candidate
undecidable when they could complete its quorum.

ZooKeeper update once a quorum of the *current* set has recovered (:func:`metadata_after_recovery`): recovered
replicas -> ``(new session, UNRESOLVED)``; a replica of the previous session still unrecovered -> its old
session id with closing mark = the resolved mark; a brand-new unrecovered replica -> ``(-1, resolved)``;
otherwise unchanged. Replicas no longer assigned are dropped. A replica that recovers later is marked
``(new session, UNRESOLVED)`` by its own version-checked write *before* it takes part in any write
(:func:`metadata_with_clean_replica`): a replica whose vote helped commit a transaction must never be recorded
as closed below it.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Iterable
from dataclasses import dataclass

from waltz.cluster.partition_metadata import UNRESOLVED, PartitionMetadata, ReplicaState
from waltz.server.store.interfaces import SessionInfo
from waltz.server.store.voting import resolve_high_water_mark

__all__ = [
    "Classification",
    "RecoveryState",
    "ReplicaClass",
    "classify_replica",
    "metadata_after_recovery",
    "metadata_with_clean_replica",
]


class ReplicaClass(enum.Enum):
    EMPTY = "empty"
    DAMAGED = "damaged"
    NEW = "new"
    UNTRUSTED = "untrusted"
    RESTORED = "restored"
    CLOSED = "closed"
    BEHIND = "behind"
    VOTING = "voting"


@dataclass(frozen=True)
class Classification:
    """What recovery does with one replica before the vote."""

    kind: ReplicaClass
    truncate_to: int | None
    """Truncate the replica to this id before anything else (None: keep everything)."""
    counted: bool
    """Whether its max id (after truncation) is counted in the vote; False means unknown or not a voter."""


def classify_replica(
    previous: PartitionMetadata, storage: str, info: SessionInfo, max_transaction_id: int
) -> Classification:
    """Classify one replica (see the module docstring's table)."""
    if not previous.replicas:
        return Classification(ReplicaClass.EMPTY, None, False)
    if info.damaged:
        return Classification(ReplicaClass.DAMAGED, None, False)
    state = previous.replicas.get(storage)
    if state is None:
        return Classification(ReplicaClass.NEW, info.low_water_mark, False)
    if info.session_id < state.session_id:
        return Classification(ReplicaClass.RESTORED, info.low_water_mark, False)
    if state.session_id < 0:
        return Classification(ReplicaClass.UNTRUSTED, info.low_water_mark, True)
    if state.closing_high_water_mark != UNRESOLVED:
        return Classification(
            ReplicaClass.CLOSED, max(state.closing_high_water_mark, info.low_water_mark), True
        )
    if max_transaction_id < info.low_water_mark:
        return Classification(ReplicaClass.BEHIND, None, True)
    return Classification(ReplicaClass.VOTING, None, True)


def metadata_after_recovery(
    previous: PartitionMetadata,
    generation: int,
    session_id: int,
    current: Iterable[str],
    recovered: Iterable[str],
    resolved: int,
) -> PartitionMetadata:
    """The partition metadata to write when the new session opens (see the module docstring)."""
    clean = set(recovered)
    states: dict[str, ReplicaState] = {}
    for storage in current:
        old = previous.replicas.get(storage)
        if storage in clean:
            states[storage] = ReplicaState(storage, session_id, UNRESOLVED)
        elif old is None:
            states[storage] = ReplicaState(storage, -1, resolved)
        elif old.closing_high_water_mark == UNRESOLVED:
            states[storage] = ReplicaState(storage, old.session_id, resolved)
        else:
            states[storage] = old
    return PartitionMetadata(generation, session_id, states)


def metadata_with_clean_replica(
    current: PartitionMetadata, storage: str, session_id: int
) -> PartitionMetadata:
    """``current`` with ``storage`` marked clean in ``session_id`` (a replica that recovered after the
    opening)."""
    replicas = dict(current.replicas)
    replicas[storage] = ReplicaState(storage, session_id, UNRESOLVED)
    return PartitionMetadata(current.generation, current.session_id, replicas)


class RecoveryState:
    """The shared state of one session's recovery: who counts with which high-water mark, and the outcome.

    Replica sessions register and update their high-water marks; every change re-evaluates the vote ("every
    time the situation changes, the recovery process re-evaluates the quorum") and wakes the waiters. Once
    resolved, the value never changes.
    """

    def __init__(self, previous: PartitionMetadata) -> None:
        self.previous = previous
        self.previous_replicas: tuple[str, ...] = tuple(sorted(previous.replicas))
        self._known: dict[str, int] = {}
        self.resolved: int | None = -1 if not previous.replicas else None
        self.recovered: list[str] = []
        self._changed = asyncio.Event()

    @property
    def known(self) -> dict[str, int]:
        """High-water marks of the counted replicas heard from so far."""
        return dict(self._known)

    def update(self, storage: str, high_water_mark: int) -> None:
        """Record (or raise) a counted replica's high-water mark and re-evaluate the vote."""
        if storage not in self.previous.replicas:
            raise ValueError(f"{storage} is not a replica of the previous session")
        self._known[storage] = high_water_mark
        if self.resolved is None:
            self.resolved = resolve_high_water_mark(self._known.values(), len(self.previous_replicas))
        self._notify()

    def usher(self, storage: str) -> tuple[str, int] | None:
        """The counted replica with the smallest high-water mark above ``storage``'s (to catch up from)."""
        mine = self._known.get(storage)
        if mine is None:
            return None
        best: tuple[str, int] | None = None
        for other in self.previous_replicas:
            hwm = self._known.get(other)
            if hwm is not None and hwm > mine and (best is None or hwm < best[1]):
                best = (other, hwm)
        return best

    def mark_recovered(self, storage: str) -> None:
        if storage not in self.recovered:
            self.recovered.append(storage)
            self._notify()

    def forget_recovered(self, storage: str) -> None:
        """A recovered replica that is not load-bearing failed: no longer recovered, nor a copy source."""
        if storage in self.recovered:
            self.recovered.remove(storage)

    async def wait_for_change(self) -> None:
        """Wait until the next registration, update or recovery."""
        await self._changed.wait()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
