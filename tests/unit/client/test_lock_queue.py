"""LockQueue, the pure turn-taking of one client's contexts on write locks."""

from __future__ import annotations

from waltz.client.lock_queue import LockQueue

K, J = 11, 22


def test_contexts_take_turns_in_fifo_order() -> None:
    q = LockQueue()
    assert q.blocker("a", [K]) is None
    assert q.acquire("a", [K]) == []
    assert q.blocker("b", [K]) == K
    q.park("b", K)
    q.park("c", K)
    assert q.release("a") == ["b"]  # b is reserved the lock, c still waits
    assert q.blocker("c", [K]) == K  # reserved for b: c may not jump the queue
    assert q.blocker("new", [K]) == K
    assert q.blocker("b", [K]) is None
    assert q.acquire("b", [K]) == []
    assert q.release("b") == ["c"]
    assert q.acquire("c", [K]) == []
    assert q.release("c") == []
    assert q.statistics() == {"locks": 0, "owned": 0, "waiting": 0}


def test_a_woken_context_that_no_longer_needs_the_lock_passes_its_turn_on() -> None:
    q = LockQueue()
    q.acquire("a", [K])
    q.park("b", K)
    q.park("c", K)
    assert q.release("a") == ["b"]
    # b executed again and now writes J only: its reservation of K goes to c.
    assert q.acquire("b", [J]) == ["c"]
    assert q.blocker("c", [K]) is None


def test_leaving_while_queued_or_reserved_wakes_the_next() -> None:
    q = LockQueue()
    q.acquire("a", [K])
    q.park("b", K)
    q.park("c", K)
    assert q.leave("b") == []  # Was only waiting: nobody to wake, c is next now.
    assert q.release("a") == ["c"]
    assert q.leave("c") == []  # Reserved, then ended (closed, expired): the lock is free again.
    assert q.blocker("d", [K]) is None
    assert q.is_parked("c") is False


def test_contexts_without_write_locks_cost_nothing() -> None:
    q = LockQueue()
    assert q.acquire("a", []) == []
    assert q.leave("a") == []
    assert q.statistics() == {"locks": 0, "owned": 0, "waiting": 0}
