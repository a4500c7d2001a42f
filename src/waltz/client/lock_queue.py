"""``LockQueue``: this client's own contexts take turns on a write lock, in FIFO order (pure, no I/O).

Why: the server's optimistic lock check lets one of N contexts that wrote the same key at the same
high-water mark commit, and fails the other N-1. If all N belong to this client, sending them together only
buys N-1 lock failures and N-1 executions per success, and whoever wins is a matter of luck (a context can
lose for seconds). So, per partition, the client lets only one of its contexts at a time have an append in
flight that holds a given write lock; the others wait in a queue, and the next one executes again only once
this client has *applied* the transaction of the one before (or its append failed), so its ``execute`` reads
the state that won and its append passes the server's check. Contexts of other clients still conflict on the
server and come back as lock failures, retried on knowledge (see ``AsyncWaltzClient``).

Only write locks take part: read locks never hold anything on the server, and append locks never fail. The
queue is keyed by the 32-bit lock hash the server uses, so two locks whose hashes collide share a turn (as
they share slots on the server).

States of one lock: **free** (no owner, nobody reserved), **owned** by the context whose append holds it,
**reserved** for the context at the head of the queue, woken to execute again. A context may take a lock when
it is free or reserved for it; otherwise it waits behind the others. The caller wakes the contexts this class
returns and reports each one's next step through :meth:`acquire`, :meth:`park` or :meth:`leave`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable

__all__ = ["LockQueue"]

_new_lock = object.__new__


class _Lock:
    __slots__ = ("owner", "queue", "reserved")

    def __init__(self, owner: Hashable | None = None) -> None:
        self.owner: Hashable | None = owner
        self.reserved: Hashable | None = None
        # Made when the first context waits: most locks (one per append with write locks) never have one.
        self.queue: deque[Hashable] | None = None


class LockQueue:
    """Turns on write locks for the contexts of one partition; contexts are any hashable objects."""

    def __init__(self) -> None:
        self._locks: dict[int, _Lock] = {}
        # Read-only outside this class (a caller may test them for emptiness: nothing held, nobody parked).
        self.held: dict[Hashable, set[int]] = {}  # context -> hashes it owns or is reserved
        self.parked: dict[Hashable, int] = {}  # context -> the hash it waits for

    def blocker(self, context: Hashable, locks: Iterable[int]) -> int | None:
        """The first of ``locks`` that ``context`` may not take now (owned by, reserved for or waited for
        by another context), or None if it may take them all."""
        for h in locks:
            lock = self._locks.get(h)
            if lock is None:
                continue
            if lock.owner is not None and lock.owner is not context:
                return h
            if lock.reserved is not None and lock.reserved is not context:
                return h
            if lock.reserved is None and lock.owner is None and lock.queue:
                return h  # Cannot happen (a free lock with waiters has one reserved); be safe anyway.
        return None

    def take(self, context: Hashable, locks: tuple[int, ...]) -> list[Hashable] | None:
        """:meth:`acquire` if :meth:`blocker` finds nothing in the way, else None (nothing changed): the
        contexts to wake, or None if ``context`` must wait for its turn.

        One pass for the common case (once per append with write locks): a context new here, which owns,
        reserves and waits for nothing, so any lock in the table that is owned, reserved or waited for is
        another's."""
        if context in self.held or context in self.parked:
            if self.blocker(context, locks) is not None:
                return None
            return self.acquire(context, locks)
        lock_table = self._locks
        if len(locks) == 1:
            # The commonest case, one write lock: one lookup, no loops.
            h = locks[0]
            lock = lock_table.get(h)
            if lock is None:
                # _Lock(context) without its __init__ call (once per locked append).
                lock = lock_table[h] = _new_lock(_Lock)
                lock.owner = context
                lock.reserved = None
                lock.queue = None
            elif lock.owner is not None or lock.reserved is not None or lock.queue:
                return None
            else:
                lock.owner = context
            self.held[context] = {h}
            return []
        for h in locks:
            lock = lock_table.get(h)
            if lock is not None and (lock.owner is not None or lock.reserved is not None or lock.queue):
                return None
        if locks:
            for h in locks:
                lock = lock_table.get(h)
                if lock is None:
                    lock_table[h] = _Lock(context)
                else:
                    lock.owner = context
            self.held[context] = set(locks)
        return []

    def acquire(self, context: Hashable, locks: Iterable[int]) -> list[Hashable]:
        """``context`` sends an append holding ``locks`` (check :meth:`blocker` first). Returns contexts to
        wake: those next in line for the locks it was reserved but no longer wants."""
        wanted = set(locks)
        if context not in self.held and context not in self.parked:
            # The common cases: a context that holds, reserves and waits for nothing yet, so it has no
            # reservation to pass on; without write locks it has nothing to do at all.
            if wanted:
                lock_table = self._locks
                for h in wanted:
                    lock = lock_table.get(h)
                    if lock is None:
                        lock = lock_table[h] = _Lock()
                    lock.owner = context
                self.held[context] = wanted
            return []
        for h in wanted:
            lock = self._locks.get(h)
            if lock is None:
                lock = self._locks[h] = _Lock()
            lock.owner = context
            if lock.reserved is context:
                lock.reserved = None
        self.held.setdefault(context, set()).update(wanted)
        self.parked.pop(context, None)
        return self._pass_reservations(context, keep=wanted)

    def park(self, context: Hashable, lock_hash: int) -> list[Hashable]:
        """``context`` waits for ``lock_hash`` (the :meth:`blocker` it hit). Returns contexts to wake."""
        self._unpark(context)
        wake = self._pass_reservations(context, keep=set())
        lock = self._locks.get(lock_hash)
        if lock is None:
            lock = self._locks[lock_hash] = _Lock()
        if lock.queue is None:
            lock.queue = deque()
        lock.queue.append(context)
        self.parked[context] = lock_hash
        return wake

    @property
    def holds_any(self) -> bool:
        """True if some context holds or is reserved a lock: False means :meth:`release` of any context
        returns [] and changes nothing (a client whose appends take no write locks)."""
        return bool(self.held)

    def is_idle(self, context: Hashable) -> bool:
        """True if ``context`` holds and waits for nothing here: ``acquire(context, ())`` would do nothing."""
        return context not in self.held and context not in self.parked

    def release(self, context: Hashable) -> list[Hashable]:
        """``context``'s append failed, or its transaction is applied: its locks pass on. Returns contexts
        to wake (each now holds a reservation)."""
        held = self.held.pop(context, None)
        if held is None:
            return []  # The common case, a context without write locks (no set made for it).
        wake: list[Hashable] = []
        lock_table = self._locks
        for h in held:
            lock = lock_table.get(h)
            if lock is None:
                continue
            if lock.owner is context:
                lock.owner = None
            if lock.reserved is context:
                lock.reserved = None
            if lock.owner is None and lock.reserved is None:
                if lock.queue:
                    wake.extend(self._next(h, lock))
                else:
                    del lock_table[h]  # Free and nobody waits (the common case): _forget_if_idle.
        return wake

    def leave(self, context: Hashable) -> list[Hashable]:
        """``context`` ended (or executes again without needing its turn): drop everything it holds or waits
        for. Returns contexts to wake."""
        if context not in self.held and context not in self.parked:
            return []
        self._unpark(context)
        return self.release(context)

    def is_parked(self, context: Hashable) -> bool:
        return context in self.parked

    def statistics(self) -> dict[str, int]:
        return {
            "locks": len(self._locks),
            "owned": sum(1 for lock in self._locks.values() if lock.owner is not None),
            "waiting": len(self.parked),
        }

    # -- internals ---------------------------------------------------------------------------------------

    def _unpark(self, context: Hashable) -> None:
        h = self.parked.pop(context, None)
        if h is None:
            return
        lock = self._locks.get(h)
        if lock is not None:
            try:
                if lock.queue is not None:
                    lock.queue.remove(context)
            except ValueError:
                pass
            self._forget_if_idle(h, lock)

    def _pass_reservations(self, context: Hashable, keep: set[int]) -> list[Hashable]:
        """Give up the reservations ``context`` holds on locks outside ``keep``."""
        held = self.held.get(context)
        if not held:
            return []
        wake: list[Hashable] = []
        for h in [h for h in held if h not in keep]:
            lock = self._locks.get(h)
            if lock is not None and lock.reserved is context:
                lock.reserved = None
                held.discard(h)
                wake.extend(self._next(h, lock))
        if not held:
            del self.held[context]
        return wake

    def _next(self, h: int, lock: _Lock) -> list[Hashable]:
        """A lock just became free: reserve it for the next in line, if any."""
        if lock.owner is not None or lock.reserved is not None:
            return []
        while lock.queue:
            context = lock.queue.popleft()
            if self.parked.get(context) == h:
                del self.parked[context]
                lock.reserved = context
                self.held.setdefault(context, set()).add(h)
                return [context]
        self._forget_if_idle(h, lock)
        return []

    def _forget_if_idle(self, h: int, lock: _Lock) -> None:
        if lock.owner is None and lock.reserved is None and not lock.queue:
            self._locks.pop(h, None)
