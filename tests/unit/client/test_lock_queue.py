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


def test_take_is_blocker_then_acquire() -> None:
    q = LockQueue()
    assert q.take("a", (K, J)) == []  # New here, locks free: taken in one pass.
    assert q.take("b", (J,)) is None  # Owned by a: nothing changes.
    assert q.statistics() == {"locks": 2, "owned": 2, "waiting": 0}
    q.park("b", J)
    assert q.release("a") == ["b"]
    assert q.take("c", (J,)) is None  # Reserved for b.
    assert q.take("b", (J,)) == []  # b, known here (reserved), takes what it was reserved.
    assert q.release("b") == []
    assert q.statistics() == {"locks": 0, "owned": 0, "waiting": 0}


def test_take_agrees_with_blocker_and_acquire_on_random_histories() -> None:
    # Two queues driven through the same random history, one taking with take(), the other with blocker()
    # and acquire(): every answer and the final state must be the same.
    import random

    for seed in range(200):
        rng = random.Random(seed)
        fast, slow = LockQueue(), LockQueue()
        for _ in range(60):
            context = rng.choice("abcdef")
            locks = tuple(rng.sample([1, 2, 3], rng.randint(1, 2)))
            op = rng.random()
            if op < 0.5:
                blocked = slow.blocker(context, locks)
                expected = None if blocked is not None else slow.acquire(context, locks)
                assert fast.take(context, locks) == expected, seed
                if blocked is not None and rng.random() < 0.7 and not slow.is_parked(context):
                    assert fast.park(context, blocked) == slow.park(context, blocked), seed
            elif op < 0.8:
                assert fast.release(context) == slow.release(context), seed
            else:
                assert fast.leave(context) == slow.leave(context), seed
            assert fast.statistics() == slow.statistics(), seed


def test_holds_any_is_false_exactly_when_a_release_would_change_nothing() -> None:
    q = LockQueue()
    assert not q.holds_any
    q.acquire("a", [K])
    assert q.holds_any
    q.park("b", K)
    assert q.release("a") == ["b"]
    assert q.holds_any  # b is reserved the lock
    q.acquire("b", [K])
    assert q.release("b") == []
    assert not q.holds_any
    assert q.release("c") == []
