"""Every background task of the server has an owner that hears of its failure (waltz.runtime.TaskSet): the
server (it fails: /health unhealthy, run_server stops it), a client's connection (a bug in a request closes
it), a partition (it fails and is reopened), a store partition's supervisor and a store session (it ends, and
its bug is raised to the supervisor), the cluster membership (its readers hear). Each failure is one ERROR
line, written by the owner that decides what it ends."""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from types import SimpleNamespace
from typing import Any, cast

import pytest

from waltz.cluster.membership import ClusterWatcher
from waltz.protocol import client_server as cs
from waltz.protocol.records import ReqId
from waltz.server.config import ServerConfig
from waltz.server.feed_cache import FeedCache
from waltz.server.partition import Partition
from waltz.server.server import WaltzServer
from waltz.server.store import StoreConfig, StoreSession
from waltz.server.store.store_partition import StorePartition
from waltz.server.transaction_cache import TransactionCache
from waltz.testing import run_virtual
from waltz.testing.store import MemoryConnector, MemoryMetadataStore, MemoryNetwork, MemoryStorage

NAMES = ["s0:1", "s1:1", "s2:1"]


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def _one_error(caplog: pytest.LogCaptureFixture) -> str:
    """The one ERROR line logged (failing if there are more, or none)."""
    errors = _errors(caplog)
    assert len(errors) == 1, errors
    return errors[0]


async def _until(predicate: Any, timeout_s: float = 30) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110 - polls state the code under test changes
            await asyncio.sleep(0.005)


def _store_partition() -> StorePartition:
    network = MemoryNetwork(random.Random(1), min_delay_ms=0.1, max_delay_ms=2.0)
    for i, name in enumerate(NAMES):
        MemoryStorage(name, 1, network, fsync_ms=(0.1, 1.0), rng=random.Random(i))
    return StorePartition(
        0,
        1,
        NAMES,
        connector=MemoryConnector(network),
        metadata_store=MemoryMetadataStore(),
        rng=random.Random(1),
        config=StoreConfig(),
    )


async def _broken_supervisor() -> None:
    raise RuntimeError("injected supervisor bug")


# -- the store session and the store partition --------------------------------------------------------------


def test_a_bug_in_a_store_session_task_ends_the_session_and_is_logged_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = StoreSession._open_then_write
    broken = [True]

    async def open_then_write(self: StoreSession) -> None:
        if broken.pop() if broken else False:
            raise RuntimeError("injected writer bug")
        await original(self)

    monkeypatch.setattr(StoreSession, "_open_then_write", open_then_write)

    async def main() -> None:
        async with _store_partition() as partition:
            await _until(lambda: bool(partition.internal_errors))
            # The session's owner heard the bug (run() raised it), and the next session opens.
            assert [str(e) for e in partition.internal_errors] == ["injected writer bug"]
            await partition.wait_open()
            assert partition.failure is None

    with caplog.at_level(logging.INFO):
        run_virtual(main())
    assert "store session 0 failed" in _one_error(caplog)


@pytest.mark.parametrize("owner", [True, False])
def test_a_failed_store_supervisor_reaches_its_owner_and_is_logged_once(
    caplog: pytest.LogCaptureFixture, owner: bool
) -> None:
    # With an owner (the server's partition) the owner logs it, as it decides what the failure ends; without
    # one the store partition says it itself. Never both.
    heard: list[BaseException] = []

    async def main() -> None:
        partition = _store_partition()
        if owner:
            partition.on_failure = heard.append
        partition._supervise = _broken_supervisor  # type: ignore[method-assign]
        async with partition:
            await _until(lambda: partition.failure is not None)
            assert not partition.is_healthy

    with caplog.at_level(logging.INFO):
        run_virtual(main())
    if owner:
        assert [str(e) for e in heard] == ["injected supervisor bug"]
        assert _errors(caplog) == []
    else:
        assert "store-partition-0 failed" in _one_error(caplog)


# -- the server's partition --------------------------------------------------------------------------------


