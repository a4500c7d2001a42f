"""Background tasks whose failure once went unheard (issue 14): each now has an owner that learns of it, and
health tells the truth.

* a storage node's partition worker that hits a bug, or ends: the partition fails, every request to it is
  answered (with a failure) instead of waiting forever, and ``/health`` is 503 naming it;
* a server's ZooKeeper followers: a failure stops following, shows on ``/health`` and ends ``run_server``;
* a server partition's append task: the partition reports it, and the server reopens it;
* a storage partition fail-stopped by a failed fsync: ``/health`` is 503 until it heals;
* a storage node's scrub that hits a bug: ``/health`` is 503 naming it (it was once only a log line).

These run the component in-process on loopback (a real storage node, a real server over real ZooKeeper) and
inject the bug by replacing one method, which no request could otherwise reach.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient

from tests.integration.client_cluster import wait_until
from tests.integration.server_process import TEST_SERVER_CONFIG
from tests.integration.storage_process import DEFAULT_KEY
from waltz.cluster import store_metadata as sm
from waltz.errors import StorageError, WaltzError
from waltz.local.probe import http_get
from waltz.protocol.records import Record, ReqId
from waltz.server.config import ServerConfig
from waltz.server.partition import Partition
from waltz.server.server import WaltzServer
from waltz.server.startup import run_server
from waltz.server.storage_client import AdminClient, StorageClient
from waltz.storage import scrub
from waltz.storage.config import StorageConfig
from waltz.storage.node import StorageNode
from waltz.storage.worker import HEAL_INTERVAL_S
from waltz.testing.faultfs import FaultyFileSystem

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

NUM_PARTITIONS = 2


def _health(port: int) -> tuple[int, dict[str, Any]]:
    status, body = http_get(port, "/health")
    value: dict[str, Any] = json.loads(body)
    return status, value


async def _storage_node(
    tmp_path: Path, fs: FaultyFileSystem | None = None, **settings: object
) -> StorageNode:
    config = StorageConfig.from_mapping(
        {
            "storage.port": 0,
            "storage.admin.port": 0,
            "storage.http.port": _free_port(),
            "storage.directory": str(tmp_path / "storage"),
            "storage.cluster.key": str(DEFAULT_KEY),
            "storage.cluster.numPartitions": NUM_PARTITIONS,
            **settings,
        }
    )
    if fs is None:
        return await StorageNode.start(config, DEFAULT_KEY, NUM_PARTITIONS)
    return await StorageNode.start(config, DEFAULT_KEY, NUM_PARTITIONS, fs=fs)


def _free_port() -> int:
    from tests.integration.server_process import free_port

    return free_port()


class _WorkerDeath(BaseException):
    """Escapes the worker's ``except Exception``: the task itself ends."""


def _record(i: int) -> Record:
    return Record.build(i, ReqId(1 << 32, i), 0, b"x" * 16)


@pytest.mark.parametrize("how", ["bug in a request", "worker ends"])
def test_a_failed_storage_worker_answers_everything_and_health_names_it(tmp_path: Path, how: str) -> None:
    async def main() -> None:
        node = await _storage_node(tmp_path)
        try:
            admin = await AdminClient.connect("127.0.0.1", node.admin_port, DEFAULT_KEY, NUM_PARTITIONS)
            client = await StorageClient.connect("127.0.0.1", node.port, DEFAULT_KEY, NUM_PARTITIONS)
            async with admin, client:
                await admin.set_assigned([0, 1], True)
                await client.last_session_info(1, 0)
                await client.append(1, 0, [_record(0)])
                assert (await asyncio.to_thread(_health, node.http_port))[0] == 200
                victim = node.partitions[0]
                # A bug in a request is an Exception; a BaseException that is not one ends the worker task.
                error = (
                    RuntimeError("injected bug") if how == "bug in a request" else _WorkerDeath("injected")
                )

                def bug(_item: Any) -> Any:
                    raise error

                victim._process = bug  # type: ignore[method-assign]
                # Every request to the failed partition is answered, with a failure, within the RPC timeout.
                for _ in range(3):
                    with pytest.raises(StorageError, match="partition 0 failed"):
                        await asyncio.wait_for(client.max_transaction_id(1, 0), 10)
                # The other partition is untouched.
                await client.last_session_info(1, 1)
                assert await client.max_transaction_id(1, 1) == -1
                status, body = await asyncio.to_thread(_health, node.http_port)
                assert status == 503
                assert body["storage"] == "degraded"
                assert list(body["partitions"]) == ["0"]
                assert "injected" in body["partitions"]["0"]
        finally:
            await node.aclose()

    asyncio.run(main())


