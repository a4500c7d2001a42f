"""A run of feed entries handed to the core in one call (``feed_run_nowait``, as the network driver's reader
does with each read's entries of a partition): it takes what the feed queue has room for, resolves this
client's own appends among them and queues them for ``apply_transaction`` in order, in both modes."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.client.helpers import FAST, ApplyOrderCallbacks, Ctx
from tests.unit.client.test_async_client import wait_until
from waltz import AsyncWaltzClient
from waltz.client.stream import Feed, Mount, _on_feed_run
from waltz.protocol.records import ReqId
from waltz.testing import MockDriver


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["inline", "threads"])
def test_a_run_takes_what_the_feed_has_room_for_and_resolves_our_appends_in_order(mode: str) -> None:
    async def main() -> None:
        events: list[str] = []
        driver = MockDriver()
        config = FAST.replace(callback_mode=mode, feed_queue_size=3)
        async with AsyncWaltzClient(ApplyOrderCallbacks(events), config, driver=driver) as client:
            driver.suspend_feed()  # The mock commits the appends; the test delivers the feed itself.
            contexts = [Ctx(b"x%d" % i) for i in range(5)]
            for context in contexts:
                await client.submit(context)
            await wait_until(lambda: driver.cluster.high_water_mark(0) == 4)
            entries = [(r.transaction_id, r.req_id, r.header) for r in driver.cluster.records(0)]
            listener = driver.listener
            # Room for three: the first three are taken (and resolved), the driver keeps the other two.
            assert listener.feed_run_nowait(0, entries) == 3
            await wait_until(lambda: "apply:2" in events)
            assert not contexts[3].finished.is_set()
            assert listener.feed_run_nowait(0, entries[3:]) == 2
            await client.flush_transactions(timeout=5)
            assert events == [f"apply:{t}" for t in range(5)]
            for context in contexts:
                assert context.events == ["completion:True", "application"]
            # Entries of a partition this client does not mount (any more) are taken and dropped.
            assert listener.feed_run_nowait(5, entries) == 5

    asyncio.run(main())


def _deliver_in_inbox_order(mount: Mount, delivered: list[int]) -> bool:
    """What the delivery task does with the queued feed entries (an unbounded listener): repeats dropped, the
    next id delivered, a gap ends the session (False)."""
    while (event := mount.get_nowait()) is not None:
        assert isinstance(event, Feed)
        if event.transaction_id <= mount.position:
            continue
        if event.transaction_id != mount.position + 1:
            return False
        delivered.append(event.transaction_id)
        mount.position = event.transaction_id
    return True


@settings(max_examples=300, deadline=None)
@given(
    start=st.integers(min_value=-1, max_value=5),
    # Mostly the next id (a dense feed), sometimes a repeat, a step back or a gap.
    reads=st.lists(
        st.lists(st.sampled_from([1, 1, 1, 1, 1, 0, -1, -3, 2]), max_size=8), min_size=1, max_size=4
    ),
    rooms=st.lists(st.integers(min_value=0, max_value=6), min_size=4, max_size=4),
    drain=st.lists(st.booleans(), min_size=4, max_size=4),
    per_entry=st.booleans(),
    data_lag=st.integers(min_value=-1, max_value=2),
)
def test_the_reader_hands_a_partitions_feed_on_in_id_order_once_whatever_the_reads_hold(
    start: int, reads: list[list[int]], rooms: list[int], drain: list[bool], per_entry: bool, data_lag: int
) -> None:
    """Reads of feed entries with repeats, gaps, entries out of order and more than the listener has room for
    (taken by run, or, ``per_entry``, by a listener with no ``feed_run_nowait``, entry by entry from the
    inbox; the inbox drained by the delivery task between reads or not): the ids
    that reach the listener are those the partition's feed has in order, each once, as when the entries
    arrived one at a time; a gap ends delivery there."""
    mount = Mount(0, start)
    mount.session = ReqId.of(1, 1, 0, -1)
    delivered: list[int] = []
    room = [0]

    def run_nowait(_p: int, entries: list[tuple[int, ReqId, int]]) -> int:
        taken = entries[: room[0]]
        room[0] -= len(taken)
        delivered.extend(tid for tid, _, _ in taken)
        return len(taken)

    last = start - data_lag
    ids_of_reads: list[list[int]] = []
    for steps in reads:
        ids_of_reads.append([])
        for step in steps:
            last += step
            ids_of_reads[-1].append(last)
    reads = ids_of_reads
    expected: list[int] = []
    position, broken = start, False
    for ids in reads:  # The oracle: one entry at a time.
        for tid in ids:
            if broken or tid <= position:
                continue
            if tid != position + 1:
                broken = True
                continue
            expected.append(tid)
            position = tid

    ok = True
    for i, ids in enumerate(reads):
        room[0] = rooms[i]
        entries = [(tid, ReqId.of(1, 1, 0, tid), 0) for tid in ids]
        if entries:
            _on_feed_run(None if per_entry else run_nowait, mount, entries)
        if drain[i]:
            ok = ok and _deliver_in_inbox_order(mount, delivered)
        if not ok:
            break
    if ok:
        ok = _deliver_in_inbox_order(mount, delivered)
    assert ok == (not broken)
    assert delivered == expected


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["inline", "threads"])
def test_a_runs_committed_appends_give_back_each_slot_once_and_a_waiting_submit_gets_one(mode: str) -> None:
    # _resolve gives the slots of a run's committed first attempts back in one Slots.release(count): not one
    # more (a slot freed twice lets the partition exceed client.maxConcurrentTransactions), not one less (a
    # leaked slot ends every later submit in its timeout), and a submit waiting for one is woken.
    async def main() -> None:
        driver = MockDriver()
        config = FAST.replace(callback_mode=mode, max_concurrent_transactions=3)
        async with AsyncWaltzClient(ApplyOrderCallbacks([]), config, driver=driver) as client:
            driver.suspend_feed()
            contexts = [Ctx(b"x%d" % i) for i in range(5)]
            for context in contexts[:3]:
                await client.submit(context)
            slots = client._partitions[0].slots
            assert slots.used == 3
            waiting = asyncio.ensure_future(client.submit(contexts[3]))
            await asyncio.sleep(0.05)
            assert not waiting.done()  # no slot free
            await wait_until(lambda: driver.cluster.high_water_mark(0) == 2)
            entries = [(r.transaction_id, r.req_id, r.header) for r in driver.cluster.records(0)]
            assert driver.listener.feed_run_nowait(0, entries) == 3
            await asyncio.wait_for(waiting, 5)  # woken by the run's release
            assert slots.used == 1
            await client.submit(contexts[4])
            await wait_until(lambda: driver.cluster.high_water_mark(0) == 4)
            entries = [(r.transaction_id, r.req_id, r.header) for r in driver.cluster.records(0)]
            assert driver.listener.feed_run_nowait(0, entries[3:]) == 2
            await client.flush_transactions(timeout=5)
            assert slots.used == 0
            for context in contexts:
                assert context.events == ["completion:True", "application"]

    asyncio.run(main())
