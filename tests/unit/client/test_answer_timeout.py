"""client.answerTimeout: an append the server never answers (nor resolves through a flush) is not waited for
without bound. After the timeout the core asks the driver to resync (a new stream, as after a lost
connection); the flush after READY then decides the append with the usual rules, so a committed append is
reported once and applied once, and a lost one is retried (fault-suite seed 309)."""

from __future__ import annotations

import asyncio

import pytest

from waltz.testing import MockDriver

from .helpers import Ctx
from .test_async_client import client_with, data_of, run, wait_until

ANSWER = {"answer_timeout_ms": 500}


@pytest.mark.parametrize("mode", ["threads", "inline"])
def test_an_append_lost_on_a_deaf_stream_is_retried_after_the_answer_timeout(mode: str) -> None:
    driver = MockDriver()

    async def main() -> None:
        client, callbacks = client_with(driver, callback_mode=mode, **ANSWER)
        async with client:
            await wait_until(lambda: client._partitions[0].state is not None)
            # The stream stays open, but the server drops the append and every flush the nudge sends.
            driver.wedge(0, deaf=True)
            ctx = Ctx(b"a")
            await client.submit(ctx)
            await client.flush_transactions(timeout=3.0)
            assert driver.resyncs >= 1
            assert ctx.events == ["completion:True", "application"]
            assert ctx.executions == 2  # The lost append was found out and executed again.
            assert data_of(driver.cluster) == [b"a"]
            assert callbacks.data() == [b"a"]

    run(main())


@pytest.mark.parametrize("mode", ["threads", "inline"])
def test_an_append_committed_on_a_mute_stream_is_reported_once_after_the_answer_timeout(mode: str) -> None:
    driver = MockDriver()

    async def main() -> None:
        client, callbacks = client_with(driver, callback_mode=mode, **ANSWER)
        async with client:
            await wait_until(lambda: client._partitions[0].state is not None)
            # The server appends, but neither the feed nor any answer comes back on this stream.
            driver.wedge(0, deaf=False, mute=True)
            ctx = Ctx(b"a")
            await client.submit(ctx)
            await wait_until(lambda: len(data_of(driver.cluster)) == 1)
            assert ctx.events == []  # Committed, but not answered yet: no verdict.
            await client.flush_transactions(timeout=3.0)
            assert driver.resyncs >= 1
            # The re-mounted feed carries the committed append: success, never a second execution.
            assert ctx.events == ["completion:True", "application"]
            assert ctx.executions == 1
            assert data_of(driver.cluster) == [b"a"]
            assert callbacks.data() == [b"a"]

    run(main())


def test_no_resync_while_appends_are_answered_in_time() -> None:
    driver = MockDriver()

    async def main() -> None:
        client, _ = client_with(driver, callback_mode="inline", **ANSWER)
        async with client:
            for i in range(20):
                await client.submit(Ctx(b"%d" % i))
            await client.flush_transactions(timeout=3.0)
            await asyncio.sleep(0.7)  # Longer than the answer timeout, with nothing pending.
            assert driver.resyncs == 0

    run(main())
