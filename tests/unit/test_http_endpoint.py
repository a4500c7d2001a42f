"""The HTTP endpoint over real loopback sockets: /metrics is built off the event loop, so a slow scrape (a
server with many partitions) does not stop the process from serving meanwhile."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from waltz.http import SCRAPE_SWITCH_INTERVAL_S, HttpEndpoint

WAIT_S = 10.0


async def _get(port: int, path: str) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        await writer.drain()
        response = await reader.read()
    finally:
        writer.close()
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


class _Blocking(Collector):
    """Collects only once ``release`` is set (or after WAIT_S), noting the thread it ran on and whether it
    was released: the loop must serve other requests while a scrape is being built."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.threads: list[int] = []
        self.released: list[bool] = []

    def collect(self) -> Iterator[Metric]:
        self.threads.append(threading.get_ident())
        self.started.set()
        self.released.append(self.release.wait(WAIT_S))
        yield GaugeMetricFamily("test_slow_gauge", "A gauge that takes its time", value=7)


def test_a_slow_scrape_does_not_stop_other_requests() -> None:
    asyncio.run(_a_slow_scrape_does_not_stop_other_requests())


async def _a_slow_scrape_does_not_stop_other_requests() -> None:
    registry = CollectorRegistry()
    slow = _Blocking()
    registry.register(slow)
    endpoint = HttpEndpoint(registry, lambda: (True, {}))
    port = await endpoint.start("127.0.0.1", 0)
    try:
        scrape = asyncio.create_task(_get(port, "/metrics"))
        assert await asyncio.to_thread(slow.started.wait, WAIT_S)
        assert await asyncio.wait_for(_get(port, "/ping"), WAIT_S) == (200, b"pong\n")
        slow.release.set()
        status, body = await asyncio.wait_for(scrape, 2 * WAIT_S)
    finally:
        slow.release.set()
        await endpoint.aclose()
    assert status == 200
    assert b"test_slow_gauge 7.0" in body
    assert slow.released == [True], "the scrape blocked the loop: /ping was not served meanwhile"
    assert slow.threads[0] != threading.get_ident(), "collected on the event loop's thread"


def test_concurrent_scrapes_each_get_the_whole_text() -> None:
    asyncio.run(_concurrent_scrapes_each_get_the_whole_text())


async def _concurrent_scrapes_each_get_the_whole_text() -> None:
    registry = CollectorRegistry()
    slow = _Blocking()
    slow.release.set()
    registry.register(slow)
    endpoint = HttpEndpoint(registry, lambda: (True, {}))
    port = await endpoint.start("127.0.0.1", 0)
    try:
        results = await asyncio.wait_for(asyncio.gather(*(_get(port, "/metrics") for _ in range(4))), WAIT_S)
    finally:
        await endpoint.aclose()
    assert [status for status, _ in results] == [200] * 4
    assert all(b"test_slow_gauge 7.0" in body for _, body in results)
    assert len(slow.threads) == 4


def test_a_failing_collector_gets_a_500_and_the_endpoint_keeps_serving() -> None:
    asyncio.run(_a_failing_collector_gets_a_500_and_the_endpoint_keeps_serving())


async def _a_failing_collector_gets_a_500_and_the_endpoint_keeps_serving() -> None:
    class Failing(Collector):
        def collect(self) -> Iterator[Metric]:
            raise RuntimeError("collector broke")

    registry = CollectorRegistry()
    registry.register(Failing())
    endpoint = HttpEndpoint(registry, lambda: (True, {}))
    port = await endpoint.start("127.0.0.1", 0)
    try:
        assert (await _get(port, "/metrics"))[0] == 500
        assert await _get(port, "/ping") == (200, b"pong\n")
    finally:
        await endpoint.aclose()


class _NotingInterval(Collector):
    """Notes the interpreter's switch interval while it collects."""

    def __init__(self) -> None:
        self.seen: list[float] = []

    def collect(self) -> Iterator[Metric]:
        self.seen.append(sys.getswitchinterval())
        yield GaugeMetricFamily("test_gauge", "A gauge", value=1)


def test_a_scrape_shortens_the_switch_interval_and_puts_it_back() -> None:
    asyncio.run(_a_scrape_shortens_the_switch_interval_and_puts_it_back())


async def _a_scrape_shortens_the_switch_interval_and_puts_it_back() -> None:
    # The loop takes the GIL back at every system call; with Python's 5 ms interval a scrape at 1,000
    # partitions held a /ping for a third of a second.
    before = sys.getswitchinterval()
    noting = _NotingInterval()
    slow = _Blocking()
    endpoints = []
    for collector in (noting, slow):
        registry = CollectorRegistry()
        registry.register(collector)
        endpoints.append(HttpEndpoint(registry, lambda: (True, {})))
    ports = [await endpoint.start("127.0.0.1", 0) for endpoint in endpoints]
    try:
        assert (await _get(ports[0], "/metrics"))[0] == 200
        assert sys.getswitchinterval() == before
        # Two endpoints of one process scraped at once: the first to end leaves it short for the other.
        held = asyncio.create_task(_get(ports[1], "/metrics"))
        assert await asyncio.to_thread(slow.started.wait, WAIT_S)
        assert (await _get(ports[0], "/metrics"))[0] == 200
        assert sys.getswitchinterval() == SCRAPE_SWITCH_INTERVAL_S
        slow.release.set()
        assert (await asyncio.wait_for(held, WAIT_S))[0] == 200
    finally:
        slow.release.set()
        for endpoint in endpoints:
            await endpoint.aclose()
    assert noting.seen == [SCRAPE_SWITCH_INTERVAL_S] * 2
    assert before > SCRAPE_SWITCH_INTERVAL_S
    assert sys.getswitchinterval() == before
