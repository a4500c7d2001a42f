"""The per-partition optimistic lock table (a Bloom-filter-like array of high-water marks).

The table is ``size`` transaction ids (default 30000), all starting at the partition high-water mark when the
partition's append task starts. Its memory (9 bytes a slot, 264 KiB at the default size) is taken at the
first request that has locks: a partition whose appends never lock costs none of it, which is most of what
one more partition costs a server (see ``tests/integration/test_many_partitions.py``).

A lock (the signed 32-bit value a client sends, see :mod:`waltz.client.locks`) maps to 3 slots, found by
iterating the 32-bit linear congruential step::

    h = (h * 1103515245 + 12345) mod 2**32      three times, starting from the lock value
    slot_i = (h_i & 0x3FFFFFFF) % size          for i = 1, 2, 3

Java does the step in ``int`` arithmetic (wrapping, signed); only the low 30 bits are used, and they are the
same whether ``h`` is read as signed or unsigned, so the slots equal the original server's. (For the same
reason only the low 30 bits of a lock value matter: two values that differ only in their top two bits share
all three slots. The original behaves the same; it costs false rejections, never missed conflicts.)

* **Estimate** of one lock = the *minimum* over its 3 slots; of a request = the *maximum* over its write and
  read locks (-1 when it has none). The request conflicts when that estimate is greater than the client
  high-water mark the transaction was computed at.
* **Write** locks are checked, and on commit their slots are raised to the new transaction id. **Read** locks
  are checked and never updated. **Append** locks are never checked (an append never fails on them) but their
  slots are raised on commit, so they invalidate other transactions' read and write locks.
* Slots of write and append locks are **busy** from :meth:`LockTable.begin` until the append is resolved
  (:meth:`LockTable.release`); a request that needs a busy slot of any kind (read locks included) cannot
  begin, because the in-flight append may still commit and raise it.

Guarantee: every slot of a lock is at least the id of the last committed transaction that held it as a write
or append lock, so the estimate is never below the exact per-lock high-water mark. Hash collisions can
therefore only cause false rejections, never hide a real conflict. This module is single-threaded: one
partition's append task owns its table.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

__all__ = ["DEFAULT_LOCK_TABLE_SIZE", "NUM_HASHES", "LockRequest", "LockTable", "lock_slots"]

DEFAULT_LOCK_TABLE_SIZE = 30000
"""Slots per partition (``server.optimisticLockTableSize`` in the original)."""

NUM_HASHES = 3
"""Slots per lock; hard-coded in the original, and part of what makes Java and Python tables agree."""

_MASK32 = 0xFFFFFFFF
_object_new = object.__new__
_SLOTS_CACHE_ENTRIES = 16384
"""Lock values whose slots the tables of one size remember together (under 4 MB of tuples and ints for the
whole process, however many partitions it holds)."""
_SLOTS_OF: dict[int, dict[int, tuple[int, int, int]]] = {}
"""The remembered slots of each table size: the slots of a lock depend on the size only, so every partition
of a server (all of one size) shares one memory of them, and memory does not grow with the partitions."""
_LCG_MULTIPLIER = 1103515245
_LCG_INCREMENT = 12345


def lock_slots(lock: int, size: int) -> tuple[int, int, int]:
    """The 3 slots of ``lock`` (a 32-bit lock value, signed or unsigned) in a table of ``size`` slots."""
    h1 = (lock * _LCG_MULTIPLIER + _LCG_INCREMENT) & _MASK32
    h2 = (h1 * _LCG_MULTIPLIER + _LCG_INCREMENT) & _MASK32
    h3 = (h2 * _LCG_MULTIPLIER + _LCG_INCREMENT) & _MASK32
    return (h1 & 0x3FFFFFFF) % size, (h2 & 0x3FFFFFFF) % size, (h3 & 0x3FFFFFFF) % size


class LockRequest:
    """The slots one append holds in a :class:`LockTable`, from :meth:`LockTable.begin` to its release.

    ``checked`` has one slot triple per write and read lock (what the estimate looks at); ``updated`` holds
    the slots of write and append locks (marked busy, raised on commit): a set, or for a single write lock
    its slot triple itself (a repeated slot is marked, raised and cleared twice, which is harmless and
    cheaper than building a set once per append).
    """

    __slots__ = ("_epoch", "_released", "checked", "updated")

    def __init__(
        self,
        checked: tuple[tuple[int, int, int], ...],
        updated: frozenset[int] | tuple[int, int, int],
        epoch: int,
    ) -> None:
        self.checked = checked
        self.updated = updated
        self._epoch = epoch
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def __repr__(self) -> str:
        return (
            f"LockRequest(checked={len(self.checked)}, updated={len(self.updated)}, "
            f"released={self._released})"
        )


class LockTable:
    """The lock table of one partition; see the module docstring for the exact semantics."""

    __slots__ = ("_busy", "_epoch", "_hwms", "_initial", "_slots_of", "size")

    def __init__(self, size: int = DEFAULT_LOCK_TABLE_SIZE, initial_high_water_mark: int = -1) -> None:
        if size < 1:
            raise ValueError(f"lock table size must be positive, got {size}")
        self.size = size
        self._slots_of = _SLOTS_OF.setdefault(size, {})
        """:func:`lock_slots` of the one-write-lock appends' recent lock values (at most
        :data:`_SLOTS_CACHE_ENTRIES`, then cleared; shared by the tables of this size): a lock used again (a
        key updated again, the reason to lock it) costs a lookup instead of six multiplications and divisions
        on Python ints."""
        self._initial = initial_high_water_mark
        """What every slot holds until :meth:`_allocate` makes them (and after a :meth:`reset`)."""
        self._hwms = array("q")
        # One byte per slot: 1 while an in-flight append holds a write or append lock on it. Empty (falsy)
        # until the first request with locks allocates both arrays; never empty after (size >= 1).
        self._busy = bytearray()
        # Bumped by reset(), so a request begun before a reset cannot clear busy marks taken after it.
        self._epoch = 0

    def begin(
        self,
        write_locks: Sequence[int] = (),
        read_locks: Sequence[int] = (),
        append_locks: Sequence[int] = (),
    ) -> LockRequest | None:
        """Take the slots of an append's locks, or return None if any of them is busy (nothing is taken then).

        On success the slots of the write and append locks are busy until :meth:`release`.
        """
        size = self.size
        busy = self._busy
        if not busy:
            busy = self._allocate()
        if not read_locks and not append_locks and len(write_locks) == 1:
            # The common locked append: one write lock. The same as below, without the lists and sets.
            slots = lock_slots(write_locks[0], size)
            a, b, c = slots
            if busy[a] or busy[b] or busy[c]:
                return None
            busy[a] = busy[b] = busy[c] = 1
            return LockRequest((slots,), slots, self._epoch)
        checked: list[tuple[int, int, int]] = []
        updated: set[int] = set()
        for lock in write_locks:
            slots = lock_slots(lock, size)
            checked.append(slots)
            updated.update(slots)
        checked.extend(lock_slots(lock, size) for lock in read_locks)
        for lock in append_locks:
            updated.update(lock_slots(lock, size))
        for slots in checked:
            if busy[slots[0]] or busy[slots[1]] or busy[slots[2]]:
                return None
        for slot in updated:
            if busy[slot]:
                return None
        for slot in updated:
            busy[slot] = 1
        return LockRequest(tuple(checked), frozenset(updated), self._epoch)

    def begin_checked(
        self,
        write_locks: Sequence[int],
        read_locks: Sequence[int],
        append_locks: Sequence[int],
        client_high_water_mark: int,
    ) -> LockRequest | int | None:
        """:meth:`begin` then :meth:`check` (and :meth:`release` on a conflict), in one call.

        None if a slot is busy (nothing is taken); the conflicting lock high-water mark (an int; nothing is
        taken) if the request conflicts; else the begun request. A busy slot wins over a conflict, as with
        the separate calls. This is what an append that needs no wait runs, once per locked append.
        """
        if read_locks or append_locks or len(write_locks) != 1:
            request = self.begin(write_locks, read_locks, append_locks)
            if request is None:
                return None
            conflict = self.check(request, client_high_water_mark)
            if conflict is not None:
                self.release(request)
                return conflict
            return request
        # The common locked append, one write lock: the busy test and the estimate inlined, and nothing
        # marked busy unless the request will be taken.
        lock = write_locks[0]
        slots_of = self._slots_of
        slots = slots_of.get(lock)
        if slots is None:
            if len(slots_of) >= _SLOTS_CACHE_ENTRIES:
                slots_of.clear()
            slots = slots_of[lock] = lock_slots(lock, self.size)
        a, b, c = slots
        busy = self._busy
        if not busy:
            busy = self._allocate()
        if busy[a] or busy[b] or busy[c]:
            return None
        hwms = self._hwms
        # min() of the three, without the builtin's call.
        estimate = hwms[a]
        other = hwms[b]
        if other < estimate:
            estimate = other
        other = hwms[c]
        if other < estimate:
            estimate = other
        if estimate > client_high_water_mark:
            return estimate
        busy[a] = busy[b] = busy[c] = 1
        # LockRequest((slots,), slots, self._epoch) without the Python call of its __init__.
        request = _object_new(LockRequest)
        request.checked = (slots,)
        request.updated = slots
        request._epoch = self._epoch
        request._released = False
        return request

    def _allocate(self) -> bytearray:
        """Make the slots, each at the initial high-water mark; returns the busy marks."""
        self._hwms = array("q", [self._initial]) * self.size
        self._busy = bytearray(self.size)
        return self._busy

    def estimate(self, request: LockRequest) -> int:
        """The estimated lock high-water mark of ``request``: max over write/read locks of min over slots.

        -1 when the request has no write or read locks (so it never conflicts).
        """
        hwms = self._hwms
        result = -1
        for a, b, c in request.checked:
            lock_hwm = min(hwms[a], hwms[b], hwms[c])
            if lock_hwm > result:
                result = lock_hwm
        return result

    def check(self, request: LockRequest, client_high_water_mark: int) -> int | None:
        """The conflicting lock high-water mark if the estimate exceeds ``client_high_water_mark``, else None.

        Pure: it changes nothing. A non-None result is what a LockFailure message carries.
        """
        estimate = self.estimate(request)
        return estimate if estimate > client_high_water_mark else None

    def commit(self, request: LockRequest, transaction_id: int) -> None:
        """Record that ``request``'s append committed as ``transaction_id``: raise its write and append slots.

        Slots are raised to ``max(slot, transaction_id)`` rather than overwritten: ids only grow, so this
        equals the original's assignment, and it keeps the no-missed-conflict guarantee even if a stale
        request commits. Read-lock slots are never touched. Does not release the request.
        """
        hwms = self._hwms
        for slot in request.updated:
            if hwms[slot] < transaction_id:
                hwms[slot] = transaction_id

    def commit_and_release(self, request: LockRequest, transaction_id: int) -> None:
        """:meth:`commit` then :meth:`release` (the append of ``request`` committed), in one call."""
        hwms = self._hwms
        updated = request.updated
        for slot in updated:
            if hwms[slot] < transaction_id:
                hwms[slot] = transaction_id
        # release(request), inlined (once per locked append).
        if request._released:
            return
        request._released = True
        if request._epoch != self._epoch:
            return
        busy = self._busy
        for slot in updated:
            busy[slot] = 0

    def release(self, request: LockRequest) -> None:
        """The append of ``request`` is resolved (committed or failed): its busy slots become free.

        Idempotent; a request begun before the last :meth:`reset` releases nothing (its marks were cleared).
        """
        if request._released:
            return
        request._released = True
        if request._epoch != self._epoch:
            return
        busy = self._busy
        for slot in request.updated:
            busy[slot] = 0

    def reset(self, high_water_mark: int) -> None:
        """Set every slot to ``high_water_mark`` and clear every busy mark.

        The append task calls this when a request still cannot begin although no append is pending, i.e. busy
        marks leaked; setting every slot to the partition high-water mark is safe because no committed
        transaction is newer than it.
        """
        self._initial = high_water_mark
        self._allocate()  # a request begun before may still commit: its slots must exist
        self._epoch += 1

    def lock_high_water_mark(self, lock: int) -> int:
        """The estimated high-water mark of one lock value (min over its slots); for diagnostics and tests."""
        a, b, c = lock_slots(lock, self.size)
        hwms = self._hwms
        if not hwms:
            return self._initial
        return min(hwms[a], hwms[b], hwms[c])

    def busy_slots(self) -> int:
        """How many slots in-flight appends hold; for diagnostics and tests."""
        return self.size - self._busy.count(0) if self._busy else 0

    @property
    def allocated(self) -> bool:
        """Whether the slots take their memory (from the first request with locks on)."""
        return bool(self._busy)
