"""The bounds on what one peer can hold: rate-limited warnings, response byte budgets, idle and stall
timeouts, per-source connection limits, reading paused while answers pile up, bounded config and PEM reads,
byte-capped replication batches. Transport tests run over real loopback sockets (127.0.0.1 and 127.0.0.2)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.unit.test_store_session import (
    NAMES,
    World,
    _open_session,
    _recording_partition,
    _slow_fsyncs,
    req,
    submit,
)
from waltz.config import MAX_CONFIG_FILE_BYTES, read_bounded, read_yaml
from waltz.errors import BrokenResourceError, ConfigError
from waltz.protocol.framing import MAGIC_HELLO, MAGIC_STORAGE, encode_frame, encode_hello
from waltz.server.config import ServerConfig
from waltz.server.feed_cache import FeedCache
from waltz.server.partition import Partition
from waltz.server.transaction_cache import TransactionCache, TransactionData, TransactionFetcher
from waltz.storage.config import StorageConfig
from waltz.testing import run_virtual
from waltz.tls import TlsConfig
from waltz.transport import ByteBudget, FramedConnection, RateLimitedLog, open_connection, reason_kind, serve

pytestmark = pytest.mark.timeout(30)

T = TypeVar("T")
HOST = "127.0.0.1"
STORAGE: dict[str, Any] = {"magic": MAGIC_STORAGE, "versions": (0,)}


def run(main: Coroutine[Any, Any, T], timeout_s: float = 15.0) -> T:
    async def bounded() -> T:
        async with asyncio.timeout(timeout_s):
            return await main

    return asyncio.run(bounded())


# ------------------------------------------------------------------------------------ rate-limited warnings


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_repeated_warnings_are_logged_once_per_interval_with_a_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    limited = RateLimitedLog(logging.getLogger("test.bounds"), 10.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="test.bounds"):
        assert limited.warning("10.0.0.1", "hello", "bad hello from %s", "10.0.0.1:1")
        for port in range(2, 500):
            clock.now += 0.01
            assert not limited.warning("10.0.0.1", "hello", "bad hello from %s", f"10.0.0.1:{port}")
        # Another peer, or another reason of the same peer, is not held back.
        assert limited.warning("10.0.0.2", "hello", "bad hello from %s", "10.0.0.2:1")
        assert limited.warning("10.0.0.1", "idle", "idle %s", "10.0.0.1:3")
        clock.now = 10.5
        assert limited.warning("10.0.0.1", "hello", "bad hello from %s", "10.0.0.1:600")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "bad hello from 10.0.0.1:1",
        "bad hello from 10.0.0.2:1",
        "idle 10.0.0.1:3",
        "bad hello from 10.0.0.1:600 (498 more like this from 10.0.0.1 in the last 10 s not logged)",
    ]


def test_rate_limiter_remembers_a_bounded_number_of_keys() -> None:
    limited = RateLimitedLog(logging.getLogger("test.bounds"), 10.0, max_keys=8, clock=FakeClock())
    for i in range(1000):
        limited.warning(f"10.0.{i // 256}.{i % 256}", "x", "m")
    assert len(limited._seen) == 8


def test_reason_kind_blanks_numbers_but_keeps_reasons_apart() -> None:
    a = reason_kind("decode", ValueError("unknown storage message type 99"))
    b = reason_kind("decode", ValueError("unknown storage message type 98"))
    c = reason_kind("decode", ValueError("record list of 12 does not fit the message"))
    assert a == b != c
    assert len(reason_kind("x", ValueError("y" * 1000))) < 150


# ------------------------------------------------------------------------------------------- byte budgets


def test_byte_budget_waits_for_room_and_lets_one_oversized_reservation_go_alone() -> None:
    async def main() -> None:
        budget = ByteBudget(100)
        await budget.acquire(60)
        second = asyncio.create_task(budget.acquire(60))
        await asyncio.sleep(0.01)
        assert not second.done()
        assert budget.reserved_bytes == 60
        budget.release(60)
        await second
        assert budget.reserved_bytes == 60
        huge = asyncio.create_task(budget.acquire(500))
        await asyncio.sleep(0.01)
        assert not huge.done()  # waits until nothing else is reserved ...
        budget.release(60)
        await huge  # ... then goes alone
        assert budget.reserved_bytes == 500
        budget.release(500)
        assert budget.reserved_bytes == 0
        with pytest.raises(ValueError):
            ByteBudget(0)

    run(main())


# --------------------------------------------------------------------------------- transport: idle, flood


async def _hold(conn: FramedConnection) -> None:
    while True:
        await conn.receive()


def test_an_idle_connection_is_closed_and_a_keep_alive_one_is_not(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        async with await serve(HOST, 0, _hold, hello_text="s", idle_timeout_s=0.4, **STORAGE) as server:
            silent = await open_connection(
                HOST, server.port, hello_text="c", keep_alive_interval_s=None, **STORAGE
            )
            alive = await open_connection(
                HOST, server.port, hello_text="c", keep_alive_interval_s=0.1, **STORAGE
            )
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(BrokenResourceError):
                await silent.receive()
            assert loop.time() - started < 1.5  # the clock started at the server's first read
            await asyncio.sleep(0.6)  # past the timeout: the keep-alives keep the other one
            assert not alive.is_closed
            assert server.connection_count == 1
            await silent.aclose()
            await alive.aclose()

    with caplog.at_level(logging.WARNING, logger="waltz.transport"):
        run(main())
    assert any("idle timeout" in r.getMessage() for r in caplog.records)


async def _hello_from(port: int, source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(HOST, port, local_addr=(source, 0))
    writer.write(encode_frame(MAGIC_HELLO, 0, encode_hello((0,), "raw")))
    await reader.readexactly(7)  # the server's hello header: the exchange completed
    return reader, writer


def test_per_source_limit_refuses_the_excess_of_one_address_only(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        async with await serve(
            HOST, 0, _hold, hello_text="s", max_connections_per_source=3, **STORAGE
        ) as server:
            kept = [await _hello_from(server.port, "127.0.0.2") for _ in range(3)]
            refused = 0
            for _ in range(20):
                with pytest.raises((asyncio.IncompleteReadError, ConnectionResetError)):
                    await _hello_from(server.port, "127.0.0.2")
                refused += 1
            good = await open_connection(HOST, server.port, hello_text="c", **STORAGE)
            assert not good.is_closed
            await good.aclose()
            for _, writer in kept:
                writer.close()
            await asyncio.sleep(0.1)
            # Slots come back when connections end.
            _, writer = await _hello_from(server.port, "127.0.0.2")
            writer.close()
            assert refused == 20

    with caplog.at_level(logging.WARNING, logger="waltz.transport"):
        run(main())
    refusals = [r for r in caplog.records if "refusing connection" in r.getMessage()]
    assert len(refusals) == 1  # rate-limited: one line for 20 refusals
    assert "127.0.0.2" in refusals[0].getMessage()


# ---------------------------------------------------------------------- transport: a peer that never reads


def test_a_peer_that_never_reads_stops_being_read_then_is_closed(caplog: pytest.LogCaptureFixture) -> None:
    handled = 0

    async def answer_big(conn: FramedConnection) -> None:
        nonlocal handled
        while True:
            await conn.receive()
            handled += 1
            conn.send(bytes(256 * 1024))

    async def main() -> None:
        async with await serve(
            HOST,
            0,
            answer_big,
            hello_text="s",
            write_buffer_high_bytes=512 * 1024,
            idle_timeout_s=1.0,
            **STORAGE,
        ) as server:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            loop = asyncio.get_running_loop()
            await loop.sock_connect(sock, (HOST, server.port))
            await loop.sock_sendall(sock, encode_frame(MAGIC_HELLO, 0, encode_hello((0,), "raw")))
            # 400 requests of 16 KiB, each asking for 256 KiB, and never a byte read (after the hello).
            # The send itself blocks once the server stops reading, and fails when it gives up on us.
            requests = b"".join(encode_frame(MAGIC_STORAGE, 0, bytes(16 * 1024)) for _ in range(400))
            sending = asyncio.create_task(loop.sock_sendall(sock, requests))
            await asyncio.sleep(0.5)
            # Answers to only a few requests were produced: reading stopped while they sat unsent.
            assert handled < 60
            await asyncio.sleep(1.5)
            assert server.connection_count == 0  # closed after the idle timeout without reading
            assert handled < 60
            (outcome,) = await asyncio.gather(sending, return_exceptions=True)
            assert isinstance(outcome, ConnectionResetError | BrokenPipeError)
            sock.close()

    with caplog.at_level(logging.WARNING, logger="waltz.transport"):
        run(main())
    assert any("read none of our data" in r.getMessage() for r in caplog.records)


def test_a_slow_reader_gets_every_answer() -> None:
    async def answer_big(conn: FramedConnection) -> None:
        while True:
            payload = await conn.receive()
            conn.send(payload * 64)

    async def main() -> None:
        async with await serve(
            HOST,
            0,
            answer_big,
            hello_text="s",
            write_buffer_high_bytes=64 * 1024,
            idle_timeout_s=5.0,
            **STORAGE,
        ) as server:
            conn = await open_connection(HOST, server.port, hello_text="c", **STORAGE)
            async with conn:
                for i in range(300):
                    conn.send(i.to_bytes(4, "big") * 256)
                await conn.drain()
                for i in range(300):
                    assert await conn.receive() == i.to_bytes(4, "big") * 256 * 64
                    if i % 50 == 0:
                        await asyncio.sleep(0.05)

    run(main())


# ------------------------------------------------------------------------------- bounded reads of inputs


def test_reads_of_config_and_certificate_files_are_bounded(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="larger than 1000 bytes"):
        read_bounded("/dev/zero", 1000)
    small = tmp_path / "small"
    small.write_bytes(b"x" * 1000)
    assert read_bounded(small, 1000) == b"x" * 1000
    with pytest.raises(ConfigError, match="/dev/zero: not a config file"):
        read_yaml("/dev/zero")
    big = tmp_path / "big.yaml"
    big.write_text("a: " + "b" * MAX_CONFIG_FILE_BYTES)
    with pytest.raises(ConfigError, match="not a config file"):
        read_yaml(big)
    with pytest.raises(ConfigError, match="is a directory"):
        read_yaml(tmp_path)
    tls = TlsConfig(prefix="storage.ssl.", cert_file="/dev/zero", key_file="/dev/zero")
    with pytest.raises(ConfigError, match=r"storage\.ssl\.certFile: /dev/zero holds more than"):
        tls.server_context("storage config")


STORAGE_BASE = {
    "storage.port": 0,
    "storage.admin.port": 0,
    "storage.directory": "/tmp/x",
    "storage.cluster.key": "6f1f0f7e-1d2c-4b3a-9e8d-7c6b5a493827",
    "storage.cluster.numPartitions": 1,
}


@pytest.mark.parametrize("blank", ["", "   "])
def test_a_blank_storage_directory_is_refused(blank: str) -> None:
    with pytest.raises(ConfigError, match=r"storage\.directory: must name a directory") as e:
        StorageConfig.from_mapping({**STORAGE_BASE, "storage.directory": blank})
    assert "missing" not in str(e.value)


def test_bounds_have_defaults_and_config_keys() -> None:
    storage = StorageConfig.from_mapping(STORAGE_BASE)
    assert (storage.connection_max_response_bytes, storage.connection_idle_timeout_ms) == (64 << 20, 180_000)
    assert (storage.max_connections, storage.max_connections_per_source) == (1024, 128)
    tuned = StorageConfig.from_mapping(
        {**STORAGE_BASE, "storage.connection.idleTimeout": 5000, "storage.connection.maxPerSource": 8}
    )
    assert (tuned.connection_idle_timeout_ms, tuned.max_connections_per_source) == (5000, 8)
    server = ServerConfig.from_mapping(
        {"zookeeper.connectString": "z:1", "cluster.root": "/c", "server.port": 0}
    )
    assert server.connection_max_in_flight == 64
    assert server.connection_max_response_bytes == 64 << 20
    assert server.connection_idle_timeout_ms == 180_000
    assert (server.max_connections, server.max_connections_per_source) == (1024, 256)
    assert server.max_fetches_in_flight == 64
    assert server.store.max_batch_bytes == 4 << 20
    with pytest.raises(ConfigError, match=r"server\.connection\.maxInFlight"):
        ServerConfig.from_mapping(
            {
                "zookeeper.connectString": "z:1",
                "cluster.root": "/c",
                "server.port": 0,
                "server.connection.maxInFlight": 0,
            }
        )


# ------------------------------------------------------------------------------ replication batch bytes


def test_replication_batches_are_capped_by_bytes_and_a_larger_append_goes_alone() -> None:
    async def main() -> None:
        world = World(max_batch_size=100, max_batch_bytes=2500, max_inflight_batches=4, max_queued_appends=50)
        async with _recording_partition(world) as partition:
            session = await _open_session(partition)
            _slow_fsyncs(world, 50)
            sizes = [1000] * 7 + [6000] + [1000] * 3
            futures = [await submit(partition, req(i, data=bytes([i]) * n)) for i, n in enumerate(sizes)]
            assert [await f for f in futures] == list(range(len(sizes)))
            bounds = [-1, *partition.commits]
            batches = [sizes[a + 1 : b + 1] for a, b in itertools.pairwise(bounds)]
            assert sum(len(b) for b in batches) == len(sizes)
            for batch in batches:
                assert sum(batch) <= 2500 or batch == [6000]
            assert [6000] in batches
            assert session.high_water_mark == len(sizes) - 1
            assert all(len(world.log(n)) == len(sizes) for n in NAMES)

    run_virtual(main())


# ------------------------------------------------------------------------ transaction data via the fetcher


def test_transaction_data_reads_go_through_the_fetcher_one_load_per_transaction() -> None:
    async def main() -> None:
        world = World()
        store = world.partition()
        cache = TransactionCache(1 << 20)
        loads: list[int] = []

        async def load(partition_id: int, transaction_id: int) -> TransactionData:
            loads.append(transaction_id)
            return await part.load_transaction(transaction_id)

        fetcher = TransactionFetcher(cache, load, max_in_flight=2)
        part = Partition(0, store, feed_cache=FeedCache(1 << 20, 1), transaction_cache=cache, fetcher=fetcher)
        await part.start()
        try:
            for i in range(5):
                assert await store.append(req(i)) == i
            # Nothing was cached through the append path here: every read misses, and concurrent reads of one
            # transaction share a single store read.
            results = await asyncio.gather(*(part.transaction_data(i % 3) for i in range(12)))
            assert [r[0] if r else None for r in results] == [f"txn-{i % 3}".encode() for i in range(12)]
            assert sorted(loads) == [0, 1, 2]
            assert await part.transaction_data(4) == (b"txn-4", req(4).checksum)
            assert await part.transaction_data(5) is None  # above the high-water mark: no load at all
            assert sorted(loads) == [0, 1, 2, 4]
            assert await part.transaction_data(1) is not None  # cached now
            assert sorted(loads) == [0, 1, 2, 4]
        finally:
            await part.close()
            await fetcher.aclose()

    run_virtual(main())
