"""A run of feed entries handed to the core in one call (``feed_run_nowait``, as the network driver's reader
does with each read's entries of a partition): it takes what the feed queue has room for, resolves this
client's own appends among them and queues them for ``apply_transaction`` in order, in both modes."""

from __future__ import annotations

import asyncio

import pytest

from tests.unit.client.helpers import FAST, ApplyOrderCallbacks, Ctx
from tests.unit.client.test_async_client import wait_until
from waltz import AsyncWaltzClient
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