async def _server(tmp_path: Path, zk: KazooClient, zk_connect: str) -> tuple[ServerConfig, str]:
    root = "/failures-heard"
    await asyncio.to_thread(sm.create_cluster, zk, root, "heard", NUM_PARTITIONS, cluster_key=DEFAULT_KEY)
    config = ServerConfig.from_mapping(
        {
            **TEST_SERVER_CONFIG,
            "zookeeper.connectString": zk_connect,
            "cluster.root": root,
            "server.port": 0,
            "server.http.port": _free_port(),
        }
    )
    return config, root


async def _add_storage(tmp_path: Path, zk: KazooClient, root: str) -> StorageNode:
    node = await _storage_node(tmp_path)
    admin = await AdminClient.connect("127.0.0.1", node.admin_port, DEFAULT_KEY, NUM_PARTITIONS)
    async with admin:
        await admin.set_assigned(list(range(NUM_PARTITIONS)), True)
    address = f"127.0.0.1:{node.port}"
    await asyncio.to_thread(sm.add_storage_node, zk, root, address, 0, node.admin_port)
    await asyncio.to_thread(sm.assign_partitions, zk, root, address, list(range(NUM_PARTITIONS)))
    return node


def test_a_failed_zookeeper_follower_stops_the_server_and_health_says_why(
    tmp_path: Path, zk: KazooClient, zk_connect_string: str
) -> None:
    async def broken(_assignment: dict[int, int]) -> None:
        raise RuntimeError("injected follower bug")

    async def main() -> None:
        config, _root = await _server(tmp_path, zk, zk_connect_string)
        # The server learns of the failure and /health says so.
        server = await WaltzServer.start(config)
        try:
            server._reconcile = broken  # type: ignore[method-assign]
            server._replicas_changed.set()  # as a change of the replica sets in ZooKeeper would
            failure = await asyncio.wait_for(server.wait_failed(), 15)
            assert "injected follower bug" in repr(failure)
            status, body = await asyncio.to_thread(_health, config.http_port)
            assert status == 503, body
            assert any("injected follower bug" in p for p in body["problems"]), body
        finally:
            await server.aclose()
        # run_server does not go on serving with a server that stopped following its ownership.
        started: list[WaltzServer] = []
        runner = asyncio.create_task(run_server(config, ready=started.append))
        await wait_until(lambda: bool(started), 30, "the server to start")
        started[0]._reconcile = broken  # type: ignore[method-assign]
        started[0]._replicas_changed.set()
        with pytest.raises(WaltzError, match="injected follower bug"):
            await asyncio.wait_for(runner, 30)

    asyncio.run(main())


def test_a_failed_append_task_is_reported_and_the_partition_reopened(
    tmp_path: Path, zk: KazooClient, zk_connect_string: str
) -> None:
    async def main() -> None:
        config, root = await _server(tmp_path, zk, zk_connect_string)
        storage = await _add_storage(tmp_path, zk, root)
        server = await WaltzServer.start(config)
        try:
            assert server.member is not None
            await server.member.wait_for_partitions(lambda p: len(p) == NUM_PARTITIONS, 30)
            await wait_until(lambda: len(server.partitions) == NUM_PARTITIONS, 30, "partitions opened")
            victim = server.partitions[0]
            seen: list[str | None] = []

            def spy(part: Partition) -> None:
                seen.append(part.problem)
                server._partition_failed(part)

            victim.on_failure = spy
            # The append loop dies of a bug: an item it cannot handle.
            victim._queue.put_nowait(None)  # type: ignore[arg-type]
            await wait_until(lambda: bool(seen), 10, "the failure to be reported")
            assert seen[0] is not None
            assert "append task failed" in seen[0]
            # The server replaced the failed incarnation with a fresh one of the same generation.
            await wait_until(
                lambda: server.partitions.get(0) not in (None, victim), 15, "the partition to be reopened"
            )
            assert server.partitions[0].generation == victim.generation
        finally:
            await server.aclose()
            await storage.aclose()

    asyncio.run(main())


