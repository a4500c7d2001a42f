"""Where the default configuration runs application code (``client.callbackMode: auto``): coroutine functions
on the client's event loop, plain functions on the callback threads, decided per callback, in both client
classes; a blocking plain callback never stalls the client's networking."""

from __future__ import annotations

import asyncio
import threading

import pytest

from waltz import (
    AsyncWaltzClient,
    ClientCallbacks,
    ClientConfig,
    Transaction,
    TransactionBuilder,
    TransactionContext,
    WaltzClient,
)
from waltz.client.dispatch import ALL_ON_LOOP, Dispatch, runs_on_loop
from waltz.errors import ConfigError
from waltz.testing import MockDriver

from .helpers import FAST


def where() -> str:
    """``loop`` on the thread running an event loop (the client's), else the thread's name."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return threading.current_thread().name
    return "loop"


class Seen:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[str, str]] = []

    def note(self, what: str) -> None:
        with self.lock:
            self.calls.append((what, where()))

    def places(self, what: str) -> set[str]:
        with self.lock:
            return {
                "thread" if place.startswith("waltz-callback") else place
                for w, place in self.calls
                if w == what
            }

    def order(self) -> list[str]:
        with self.lock:
            return [w for w, _ in self.calls]


class AsyncCallbacks(ClientCallbacks):
    def __init__(self, seen: Seen) -> None:
        self.seen = seen
        self.data: list[bytes] = []

    def client_high_water_mark(self, partition_id: int) -> int:
        return -1

    async def apply_transaction(self, transaction: Transaction) -> None:
        self.seen.note("apply")
        self.data.append(await transaction.fetch_transaction_data())

    def uncaught_exception(self, partition_id: int, transaction_id: int, exception: BaseException) -> None:
        raise AssertionError(f"apply failed: {exception!r}")


class PlainCallbacks(AsyncCallbacks):
    def apply_transaction(self, transaction: Transaction) -> None:  # type: ignore[override]
        self.seen.note("apply")
        self.data.append(transaction.get_transaction_data())  # Blocking: fine on a callback thread.


class AsyncCtx(TransactionContext):
    def __init__(self, seen: Seen, data: bytes = b"x") -> None:
        super().__init__()
        self.seen = seen
        self.data = data

    def partition_id(self, num_partitions: int) -> int:
        self.seen.note("partition_id")
        return 0

    async def execute(self, builder: TransactionBuilder) -> bool:
        self.seen.note("execute")
        builder.set_transaction_data(self.data)
        return True

    async def on_completion(self, result: bool) -> None:
        self.seen.note("completion")

    async def on_application(self) -> None:
        self.seen.note("application")


class PlainCtx(TransactionContext):
    def __init__(self, seen: Seen, data: bytes = b"x") -> None:
        super().__init__()
        self.seen = seen
        self.data = data

    def partition_id(self, num_partitions: int) -> int:
        self.seen.note("partition_id")
        return 0

    def execute(self, builder: TransactionBuilder) -> bool:
        self.seen.note("execute")
        builder.set_transaction_data(self.data)
        return True

    def on_completion(self, result: bool) -> None:
        self.seen.note("completion")

    def on_application(self) -> None:
        self.seen.note("application")


class MixedCtx(PlainCtx):
    """A coroutine on_completion, a plain on_application: each runs where its kind does, in order."""

    async def on_completion(self, result: bool) -> None:  # type: ignore[override]
        self.seen.note("completion")


REQUIRED = {"zookeeper.connectString": "zk:2181", "zookeeper.sessionTimeout": 30000, "cluster.root": "/w"}


def test_the_defaults_are_auto_and_64_in_flight() -> None:
    assert ClientConfig().callback_mode == "auto"
    assert ClientConfig().max_concurrent_transactions == 64
    parsed = ClientConfig.from_dict(REQUIRED)
    assert (parsed.callback_mode, parsed.max_concurrent_transactions) == ("auto", 64)
    assert ClientConfig.from_dict({**REQUIRED, "client.callbackMode": "threads"}).callback_mode == "threads"
    with pytest.raises(ConfigError, match=r"client\.callbackMode"):
        ClientConfig.from_dict({**REQUIRED, "client.callbackMode": "fast"})


def test_runs_on_loop_per_function() -> None:
    seen = Seen()
    assert runs_on_loop(AsyncCtx(seen).execute)
    assert not runs_on_loop(PlainCtx(seen).execute)
    # Hooks a context does not override are no-ops: no thread hop for them.
    assert runs_on_loop(TransactionContext.on_application)
    assert runs_on_loop(AsyncCtx(seen).on_exception)
    assert not runs_on_loop(PlainCallbacks(seen).apply_transaction)
    assert runs_on_loop(AsyncCallbacks(seen).apply_transaction)


def test_where_a_context_runs_is_decided_once_per_class_unless_the_context_holds_its_own() -> None:
    seen = Seen()
    dispatch = Dispatch("auto")
    assert dispatch.where(AsyncCtx(seen)) == (True, True, True)
    assert dispatch.where(PlainCtx(seen)) == (False, False, False)
    assert dispatch.where(MixedCtx(seen)) == (False, True, False)
    assert dispatch.where(AsyncCtx(seen)) is dispatch.where(AsyncCtx(seen))  # Kept for the class.
    # A hook set on the context itself (not its class) decides for that context alone.
    own = PlainCtx(seen)

    async def on_application() -> None:
        seen.note("application")

    own.on_application = on_application  # type: ignore[method-assign]
    assert dispatch.where(own) == (False, False, True)
    assert dispatch.where(PlainCtx(seen)) == (False, False, False)
    assert Dispatch("inline").where(PlainCtx(seen)) is ALL_ON_LOOP


def test_a_coroutine_hook_set_on_a_plain_context_is_awaited_on_the_loop() -> None:
    async def main() -> None:
        seen = Seen()
        async with AsyncWaltzClient(PlainCallbacks(seen), FAST, driver=MockDriver()) as client:
            plain = PlainCtx(seen, b"plain")
            own = PlainCtx(seen, b"own")

            async def on_completion(result: bool) -> None:
                seen.note("own completion")

            own.on_completion = on_completion  # type: ignore[method-assign]
            await client.submit(plain)
            await client.submit(own)
            await client.flush_transactions(timeout=5)
        assert seen.places("own completion") == {"loop"}
        assert seen.places("completion") == {"thread"}

    asyncio.run(main())


def test_the_client_keeps_its_state_in_slots() -> None:
    # Every attribute of the client is a slot: CPython (3.11) stops specializing attribute and method
    # lookups on an instance whose dict holds 30 keys or more, which made every self._x on the hot path a
    # dict lookup (about 3% more instructions per append).
    async def main() -> None:
        seen = Seen()
        client = AsyncWaltzClient(AsyncCallbacks(seen), FAST, driver=MockDriver())
        async with client:
            await client.submit(AsyncCtx(seen))
            await client.flush_transactions(timeout=5)
            assert vars(client) == {}

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["auto", "threads"])
def test_async_client_runs_coroutines_on_the_loop_and_functions_on_threads(mode: str) -> None:
    async def main() -> None:
        for callbacks_type, ctx_type, expect in (
            (AsyncCallbacks, AsyncCtx, "loop"),
            (PlainCallbacks, PlainCtx, "thread"),
        ):
            seen = Seen()
            callbacks = callbacks_type(seen)
            config = FAST.replace(callback_mode=mode)
            async with AsyncWaltzClient(callbacks, config, driver=MockDriver()) as client:
                for i in range(10):
                    await client.submit(ctx_type(seen, bytes([i])))
                await client.flush_transactions(timeout=5)
            assert callbacks.data == [bytes([i]) for i in range(10)]
            for what in ("partition_id", "execute", "completion", "apply", "application"):
                assert seen.places(what) == {expect}, (callbacks_type, what, seen.calls)

    asyncio.run(main())


def test_mixed_hooks_each_run_where_their_kind_does_in_order() -> None:
    async def main() -> None:
        seen = Seen()
        async with AsyncWaltzClient(AsyncCallbacks(seen), FAST, driver=MockDriver()) as client:
            for i in range(20):
                await client.submit(MixedCtx(seen, bytes([i])))
            await client.flush_transactions(timeout=5)
        assert seen.places("completion") == {"loop"}
        assert seen.places("application") == {"thread"}
        hooks = [w for w in seen.order() if w in ("completion", "application")]
        assert hooks.count("completion") == hooks.count("application") == 20
        # Every context hears on_completion before its on_application: never more applications than
        # completions at any point.
        done = 0
        for hook in hooks:
            done += 1 if hook == "completion" else -1
            assert done >= 0, hooks

    asyncio.run(main())


def test_inline_mode_runs_plain_functions_on_the_loop() -> None:
    async def main() -> None:
        seen = Seen()
        callbacks = AsyncCallbacks(seen)
        async with AsyncWaltzClient(
            callbacks, FAST.replace(callback_mode="inline"), driver=MockDriver()
        ) as client:
            await client.submit(PlainCtx(seen))
            await client.flush_transactions(timeout=5)
        assert {place for _, place in seen.calls} == {"loop"}

    asyncio.run(main())


def test_sync_client_runs_coroutines_on_its_loop_and_functions_on_threads() -> None:
    for callbacks_type, ctx_type in ((AsyncCallbacks, AsyncCtx), (PlainCallbacks, PlainCtx)):
        seen = Seen()
        callbacks = callbacks_type(seen)
        with WaltzClient(callbacks, FAST, driver=MockDriver()) as client:
            for i in range(10):
                client.submit(ctx_type(seen, bytes([i])))
            client.flush_transactions(timeout=5)
        assert callbacks.data == [bytes([i]) for i in range(10)]
        for what in ("completion", "apply", "application"):
            expect = "loop" if ctx_type is AsyncCtx else "thread"
            assert seen.places(what) == {expect}, (what, seen.calls)
        # WaltzClient.submit runs a plain execute on the calling thread (a callback thread before the
        # partition is mounted); a coroutine one on the loop.
        if ctx_type is AsyncCtx:
            assert seen.places("execute") == {"loop"}
        else:
            assert seen.places("execute") <= {"MainThread", "thread"}
            assert "MainThread" in seen.places("execute")


def test_a_blocking_plain_apply_never_stalls_the_network() -> None:
    """Default config: a plain apply_transaction that blocks holds up only its partition's applies; the loop
    keeps resolving commits (on_completion of later appends to the same partition)."""

    release = threading.Event()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        started = asyncio.Event()
        all_completed = asyncio.Event()
        completions = 0

        class Blocking(AsyncCallbacks):
            def apply_transaction(self, transaction: Transaction) -> None:  # type: ignore[override]
                self.seen.note("apply")
                loop.call_soon_threadsafe(started.set)
                assert release.wait(10)

        class Counted(AsyncCtx):
            async def on_completion(self, result: bool) -> None:
                nonlocal completions
                await super().on_completion(result)
                completions += 1
                if completions == 6:
                    all_completed.set()

        seen = Seen()
        async with AsyncWaltzClient(Blocking(seen), FAST, driver=MockDriver()) as client:
            await client.submit(Counted(seen))
            await asyncio.wait_for(started.wait(), 5)
            # The first apply blocks its callback thread now; later appends still commit.
            for i in range(5):
                await client.submit(Counted(seen, bytes([i])))
            await asyncio.wait_for(all_completed.wait(), 5)
            assert seen.order().count("apply") == 1
            release.set()
            await client.flush_transactions(timeout=5)
            assert seen.order().count("application") == 6

    try:
        asyncio.run(main())
    finally:
        release.set()
