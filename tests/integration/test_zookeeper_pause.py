"""ZooKeeper itself is paused (SIGSTOP, then SIGCONT) while a client appends through the client library.

* **Longer than the session timeout**: every server's (and client's) session expires at once. The servers
  re-register and, with nobody else to take over, get their own partitions back in the same generation.
  Once (issue 14) the servers had closed and re-opened those partitions, whose new incarnations knew no
  client and silently dropped the appends and flushes of clients that never saw a reason to mount again:
  every partition stalled for good. Every submitted transaction must now commit, once, in one order.
* **Shorter than the session timeout**: the servers only see their connection SUSPENDED and get it back. The
  pause must cost no more than itself: the longest stretch without an applied transaction stays close to the
  pause (once appends taken during the suspension were dropped and waited for the client's 5 s nudge).

Each test runs its own ZooKeeper process: pausing the session-wide one would stall every other test.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from tests.integration.client_cluster import ClientTestCluster, CounterApp, Increment, wait_until
from tests.integration.server_process import TEST_ZK_SESSION_TIMEOUT_MS
from waltz import Transaction, WaltzClient
from waltz.cluster import zk as zkutil
from waltz.cluster.membership import ClusterWatcher
from waltz.cluster.zkserver import ZooKeeperServer

pytestmark = pytest.mark.integration

NUM_PARTITIONS = 2


class _Timeline(CounterApp):
    """A CounterApp that also notes when each transaction was applied (monotonic seconds)."""

    def __init__(self, num_partitions: int) -> None:
        super().__init__(num_partitions)
        self.applied_at: list[float] = []

    def apply_transaction(self, transaction: Transaction) -> None:
        super().apply_transaction(transaction)
        self.applied_at.append(time.monotonic())


def _health(http_port: int) -> dict[str, object]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=5) as r:
            body: dict[str, object] = json.loads(r.read())
    except urllib.error.HTTPError as e:  # 503 carries the same JSON body
        body = json.loads(e.read())
    return body


async def _append_through_pause(tmp_path: Path, pause_s: float) -> tuple[_Timeline, float]:
    """Append steadily from one client while ZooKeeper is paused for ``pause_s``; returns the app and when
    the pause began (monotonic)."""
    zookeeper = ZooKeeperServer(tmp_path / "zookeeper")
    await asyncio.to_thread(zookeeper.start)
    zk = await asyncio.to_thread(zkutil.connect, zookeeper.connect_string, session_timeout_ms=30000)
    try:
        async with ClientTestCluster(
            tmp_path, zk, zookeeper.connect_string, num_partitions=NUM_PARTITIONS, servers=2
        ) as cluster:
            async with ClusterWatcher(zk, cluster.root) as watcher:
                before = await watcher.wait_for(lambda e: len(e) == NUM_PARTITIONS, 30)
            app = _Timeline(NUM_PARTITIONS)
            # The default nudge (5 s): the pause must not lean on it.
            config = cluster.client_config(long_wait_threshold_ms=5000)
            client = await asyncio.to_thread(WaltzClient, app, config)
            stop = False
            contexts: list[Increment] = []
            runner: asyncio.Task[None] | None = None

            def work() -> None:
                n = 0
                while not stop:
                    context = Increment(app, n % NUM_PARTITIONS)
                    contexts.append(context)
                    client.submit(context)
                    n += 1
                    time.sleep(0.01)
                client.flush_transactions(60)

            try:
                runner = asyncio.create_task(asyncio.to_thread(work))
                await wait_until(lambda: len(app.applied_at) >= 20, 30, "appends before the pause")
                paused_at = time.monotonic()
                zk_pid = zookeeper.pid
                assert zk_pid is not None
                os.kill(zk_pid, signal.SIGSTOP)
                try:
                    await asyncio.sleep(pause_s)
                finally:
                    os.kill(zk_pid, signal.SIGCONT)
                # Progress after the pause, then stop submitting and let everything finish.
                count = len(app.applied_at)
                await wait_until(lambda: len(app.applied_at) >= count + 40, 30, "appends after the pause")
                stop = True
                await asyncio.wait_for(runner, 90)
                assert all(c.completed is True for c in contexts), [
                    c.exception for c in contexts if c.completed is not True
                ]
                for p in range(NUM_PARTITIONS):
                    # One order, no lost update: the counter went 1, 2, 3, ... on every partition.
                    expected = [str(n).encode() for n in range(1, len(app.data(p)) + 1)]
                    assert app.data(p) == expected
                assert sum(len(app.data(p)) for p in range(NUM_PARTITIONS)) == len(contexts)
                assert not app.errors
                # Health settles: after the sessions expired the assignment may still move a partition
                # (a new generation that recovers first), so /health may say so for a moment, not for good.
                bodies: dict[str, dict[str, object]] = {}

                async def all_healthy() -> bool:
                    for server in cluster.servers:
                        bodies[server.name] = await asyncio.to_thread(_health, server.http_port)
                    return all(b.get("healthy") is True for b in bodies.values())

                deadline = time.monotonic() + 30
                while not await all_healthy():
                    assert time.monotonic() < deadline, bodies
                    await asyncio.sleep(0.5)
            finally:
                stop = True
                await asyncio.to_thread(client.close)
                if runner is not None:
                    # After a failure above, the submitter ends with the client's ClientClosedError.
                    with contextlib.suppress(Exception):
                        await runner
            async with ClusterWatcher(zk, cluster.root) as watcher:
                after = await watcher.wait_for(lambda e: len(e) == NUM_PARTITIONS, 30)
            assert set(after) == set(before)
        return app, paused_at
    finally:
        await asyncio.to_thread(zkutil.close, zk)
        await asyncio.to_thread(zookeeper.stop)


@pytest.mark.timeout(180)
def test_appends_go_on_after_zookeeper_pauses_past_the_session_timeout(tmp_path: Path) -> None:
    # Twice the session timeout: every session has expired by the time ZooKeeper runs again.
    asyncio.run(_append_through_pause(tmp_path, 2 * TEST_ZK_SESSION_TIMEOUT_MS / 1000))


@pytest.mark.timeout(180)
def test_a_short_zookeeper_pause_costs_no_more_than_itself(tmp_path: Path) -> None:
    # Long enough that the servers see their connection SUSPENDED (after 2/3 of the session timeout),
    # short enough that no session expires.
    pause_s = 0.85 * TEST_ZK_SESSION_TIMEOUT_MS / 1000
    app, paused_at = asyncio.run(_append_through_pause(tmp_path, pause_s))
    times = [paused_at, *[t for t in app.applied_at if t > paused_at]]
    longest_gap_s = max(b - a for a, b in itertools.pairwise(times))
    # Appends stop at worst for the whole pause; reconnecting to ZooKeeper takes well under a second.
    assert longest_gap_s < pause_s + 1.5, f"{longest_gap_s:.1f} s without an applied transaction"
