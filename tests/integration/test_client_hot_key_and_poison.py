"""Against a real cluster, in both ``client.callbackMode`` modes: many writers on ONE key (no lost update, no
writer starved: this client's contexts take turns, another client's conflicts are retried on knowledge), and
a poisoned transaction (``submit`` names it; ``uncaught_exception`` may skip it)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from kazoo.client import KazooClient

from tests.integration.client_cluster import (
    CALLBACK_MODES,
    ClientTestCluster,
    CounterApp,
    Increment,
    Tagged,
    counter_app,
    wait_until,
)
from waltz import AsyncWaltzClient, Transaction
from waltz.client.api import ApplyAction
from waltz.errors import PartitionStuckError

pytestmark = pytest.mark.integration

CLIENTS = 2
WRITERS_PER_CLIENT = 16
INCREMENTS_PER_WRITER = 8


class AppliedIncrement(Increment):
    """An :class:`Increment` whose application the writer awaits (on_application may come from a thread)."""

    def __init__(self, app: CounterApp, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(app, 0)
        self.loop = loop
        self.applied = asyncio.Event()

    def on_application(self) -> None:
        self.loop.call_soon_threadsafe(self.applied.set)

    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        self.loop.call_soon_threadsafe(self.applied.set)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", CALLBACK_MODES)
def test_many_writers_on_one_key_lose_no_update_and_none_starves(
    tmp_path: Path, zk: KazooClient, zk_connect_string: str, mode: str
) -> None:
    async def main() -> None:
        async with ClientTestCluster(tmp_path, zk, zk_connect_string) as cluster:
            config = cluster.client_config(callback_mode=mode, max_concurrent_transactions=64)
            apps = [counter_app(1, mode) for _ in range(CLIENTS)]
            clients = [AsyncWaltzClient(app, config) for app in apps]
            loop = asyncio.get_running_loop()
            for client in clients:
                await client.start()
            try:

                async def writer(client: AsyncWaltzClient, app: CounterApp) -> list[AppliedIncrement]:
                    done = []
                    for _ in range(INCREMENTS_PER_WRITER):
                        context = AppliedIncrement(app, loop)
                        await client.submit(context)
                        await asyncio.wait_for(context.applied.wait(), 60)
                        done.append(context)
                    return done

                results = await asyncio.gather(
                    *(
                        writer(client, app)
                        for client, app in zip(clients, apps, strict=True)
                        for _ in range(WRITERS_PER_CLIENT)
                    )
                )
                total = CLIENTS * WRITERS_PER_CLIENT * INCREMENTS_PER_WRITER
                await wait_until(lambda: all(len(a.applied[0]) == total for a in apps), 60, "the whole log")
            finally:
                for client in clients:
                    await client.close()
            contexts = [c for run in results for c in run]
            # No writer starved: every one of them finished all its increments.
            assert all(c.completed is True and c.exception is None for c in contexts)
            # No lost update: the log counts 1, 2, ..., total, and both clients applied all of it.
            assert apps[0].data(0) == [str(n).encode() for n in range(1, total + 1)]
            assert apps[1].applied[0] == apps[0].applied[0]
            assert not [e for a in apps for e in a.errors]

    asyncio.run(main())


class PoisonApp(CounterApp):
    """Cannot apply a transaction whose data is ``b"poison"``; skips it once ``skip`` is set."""

    def __init__(self) -> None:
        super().__init__(1)
        self.skip = False
        self.failures = 0

    def _apply(self, transaction: Transaction, data: bytes) -> None:
        if data == b"poison":
            raise ValueError("cannot decode this payload")
        super()._apply(transaction, data)

    def uncaught_exception(
        self, partition_id: int, transaction_id: int, exception: BaseException
    ) -> ApplyAction | None:
        with self.lock:
            self.failures += 1
            if self.skip:
                self.hwm[partition_id] = transaction_id  # The application records the skip itself.
                return ApplyAction.SKIP
        return None


class AsyncPoisonApp(PoisonApp):
    async def apply_transaction(self, transaction: Transaction) -> None:  # type: ignore[override]
        self._apply(transaction, await transaction.fetch_transaction_data())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", CALLBACK_MODES)
def test_a_poisoned_transaction_is_named_by_submit_and_can_be_skipped(
    tmp_path: Path, zk: KazooClient, zk_connect_string: str, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    app = AsyncPoisonApp() if mode == "inline" else PoisonApp()

    async def main() -> None:
        async with (
            ClientTestCluster(tmp_path, zk, zk_connect_string) as cluster,
            AsyncWaltzClient(app, cluster.client_config(callback_mode=mode)) as client,
        ):
            await client.submit(Tagged(b"ok"))
            await client.submit(Tagged(b"poison"))
            await wait_until(lambda: app.failures >= 4, 30, "redeliveries of the poisoned transaction")
            with pytest.raises(PartitionStuckError, match=r"transaction 1: .*ValueError: cannot decode"):
                await client.submit(Tagged(b"refused"))
            assert app.hwm[0] == 0
            app.skip = True
            await wait_until(lambda: app.hwm[0] == 1, 30, "the skip")
            after = Tagged(b"after")
            await client.submit(after)
            await client.flush_transactions(30)
            assert after.completed is True
            assert app.data(0) == [b"ok", b"after"]
            assert app.hwm[0] == 2

    with caplog.at_level(logging.INFO, logger="waltz.client.core"):
        asyncio.run(main())
    tracebacks = [r for r in caplog.records if r.exc_info is not None and "transaction 1" in r.getMessage()]
    assert len(tracebacks) == 1