def test_a_failed_store_supervisor_is_reported_and_the_partition_reopened(
    tmp_path: Path, zk: KazooClient, zk_connect_string: str
) -> None:
    async def broken() -> None:
        raise RuntimeError("injected supervisor bug")

    async def main() -> None:
        config, root = await _server(tmp_path, zk, zk_connect_string)
        storage = await _add_storage(tmp_path, zk, root)
        server = await WaltzServer.start(config)
        try:
            assert server.member is not None
            await server.member.wait_for_partitions(lambda p: len(p) == NUM_PARTITIONS, 30)
            await wait_until(lambda: len(server.partitions) == NUM_PARTITIONS, 30, "partitions opened")
            victim = server.partitions[0]
            await victim.store.wait_open()
            seen: list[str | None] = []

            def spy(part: Partition) -> None:
                seen.append(part.problem)
                server._partition_failed(part)

            victim.on_failure = spy
            # The store's supervisor dies of a bug as it starts the next session.
            victim.store._new_session = broken  # type: ignore[method-assign,assignment]
            victim.store.request_new_session()
            await wait_until(lambda: bool(seen), 10, "the failure to be reported")
            assert seen[0] is not None
            assert "the store failed" in seen[0]
            assert "injected supervisor bug" in seen[0]
            await wait_until(
                lambda: server.partitions.get(0) not in (None, victim), 15, "the partition to be reopened"
            )
        finally:
            await server.aclose()
            await storage.aclose()

    asyncio.run(main())


def test_a_failed_task_of_the_server_stops_it_and_health_says_why(
    tmp_path: Path, zk: KazooClient, zk_connect_string: str
) -> None:
    async def broken() -> None:
        raise RuntimeError("injected task bug")

    async def main() -> None:
        config, _root = await _server(tmp_path, zk, zk_connect_string)
        server = await WaltzServer.start(config)
        try:
            server._spawn(broken(), "reopen-0")
            failure = await asyncio.wait_for(server.wait_failed(), 15)
            assert "injected task bug" in repr(failure)
            status, body = await asyncio.to_thread(_health, config.http_port)
            assert status == 503, body
            assert any("injected task bug" in p for p in body["problems"]), body
        finally:
            await server.aclose()

    asyncio.run(main())


def test_a_fail_stopped_partition_shows_on_health_until_it_heals(tmp_path: Path) -> None:
    async def main() -> None:
        fs = FaultyFileSystem()
        node = await _storage_node(tmp_path, fs)
        try:
            admin = await AdminClient.connect("127.0.0.1", node.admin_port, DEFAULT_KEY, NUM_PARTITIONS)
            client = await StorageClient.connect("127.0.0.1", node.port, DEFAULT_KEY, NUM_PARTITIONS)
            async with admin, client:
                await admin.set_assigned([0, 1], True)
                await client.last_session_info(1, 0)
                await client.append(1, 0, [_record(0)])
                fs.fail_next_fsyncs()
                with pytest.raises(StorageError, match="injected"):
                    await client.append(1, 0, [_record(1)])
                status, body = await asyncio.to_thread(_health, node.http_port)
                assert status == 503
                assert body["partitions"]["0"].startswith("fail-stopped: fsync failed")
                # Refused at once (not hanging), then healed on a request after the heal interval: cut to the
                # last durable id, so the record whose fsync failed is gone.
                with pytest.raises(StorageError, match="fail-stopped"):
                    await client.max_transaction_id(1, 0)
                await asyncio.sleep(HEAL_INTERVAL_S)
                assert await client.max_transaction_id(1, 0) == 0
                assert (await asyncio.to_thread(_health, node.http_port))[0] == 200
                assert fs.failed_fsyncs == 1
        finally:
            await node.aclose()

    asyncio.run(main())


def test_a_failed_scrub_shows_on_health_with_its_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scrub is a background task of the node: a bug in it (not an I/O error of one partition, which it
    reports and skips) reaches /health, which stays 503 naming it, instead of a log line nobody reads."""

    def bug(part: Any, after: int) -> Any:
        raise RuntimeError("injected scrub bug")

    monkeypatch.setattr(scrub, "scrub_step", bug)

    async def main() -> None:
        node = await _storage_node(tmp_path, **{"storage.scrub.bytesPerSecond": 1 << 20})
        try:
            admin = await AdminClient.connect("127.0.0.1", node.admin_port, DEFAULT_KEY, NUM_PARTITIONS)
            async with admin:
                await admin.set_assigned([0], True)
            await asyncio.wait_for(node.task_failed.wait(), 30)
            status, body = await asyncio.to_thread(_health, node.http_port)
            assert status == 503
            assert body["storage"] == "degraded"
            assert body["partitions"] == {}
            assert list(body["tasks"]) == ["storage-scrub"]
            assert "injected scrub bug" in body["tasks"]["storage-scrub"]
            client = await StorageClient.connect("127.0.0.1", node.port, DEFAULT_KEY, NUM_PARTITIONS)
            async with client:  # the partitions serve on: only the scrub is gone
                await client.last_session_info(1, 0)
                await client.append(1, 0, [_record(0)])
        finally:
            await node.aclose()

    asyncio.run(main())
