"""Slots: the per-partition back pressure, and application threads of the sync client waiting for room."""

from __future__ import annotations

import asyncio
import threading
import time

from waltz.client.state import Slots


def _takers(slots: Slots, count: int, taken: list[int]) -> list[threading.Thread]:
    """``count`` threads, each waiting (on its own thread) for a free slot until it takes one."""

    def take(i: int) -> None:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if slots.try_acquire():
                taken.append(i)
                return
            slots.wait_from_thread(deadline - time.monotonic())

    threads = [threading.Thread(target=take, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    return threads


def _wait_for(predicate: object, timeout_s: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.005)
    return False


def test_a_burst_of_releases_reaches_as_many_waiting_threads() -> None:
    # The loop wakes one thread per burst and each woken thread wakes the next while slots are left: every
    # freed slot must still find a waiting thread, none left asleep beside a free slot.
    slots = Slots(4)
    for _ in range(4):
        assert slots.try_acquire()
    taken: list[int] = []
    threads = _takers(slots, 6, taken)
    assert _wait_for(lambda: slots._thread_waiters == 6)
    for _ in range(3):
        slots.release()  # One burst, as a feed read resolving three appends.
    assert _wait_for(lambda: len(taken) == 3)
    time.sleep(0.05)
    assert len(taken) == 3  # The other three still wait: no slot for them.
    assert slots.used == 4
    for _ in range(3):
        slots.release()
        time.sleep(0.01)  # One at a time this time: each release wakes one.
    for t in threads:
        t.join(5)
    assert sorted(taken) == list(range(6))
    assert slots.used == 4


def test_wake_threads_ends_every_wait_at_once() -> None:
    slots = Slots(1)
    assert slots.try_acquire()
    results: list[bool] = []
    threads = [threading.Thread(target=lambda: results.append(slots.wait_from_thread(30))) for _ in range(3)]
    for t in threads:
        t.start()
    assert _wait_for(lambda: slots._thread_waiters == 3)
    started = time.monotonic()
    slots.wake_threads()
    for t in threads:
        t.join(5)
    assert time.monotonic() - started < 5
    assert results == [False, False, False]  # Woken, and still no room.


def test_release_of_several_slots_grants_loop_waiters_and_reaches_waiting_threads() -> None:
    # A feed run's committed appends give their slots back in one release(count): each slot must still go
    # to a waiter on the loop first (FIFO), and what is left to a waiting thread.
    async def main() -> None:
        slots = Slots(3)
        for _ in range(3):
            assert slots.try_acquire()
        waiters = [asyncio.ensure_future(slots.acquire(5)) for _ in range(2)]
        await asyncio.sleep(0)
        taken: list[int] = []
        threads = _takers(slots, 1, taken)
        assert await asyncio.to_thread(_wait_for, lambda: slots._thread_waiters == 1)
        slots.release(3)
        await asyncio.gather(*waiters)  # Both loop waiters got a slot.
        assert await asyncio.to_thread(_wait_for, lambda: taken == [0])  # And the third slot the thread.
        for t in threads:
            t.join(5)
        assert slots.used == 3

    asyncio.run(main())
