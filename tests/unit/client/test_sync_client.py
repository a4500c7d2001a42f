"""WaltzClient: the thread-safe facade (private loop thread, blocking calls, context manager)."""

from __future__ import annotations

import threading

import pytest

from waltz import ClientConfig, WaltzClient
from waltz.errors import ClientClosedError, ClientError, ClientTimeoutError, ClusterError
from waltz.testing import MockDriver

from .helpers import FAST, Ctx, RecordingCallbacks, UnreachableDriver


def test_many_threads_submit_concurrently() -> None:
    driver = MockDriver(num_partitions=4)
    callbacks = RecordingCallbacks()
    with WaltzClient(callbacks, FAST.replace(max_concurrent_transactions=3), driver=driver) as client:
        assert (client.num_partitions, client.client_id, client.cluster_name) == (4, 0, "mock-cluster")
        assert client.partitions == {0, 1, 2, 3}
        contexts = [Ctx(b"%d" % i, partition=i % 4) for i in range(80)]

        def work(chunk: list[Ctx]) -> None:
            for ctx in chunk:
                client.submit(ctx)

        threads = [threading.Thread(target=work, args=(contexts[i::8],)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        client.flush_transactions(timeout=10)
        assert not client.has_pending_transactions()
        assert sum(client.high_water_mark(p) + 1 for p in range(4)) == 80
    assert all(ctx.events == ["completion:True", "application"] for ctx in contexts)
    applied = sorted(d for p in range(4) for d in callbacks.data(p))
    assert applied == sorted(b"%d" % i for i in range(80))


def test_submit_blocks_under_back_pressure_and_times_out() -> None:
    driver = MockDriver()
    config = FAST.replace(max_concurrent_transactions=1, submit_timeout_ms=200)
    with WaltzClient(RecordingCallbacks(), config, driver=driver) as client:
        client.submit(Ctx(b"a"))
        client.flush_transactions(timeout=5)
        driver.suspend_feed()
        client.submit(Ctx(b"b"))
        with pytest.raises(ClientTimeoutError, match="submit timed out after 200 ms"):
            client.submit(Ctx(b"c"))
        driver.resume_feed()
        client.submit(Ctx(b"d"))
        client.flush_transactions(timeout=5)
        assert [r.data for r in driver.cluster.records(0)] == [b"a", b"b", b"d"]


def test_closed_client_refuses_calls_and_close_is_idempotent() -> None:
    client = WaltzClient(RecordingCallbacks(), FAST, driver=MockDriver())
    client.close()
    client.close()
    with pytest.raises(ClientClosedError):
        client.submit(Ctx(b"x"))


def test_set_partitions_through_the_facade() -> None:
    config = ClientConfig(auto_mount=False, long_wait_threshold_ms=50)
    callbacks = RecordingCallbacks()
    with WaltzClient(callbacks, config, driver=MockDriver(num_partitions=2)) as client:
        assert client.partitions == frozenset()
        client.set_partitions({0})
        client.submit(Ctx(b"x"))
        client.flush_transactions(timeout=5)
        assert callbacks.data(0) == [b"x"]
        assert client.config.auto_mount is False


def test_constructor_failure_cleans_up_its_thread() -> None:
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ClusterError, match="cannot connect to ZooKeeper"):
        WaltzClient(RecordingCallbacks(), FAST, driver=UnreachableDriver())
    leftover = {t.name for t in threading.enumerate()} - before
    assert "waltz-client-loop" not in leftover


def test_blocking_call_from_an_event_loop_of_its_own_is_refused() -> None:
    client = WaltzClient(RecordingCallbacks(), FAST, driver=MockDriver())
    try:
        import asyncio

        async def inside() -> None:
            client._call(client._client.flush_transactions())

        fut = asyncio.run_coroutine_threadsafe(inside(), client._loop)
        with pytest.raises(ClientError, match="own event loop"):
            fut.result(5)
    finally:
        client.close()


class ThreadRecordingCtx(Ctx):
    def execute(self, builder):  # type: ignore[no-untyped-def]
        self.thread = threading.current_thread().name
        return super().execute(builder)


@pytest.mark.parametrize("mode", ["threads", "inline"])
def test_submit_executes_on_the_calling_thread_without_waiting_for_the_loop(mode: str) -> None:
    driver = MockDriver()
    callbacks = RecordingCallbacks() if mode == "threads" else _NoFetch()
    with WaltzClient(callbacks, FAST.replace(callback_mode=mode), driver=driver) as client:
        ok = ThreadRecordingCtx(b"ok")
        gave_up = ThreadRecordingCtx(b"no", give_up=True)
        boom = ThreadRecordingCtx(b"x", raise_in_execute=ValueError("bad input"))
        threading.Event().wait(0.1)  # Let the partition become ready: the fast path needs a mount.
        client.submit(ok)
        client.submit(gave_up)
        with pytest.raises(ValueError, match="bad input"):
            client.submit(boom)
        client.flush_transactions(timeout=5)
        assert ok.thread == gave_up.thread == boom.thread == threading.current_thread().name
        assert ok.events == ["completion:True", "application"]
        assert gave_up.events == ["completion:False"]
        assert boom.events == ["exception:ValueError"]
        assert not client.has_pending_transactions()
        assert client.high_water_mark(0) == 0


class _NoFetch(RecordingCallbacks):
    """Inline mode on WaltzClient: apply_transaction runs on the client's loop, so no blocking fetch."""

    def apply_transaction(self, transaction):  # type: ignore[no-untyped-def]
        self._deliver(transaction)
        self._record(transaction, b"")


def test_submit_many_keeps_the_order_and_waits_for_room() -> None:
    driver = MockDriver()
    callbacks = RecordingCallbacks()
    config = FAST.replace(max_concurrent_transactions=7)  # Far fewer slots than contexts: it must wait.
    with WaltzClient(callbacks, config, driver=driver) as client:
        threading.Event().wait(0.1)  # The mock mounts at once; give it that moment.
        contexts = [Ctx(b"%d" % i) for i in range(300)]
        client.submit_many(contexts)
        client.flush_transactions(timeout=10)
    assert callbacks.data(0) == [b"%d" % i for i in range(300)]
    assert all(ctx.events == ["completion:True", "application"] for ctx in contexts)


def test_submit_many_raises_the_first_failing_execute_and_stops_there() -> None:
    driver = MockDriver()
    with WaltzClient(RecordingCallbacks(), FAST, driver=driver) as client:
        threading.Event().wait(0.1)
        contexts = [Ctx(b"a"), Ctx(b"b", raise_in_execute=ValueError("bad row")), Ctx(b"c")]
        with pytest.raises(ValueError, match="bad row"):
            client.submit_many(contexts)
        client.flush_transactions(timeout=5)
    assert contexts[0].events == ["completion:True", "application"]
    assert contexts[1].events == ["exception:ValueError"]
    assert contexts[2].executions == 0


def test_submit_many_refused_before_execute_keeps_those_before_and_reports_it() -> None:
    # partition_id() names a partition outside the cluster: the first attempt raises before it takes a slot.
    # The contexts before it are sent, in order; it ends through on_exception; those after it are not taken.
    driver = MockDriver()
    with WaltzClient(RecordingCallbacks(), FAST, driver=driver) as client:
        threading.Event().wait(0.1)
        contexts = [Ctx(b"a"), Ctx(b"b"), Ctx(b"x", partition=5), Ctx(b"c")]
        with pytest.raises(ClientError, match=r"outside 0\.\.0"):
            client.submit_many(contexts)
        client.flush_transactions(timeout=5)
    assert contexts[0].events == contexts[1].events == ["completion:True", "application"]
    assert contexts[2].events == ["exception:ClientError"]
    assert contexts[2].executions == contexts[3].executions == 0
    assert [r.data for r in driver.cluster.records(0)] == [b"a", b"b"]


@pytest.mark.parametrize("mode", ["threads", "inline"])
def test_submit_waits_for_room_on_the_calling_thread_and_executes_there(mode: str) -> None:
    # A loaded sync client's common case: no free slot. The thread waits for one itself (no coroutine, task or
    # future on the loop per submit) and, once a slot is freed, executes on its own thread as with a free one.
    driver = MockDriver()
    callbacks = RecordingCallbacks() if mode == "threads" else _NoFetch()
    config = FAST.replace(callback_mode=mode, max_concurrent_transactions=1, submit_timeout_ms=10_000)
    with WaltzClient(callbacks, config, driver=driver) as client:
        threading.Event().wait(0.1)  # Let the partition become ready: the fast path needs a mount.
        driver.suspend_feed()
        first = ThreadRecordingCtx(b"a")
        client.submit(first)  # Takes the only slot; its commit waits for the feed.
        second = ThreadRecordingCtx(b"b")
        submitted = threading.Event()

        def submit_second() -> None:
            client.submit(second)
            submitted.set()

        thread = threading.Thread(target=submit_second, name="app-waiter")
        thread.start()
        assert not submitted.wait(0.2)  # Blocked: no room.
        driver.resume_feed()
        assert submitted.wait(5)
        thread.join(5)
        client.flush_transactions(timeout=5)
    assert second.thread == "app-waiter"
    assert first.events == second.events == ["completion:True", "application"]
    assert [r.data for r in driver.cluster.records(0)] == [b"a", b"b"]


def test_submit_waiting_for_room_times_out_through_on_exception() -> None:
    driver = MockDriver()
    config = FAST.replace(max_concurrent_transactions=1, submit_timeout_ms=200)
    with WaltzClient(RecordingCallbacks(), config, driver=driver) as client:
        threading.Event().wait(0.1)
        driver.suspend_feed()
        client.submit(Ctx(b"a"))
        late = Ctx(b"b")
        with pytest.raises(ClientTimeoutError, match="submit timed out after 200 ms"):
            client.submit(late)
        driver.resume_feed()
        client.flush_transactions(timeout=5)
    assert late.events == ["exception:ClientTimeoutError"]
    assert late.executions == 0


def test_close_wakes_a_thread_waiting_for_room() -> None:
    driver = MockDriver()
    config = FAST.replace(max_concurrent_transactions=1, submit_timeout_ms=30_000)
    client = WaltzClient(RecordingCallbacks(), config, driver=driver)
    threading.Event().wait(0.1)
    driver.suspend_feed()
    client.submit(Ctx(b"a"))
    errors: list[BaseException] = []

    def submit_blocked() -> None:
        try:
            client.submit(Ctx(b"b"))
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=submit_blocked)
    thread.start()
    threading.Event().wait(0.2)
    client.close()
    thread.join(5)
    assert not thread.is_alive()  # Not 30 s (client.submitTimeout): close woke it.
    assert len(errors) == 1
    assert isinstance(errors[0], ClientClosedError), errors


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["threads", "inline"])
def test_blocking_calls_from_a_callback_of_the_same_client_are_refused_not_hung(mode: str) -> None:
    # The feed waits for apply_transaction to return and close waits for the callback threads to end: each
    # of these calls, made from the callback, waited for itself (close for good, the others until a timeout).
    callbacks = RecordingCallbacks() if mode == "threads" else _NoFetch()
    outcomes: list[str] = []
    done = threading.Event()
    with WaltzClient(callbacks, FAST.replace(callback_mode=mode), driver=MockDriver()) as client:
        calls = {
            "wait_applied": lambda: client.wait_applied(0, 0, timeout=1),
            "flush_transactions": lambda: client.flush_transactions(timeout=1),
            "close": client.close,
        }

        def on_apply(_transaction: object) -> None:
            callbacks.on_apply = None
            for name, call in calls.items():
                try:
                    call()
                    outcomes.append(f"{name}: returned")
                except ClientError as e:  # ClientTimeoutError is one too: told apart by its message
                    outcomes.append(f"{name}: {type(e).__name__}: {e}")
            done.set()

        callbacks.on_apply = on_apply
        client.submit(Ctx(b"x"))
        assert done.wait(10), f"a call from the callback hung (so far: {outcomes})"
        client.flush_transactions(timeout=5)  # The client still works: nothing was closed.
        assert len(callbacks.data(0)) == 1  # Applied once (_NoFetch records no data).
    expected = "on one of the client's own callback threads" if mode == "threads" else "own event loop"
    assert [o.split(":")[0] for o in outcomes] == list(calls)
    for outcome in outcomes:
        assert ": ClientError: " in outcome, outcome
        assert expected in outcome, outcome
