"""AsyncWaltzClient over the MockDriver: lifecycle of contexts, failure detection, retries, back pressure,
ordered callbacks and redelivery. Each test runs its own event loop with asyncio.run."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from waltz import AsyncWaltzClient, ClientConfig, Transaction
from waltz.client.builder import TransactionBuilder
from waltz.errors import (
    ClientAheadError,
    ClientClosedError,
    ClientError,
    ClientTimeoutError,
    ClusterError,
    DataChecksumError,
)
from waltz.protocol.records import ReqId
from waltz.testing import MockCluster, MockDriver

from .helpers import FAST, Ctx, RecordingCallbacks, UnreachableDriver, recording_callbacks


def run(coro: Coroutine[Any, Any, None], timeout_s: float = 30.0) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(timeout_s):
            await coro

    asyncio.run(bounded())


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    # Polling is the simplest way to watch state that lives on callback threads and in the mock.
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.002)


def client_with(
    driver: MockDriver, callbacks: RecordingCallbacks | None = None, **config: Any
) -> tuple[AsyncWaltzClient, RecordingCallbacks]:
    if callbacks is None:
        callbacks = recording_callbacks(config.get("callback_mode", "threads"))
    return AsyncWaltzClient(callbacks, FAST.replace(**config), driver=driver), callbacks


def data_of(cluster: MockCluster, partition: int = 0) -> list[bytes]:
    return [r.data for r in cluster.records(partition)]


def test_submitted_contexts_are_appended_applied_in_order_on_callback_threads() -> None:
    driver = MockDriver(num_partitions=2)

    async def main() -> None:
        client, callbacks = client_with(driver)
        async with client:
            assert (client.client_id, client.cluster_name, client.num_partitions) == (0, "mock-cluster", 2)
            contexts = [Ctx(b"t%d" % i, partition=i % 2, header=i) for i in range(20)]
            for ctx in contexts:
                await client.submit(ctx)
            await client.flush_transactions(timeout=5)
            assert not client.has_pending_transactions()
            for ctx in contexts:
                assert ctx.events == ["completion:True", "application"]
                assert ctx.executions == 1
            assert callbacks.data(0) == [b"t%d" % i for i in range(0, 20, 2)]
            assert callbacks.data(1) == [b"t%d" % i for i in range(1, 20, 2)]
            assert [r.header for r in driver.cluster.records(1)] == list(range(1, 20, 2))
            assert all(name.startswith("waltz-callback") for name in callbacks.threads)
            assert await client.high_water_mark(0) == 9

    run(main())


def test_dropped_appends_are_detected_by_the_nudge_and_executed_again() -> None:
    driver = MockDriver()
    driver.force_next_append_fail(3)

    async def main() -> None:
        client, _callbacks = client_with(driver)
        async with client:
            ctx = Ctx(b"once")
            await client.submit(ctx)
            await client.flush_transactions(timeout=5)
            assert ctx.executions == 4
            assert ctx.events == ["completion:True", "application"]
            assert data_of(driver.cluster) == [b"once"]
            assert driver.appends_dropped == 3

    run(main())


def test_random_faults_never_lose_or_duplicate_a_transaction() -> None:
    cluster = MockCluster(num_partitions=3)
    driver = MockDriver(cluster=cluster, seed=7)
    driver.set_fault_rate(0.4)
    driver.set_max_delay(2)

    async def main() -> None:
        client, callbacks = client_with(driver)
        async with client:
            contexts = [Ctx(b"%d" % i, partition=i % 3) for i in range(60)]
            for ctx in contexts:
                await client.submit(ctx)
            await client.flush_transactions(timeout=20)
        assert all(ctx.events == ["completion:True", "application"] for ctx in contexts)
        committed = sorted(d for p in range(3) for d in data_of(cluster, p))
        assert committed == sorted(b"%d" % i for i in range(60))  # Each exactly once.
        for p in range(3):
            assert callbacks.data(p) == data_of(cluster, p)
        assert driver.appends_dropped > 0

    run(main())


def test_every_older_pending_append_fails_when_a_newer_one_commits() -> None:
    driver = MockDriver()

    async def main() -> None:
        client, _ = client_with(driver, long_wait_threshold_ms=60_000)  # No nudges: only the feed decides.
        async with client:
            first, second = Ctx(b"first"), Ctx(b"second")
            driver.force_next_append_fail()
            await client.submit(first)
            await client.submit(second)
            await client.flush_transactions(timeout=5)
            assert first.executions == 2  # Failed because "second" committed after it, then retried.
            assert second.executions == 1
            assert data_of(driver.cluster) == [b"second", b"first"]

    run(main())


def test_forced_lock_failure_calls_the_hook_and_retries() -> None:
    driver = MockDriver()
    driver.force_next_lock_fail(2)

    async def main() -> None:
        client, _ = client_with(driver)
        async with client:
            ctx = Ctx(b"x")
            await client.submit(ctx)
            await client.flush_transactions(timeout=5)
            assert ctx.events == ["lock_failure", "lock_failure", "completion:True", "application"]

    run(main())


def test_execute_giving_up_or_raising_ends_the_context() -> None:
    driver = MockDriver()

    async def main() -> None:
        client, _ = client_with(driver)
        async with client:
            quitter = Ctx(b"", give_up=True)
            await client.submit(quitter)
            assert quitter.events == ["completion:False"]
            broken = Ctx(b"", raise_in_execute=KeyError("no such account"))
            with pytest.raises(KeyError, match="no such account"):
                await client.submit(broken)
            assert broken.events == ["exception:KeyError"]
            await client.flush_transactions(timeout=5)
            assert driver.cluster.records(0) == []
            bad_partition = Ctx(b"", partition=5)
            with pytest.raises(ClientError, match=r"outside 0\.\.0"):
                await client.submit(bad_partition)
            assert bad_partition.events == ["exception:ClientError"]

    run(main())


def test_apply_exception_is_reported_and_the_same_transaction_delivered_again() -> None:
    driver = MockDriver()
    callbacks = RecordingCallbacks()
    callbacks.fail_next[(0, 1)] = 2

    async def main() -> None:
        client, _ = client_with(driver, callbacks)
        async with client:
            contexts = [Ctx(b"%d" % i) for i in range(4)]
            for ctx in contexts:
                await client.submit(ctx)
            await client.flush_transactions(timeout=5)
        assert callbacks.deliveries == [(0, 0), (0, 1), (0, 1), (0, 1), (0, 2), (0, 3)]
        assert [(p, t, type(e)) for p, t, e in callbacks.errors] == [(0, 1, RuntimeError)] * 2
        assert callbacks.data(0) == [b"0", b"1", b"2", b"3"]
        # on_application only after the application really applied it.
        assert contexts[1].events == ["completion:True", "application"]

    run(main())


def test_feed_starts_after_the_application_high_water_mark() -> None:
    cluster = MockCluster()

    async def main() -> None:
        writer, _ = client_with(MockDriver(cluster=cluster))
        async with writer:
            for i in range(6):
                await writer.submit(Ctx(b"%d" % i))
            await writer.flush_transactions(timeout=5)
        reader, callbacks = client_with(MockDriver(cluster=cluster), RecordingCallbacks({0: 3}))
        async with reader:
            await wait_until(lambda: callbacks.hwm[0] == 5)
        assert callbacks.deliveries == [(0, 4), (0, 5)]

    run(main())


def test_client_ahead_of_the_server_fails_submits() -> None:
    async def main() -> None:
        client, _ = client_with(MockDriver(), RecordingCallbacks({0: 5}))
        async with client:
            ctx = Ctx(b"x")
            with pytest.raises(ClientAheadError, match="ahead"):
                await client.submit(ctx)
            assert ctx.events == ["exception:ClientAheadError"]

    run(main())


def test_callbacks_hwm_errors_are_reported_and_retried() -> None:
    class Flaky(RecordingCallbacks):
        calls = 0

        def client_high_water_mark(self, partition_id: int) -> int:
            self.calls += 1
            if self.calls < 3:
                raise ConnectionError("database down")
            return super().client_high_water_mark(partition_id)

    async def main() -> None:
        callbacks = Flaky()
        client, _ = client_with(MockDriver(), callbacks)
        async with client:
            await client.submit(Ctx(b"x"))
            await client.flush_transactions(timeout=5)
        assert [(p, t) for p, t, _ in callbacks.errors] == [(0, -1), (0, -1)]
        assert callbacks.data(0) == [b"x"]

    run(main())


def test_attempt_bound_ends_the_context_with_a_timeout() -> None:
    driver = MockDriver()
    driver.set_fault_rate(1.0)

    async def main() -> None:
        client, _ = client_with(driver, max_transaction_attempts=3)
        async with client:
            ctx = Ctx(b"x")
            await client.submit(ctx)
            await client.flush_transactions(timeout=5)
            assert ctx.executions == 3
            assert ctx.events == ["exception:ClientTimeoutError"]
            assert "3 attempts" in str(ctx.exception)

    run(main())


def test_expired_context_is_not_executed_again() -> None:
    driver = MockDriver()
    driver.set_fault_rate(1.0)

    async def main() -> None:
        client, _ = client_with(driver, transaction_timeout_ms=100)
        async with client:
            ctx = Ctx(b"x")
            await client.submit(ctx)
            await client.flush_transactions(timeout=5)
            assert ctx.events == ["exception:ClientTimeoutError"]
            assert "expired" in str(ctx.exception)

    run(main())


class CountingDriver(MockDriver):
    """Checks the back-pressure bound on every append it is asked to send."""

    def __init__(self, client: Callable[[], AsyncWaltzClient], limit: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._client = client
        self._limit = limit
        self.max_outstanding = 0

    def send_append(self, partition_id: int, req_id: ReqId, builder: TransactionBuilder, now: bool) -> None:
        monitor = self._client()._partitions[partition_id].monitor
        assert monitor is not None
        self.max_outstanding = max(self.max_outstanding, monitor.unresolved_count)
        assert monitor.unresolved_count <= self._limit
        super().send_append(partition_id, req_id, builder, now)


def test_back_pressure_bounds_outstanding_appends_and_submit_times_out() -> None:
    holder: list[AsyncWaltzClient] = []
    driver = CountingDriver(lambda: holder[0], limit=2, seed=3)
    driver.set_max_delay(3)
    driver.set_fault_rate(0.2)

    async def main() -> None:
        client, _ = client_with(driver, max_concurrent_transactions=2, submit_timeout_ms=300)
        holder.append(client)
        async with client:
            contexts = [Ctx(b"%d" % i) for i in range(30)]
            await asyncio.gather(*(client.submit(ctx) for ctx in contexts[:10]))
            for ctx in contexts[10:]:
                await client.submit(ctx)
            await client.flush_transactions(timeout=10)
            assert driver.max_outstanding == 2
            assert len(driver.cluster.records(0)) == 30

            # Nothing resolves while the feed is suspended: the third submit runs out of time.
            driver.set_fault_rate(0.0)  # From here on the commit order is the submit order.
            driver.suspend_feed()
            stuck = [Ctx(b"s1"), Ctx(b"s2")]
            for ctx in stuck:
                await client.submit(ctx)
            late = Ctx(b"late")
            with pytest.raises(ClientTimeoutError, match="maxConcurrentTransactions"):
                await client.submit(late)
            assert late.events == ["exception:ClientTimeoutError"]

            # A waiting submit proceeds as soon as room is made.
            waiting = asyncio.create_task(client.submit(Ctx(b"waits")))
            await asyncio.sleep(0.1)
            assert not waiting.done()
            driver.resume_feed()
            await waiting
            await client.flush_transactions(timeout=5)
            assert data_of(driver.cluster)[-3:] == [b"s1", b"s2", b"waits"]

    run(main())


def test_flush_transactions_times_out_while_the_feed_is_suspended() -> None:
    driver = MockDriver()

    async def main() -> None:
        client, _ = client_with(driver)
        async with client:
            await wait_until(lambda: client._partitions[0].state is not None)
            driver.suspend_feed()
            await client.submit(Ctx(b"x"))
            with pytest.raises(ClientTimeoutError, match="1 contexts still in flight"):
                await client.flush_transactions(timeout=0.2)
            assert client.has_pending_transactions()
            driver.resume_feed()
            await client.flush_transactions(timeout=5)
            assert not client.has_pending_transactions()

    run(main())


def test_lost_connection_resolves_pending_appends_after_remount_without_duplicates() -> None:
    driver = MockDriver(seed=11)
    driver.set_max_delay(5)

    async def main() -> None:
        client, callbacks = client_with(driver, max_concurrent_transactions=10, long_wait_threshold_ms=60_000)
        async with client:
            contexts = [Ctx(b"%d" % i) for i in range(10)]
            for ctx in contexts:
                await client.submit(ctx)
            await driver.disconnect(reconnect_delay_ms=20)
            await client.flush_transactions(timeout=10)
        assert sorted(data_of(driver.cluster)) == sorted(b"%d" % i for i in range(10))
        assert callbacks.data(0) == data_of(driver.cluster)
        assert any(ctx.executions > 1 for ctx in contexts)  # Some requests were lost with the connection.

    run(main())


def test_data_checksum_mismatch_is_fetched_again_then_reported() -> None:
    cluster = MockCluster()
    driver = MockDriver(cluster=cluster)
    callbacks = RecordingCallbacks()

    async def main() -> None:
        # Another client appends: this one fetches the data (its own appends carry theirs, see below).
        writer, _ = client_with(MockDriver(cluster=cluster))
        client, _ = client_with(driver, callbacks)
        async with writer, client:
            driver.corrupt_next_fetch(4)  # Under the 5-attempt bound: recovered silently.
            await writer.submit(Ctx(b"one"))
            await client.wait_applied(0, 0, timeout=5)
            assert callbacks.errors == []
            driver.corrupt_next_fetch(5)  # One apply fails with DataChecksumError, the redelivery works.
            await writer.submit(Ctx(b"two"))
            await client.wait_applied(0, 1, timeout=5)
            assert [type(e) for _, _, e in callbacks.errors] == [DataChecksumError]
            assert callbacks.data(0) == [b"one", b"two"]

    run(main())


def test_own_appends_carry_their_data_without_a_fetch() -> None:
    cluster = MockCluster()
    driver = MockDriver(cluster=cluster)
    callbacks = RecordingCallbacks()

    async def main() -> None:
        writer, _ = client_with(MockDriver(cluster=cluster))
        client, _ = client_with(driver, callbacks)
        async with writer, client:
            driver.corrupt_next_fetch(5)  # Any fetch of this client would now fail its apply once.
            for i in range(5):
                await client.submit(Ctx(b"own%d" % i))
            await client.flush_transactions(timeout=5)
            assert callbacks.errors == []  # Nothing was fetched.
            await writer.submit(Ctx(b"theirs"))
            await client.wait_applied(0, 5, timeout=5)
            assert [type(e) for _, _, e in callbacks.errors] == [DataChecksumError]  # This one was.
        assert callbacks.data(0) == [b"own0", b"own1", b"own2", b"own3", b"own4", b"theirs"]

    run(main())


def test_blocking_data_fetch_on_the_event_loop_is_refused() -> None:
    driver = MockDriver()
    seen: list[Transaction] = []
    callbacks = RecordingCallbacks()
    callbacks.on_apply = seen.append

    async def main() -> None:
        client, _ = client_with(driver, callbacks)
        async with client:
            await client.submit(Ctx(b"x"))
            await client.flush_transactions(timeout=5)
            fresh = Transaction(0, 0, 0, seen[0].req_id, seen[0]._source)
            with pytest.raises(ClientError, match=r"await transaction\.fetch_transaction_data"):
                fresh.get_transaction_data()
            assert await fresh.fetch_transaction_data() == b"x"

    run(main())


def test_close_ends_contexts_in_flight_and_refuses_new_work() -> None:
    driver = MockDriver()

    async def main() -> None:
        client, _ = client_with(driver)
        await client.start()
        await wait_until(lambda: client._partitions[0].state is not None)
        driver.suspend_feed()
        ctx = Ctx(b"x")
        await client.submit(ctx)
        await client.close()
        assert ctx.events == ["exception:ClientClosedError"]
        assert not client.has_pending_transactions()
        with pytest.raises(ClientClosedError):
            await client.submit(Ctx(b"y"))
        await client.close()  # Idempotent.
        assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []

    run(main())


def test_set_partitions_without_auto_mount() -> None:
    driver = MockDriver(num_partitions=3)

    async def main() -> None:
        client, callbacks = client_with(driver, auto_mount=False)
        async with client:
            assert client.partitions == frozenset()
            with pytest.raises(ClientError, match="not mounted by this client"):
                await client.submit(Ctx(b"x", partition=1))
            await client.set_partitions({1, 2})
            assert client.partitions == {1, 2}
            await client.submit(Ctx(b"x", partition=1))
            await client.flush_transactions(timeout=5)
            assert callbacks.data(1) == [b"x"]
            driver.suspend_feed()
            pending = Ctx(b"y", partition=2)
            await client.submit(pending)
            await client.set_partitions({1})
            await wait_until(lambda: pending.finished.is_set())
            assert pending.events == ["exception:ClientError"]
            with pytest.raises(ClientError, match=r"outside 0..2"):
                await client.set_partitions({7})

    async def auto() -> None:
        client, _ = client_with(MockDriver())
        async with client:
            with pytest.raises(ClientError, match="autoMount"):
                await client.set_partitions({0})

    run(main())
    run(auto())


def test_mount_timeout_when_the_partition_never_becomes_ready() -> None:
    class NeverReady(MockDriver):
        async def mount(self, partition_id: int, client_high_water_mark: int) -> None:
            return None

    async def main() -> None:
        client, _ = client_with(NeverReady(), mount_timeout_ms=100)
        async with client:
            ctx = Ctx(b"x")
            with pytest.raises(ClientTimeoutError, match="not mounted within 100 ms"):
                await client.submit(ctx)

    run(main())


def test_async_with_requires_start_for_properties() -> None:
    client = AsyncWaltzClient(RecordingCallbacks(), ClientConfig(), driver=MockDriver())
    with pytest.raises(ClientError, match="not started"):
        _ = client.num_partitions


def test_unreachable_cluster_gives_a_clear_error() -> None:
    async def main() -> None:
        client = AsyncWaltzClient(RecordingCallbacks(), FAST, driver=UnreachableDriver())
        try:
            with pytest.raises(ClusterError, match="cannot connect to ZooKeeper"):
                await client.start()
        finally:
            await client.close()

    run(main())