def test_a_failed_store_supervisor_fails_the_server_partition_with_one_error_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    heard: list[Partition] = []

    async def main() -> None:
        store = _store_partition()
        store._supervise = _broken_supervisor  # type: ignore[method-assign]
        part = Partition(
            0, store, feed_cache=FeedCache(1 << 20, 1), transaction_cache=TransactionCache(1 << 20)
        )
        part.on_failure = heard.append
        await part.start()
        try:
            await _until(lambda: bool(heard))
            assert heard == [part]
            assert part.problem is not None
            assert "injected supervisor bug" in part.problem
        finally:
            await part.close()

    with caplog.at_level(logging.INFO):
        run_virtual(main())
    assert "partition 0: the store failed" in _one_error(caplog)


# -- the server ----------------------------------------------------------------------------------------------


class _Peer:
    client_id = 9

    def __init__(self) -> None:
        self.sent: list[cs.Message] = []
        self.mounts: dict[int, ReqId | None] = {}
        self.slots = asyncio.Semaphore(8)
        self.closed = asyncio.Event()

    def send(self, msg: cs.Message) -> None:
        self.sent.append(msg)

    async def aclose(self) -> None:
        self.closed.set()


def _server() -> WaltzServer:
    keys = {"zookeeper.connectString": "z:1", "cluster.root": "/c", "server.port": 0}
    # Never started: no ZooKeeper, no listener; health reads only the client's connected flag.
    return WaltzServer(
        ServerConfig.from_mapping(keys), cast(Any, SimpleNamespace(connected=True)), uuid.uuid4(), 4
    )


def test_a_failed_task_of_the_server_fails_it_and_health_says_so(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        server = _server()
        assert server.health()[0]

        async def broken() -> None:
            raise RuntimeError("injected reopen bug")

        server._spawn(broken(), "reopen-3")
        async with asyncio.timeout(5):
            failure = await server.wait_failed()
        assert str(failure) == "injected reopen bug"
        healthy, detail = server.health()
        assert not healthy
        assert detail["problems"] == ["server failed: RuntimeError('injected reopen bug')"]
        await server._tasks.aclose()

    with caplog.at_level(logging.INFO):
        asyncio.run(main())
    assert "task reopen-3 failed; stopping" in _one_error(caplog)


def test_a_bug_in_a_read_request_closes_that_connection_not_the_server(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A high-water-mark request that waits for its partition runs in a task of its own; a bug in it is the
    # client's request's, as for every other request: its connection closes (the client asks again), and
    # the server goes on serving the others.
    async def main() -> None:
        server = _server()
        server.partitions[3] = cast(Any, SimpleNamespace(generation=1, is_serving=False))

        async def broken(*_args: object) -> None:
            raise RuntimeError("injected read bug")

        server._high_water_mark = broken  # type: ignore[method-assign,assignment]
        peer = _Peer()
        await server._dispatch(cast(Any, peer), cs.HighWaterMarkRequest(ReqId.of(7, 1, 3, 1)))
        async with asyncio.timeout(5):
            await peer.closed.wait()
        assert server.failure is None
        del server.partitions[3]  # a stand-in: health would ask it for its store
        assert server.health()[0]
        await server._tasks.aclose()

    with caplog.at_level(logging.INFO):
        asyncio.run(main())
    assert "closing the connection of client 9" in _one_error(caplog)


# -- the cluster membership --------------------------------------------------------------------------------


class _Kazoo:
    def add_listener(self, _listener: object) -> None:
        pass

    def remove_listener(self, _listener: object) -> None:
        pass


def test_a_failed_membership_refresh_reaches_its_readers_who_report_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        watcher = ClusterWatcher(cast(Any, _Kazoo()), "/c")

        async def broken() -> None:
            raise RuntimeError("injected refresh bug")

        watcher._refresh = broken  # type: ignore[method-assign]
        await watcher.start()
        try:
            async with asyncio.timeout(5):
                with pytest.raises(RuntimeError, match="injected refresh bug"):
                    await anext(aiter(watcher.updates()))
        finally:
            await watcher.close()

    with caplog.at_level(logging.INFO):
        asyncio.run(main())
    # The readers (the server's followers, the client's driver) say it, once: not the watcher as well.
    assert _errors(caplog) == []
