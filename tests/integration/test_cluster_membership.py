"""Membership and partition assignment against a real ZooKeeper: joins, leaves, expiry, network drops."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
from kazoo.client import KazooClient

from waltz.cluster import store_metadata as sm
from waltz.cluster.membership import ClusterMember, ClusterWatcher

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

ROOT = "/cluster"
N = 6
Factory = Callable[..., KazooClient]


@pytest.fixture
def cluster(zk: KazooClient) -> str:
    sm.create_cluster(zk, ROOT, "m", N)
    return ROOT


def _published(zk: KazooClient) -> Any:
    return sm.read_partition_assignment(zk, ROOT)


async def _settled(members: list[ClusterMember], timeout_s: float = 20.0) -> list[dict[int, int]]:
    """Wait until the members' partitions cover 0..N-1 exactly once and are balanced."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        views = [m.partitions for m in members]
        owned = sorted(p for v in views for p in v)
        sizes = [len(v) for v in views]
        if owned == list(range(N)) and max(sizes) - min(sizes) <= 1:
            return views
        await asyncio.sleep(0.05)
    raise AssertionError(f"not settled: {[m.partitions for m in members]}")


async def _eventually(condition: Callable[[], bool], timeout_s: float) -> None:
    async with asyncio.timeout(timeout_s):
        while True:
            if condition():
                return
            await asyncio.sleep(0.05)


def test_single_server_gets_every_partition(zk_client_factory: Factory, cluster: str) -> None:
    async def main() -> None:
        async with ClusterMember(zk_client_factory(), cluster, "h", 1) as m:
            parts = await m.wait_for_partitions(lambda p: len(p) == N, 20)
            assert parts == dict.fromkeys(range(N), 1)
            assert m.server_id == 1
            assert m.is_coordinator

    asyncio.run(main())


def test_servers_join_and_leave_generations_bump_exactly_on_moves(
    zk: KazooClient, zk_client_factory: Factory, cluster: str
) -> None:
    async def main() -> None:
        events: list[dict[int, int]] = []
        m1 = ClusterMember(zk_client_factory(), cluster, "h1", 1, on_assignment=events.append)
        await m1.start()
        [v1] = await _settled([m1])
        assert v1 == dict.fromkeys(range(N), 1)

        m2 = ClusterMember(zk_client_factory(), cluster, "h2", 2)
        await m2.start()
        v1b, v2 = await _settled([m1, m2])
        assert len(v1b) == len(v2) == 3
        assert all(g == 1 for g in v1b.values()), "partitions that stayed keep their generation"
        assert all(g == 2 for g in v2.values()), "moved partitions get generation + 1"

        m3 = ClusterMember(zk_client_factory(), cluster, "h3", 3)
        await m3.start()
        views = await _settled([m1, m2, m3])
        assert [len(v) for v in views] == [2, 2, 2]
        before = {p: g for v in (v1b, v2) for p, g in v.items()}
        after = {p: g for v in views for p, g in v.items()}
        stayed = {
            p
            for p in range(N)
            if any(p in old and p in new for old, new in zip((v1b, v2), views[:2], strict=True))
        }
        for p in range(N):
            assert after[p] == (before[p] if p in stayed else before[p] + 1)

        # m2 leaves cleanly: only its partitions move (and bump); m1's and m3's stay put.
        await m2.close()
        v1c, v3c = await _settled([m1, m3])
        for p, g in views[0].items():
            assert v1c[p] == g
        for p, g in views[2].items():
            assert v3c[p] == g
        for p, g in views[1].items():
            assert (v1c | v3c)[p] == g + 1

        # The published assignment is consistent with the live membership.
        assignment, stat = _published(zk)
        assert assignment.cversion == stat.cversion
        assert set(assignment.servers) == {m1.server_id, m3.server_id}
        assert events[0] == dict.fromkeys(range(N), 1)
        await m1.close()
        await m3.close()

    asyncio.run(main())


def test_preferred_partitions_are_honoured(zk_client_factory: Factory, cluster: str) -> None:
    async def main() -> None:
        async with (
            ClusterMember(zk_client_factory(), cluster, "h1", 1) as m1,
            ClusterMember(zk_client_factory(), cluster, "h2", 2, preferred_partitions=[0, 5]) as m2,
        ):
            await _settled([m1, m2])
            await m2.wait_for_partitions(lambda p: {0, 5} <= set(p), 20)

    asyncio.run(main())


def test_watcher_sees_endpoints_and_drops_departed_servers(zk_client_factory: Factory, cluster: str) -> None:
    async def main() -> None:
        async with ClusterWatcher(zk_client_factory(), cluster) as w:
            m1 = ClusterMember(zk_client_factory(), cluster, "h1", 1001)
            m2 = ClusterMember(zk_client_factory(), cluster, "h2", 1002)
            await m1.start()
            await m2.start()
            await _settled([m1, m2])
            eps = await w.wait_for(lambda e: len({s for s, _ in e.values()}) == 2 and len(e) == N)
            for p, g in m2.partitions.items():
                assert eps[p] == ("h2:1002", g)
            await m2.close()
            eps = await w.wait_for(lambda e: {s for s, _ in e.values()} == {"h1:1001"} and len(e) == N)
            mine = await m1.wait_for_partitions(lambda p: len(p) == N)
            assert {p: g for p, (_, g) in eps.items()} == mine
            await m1.close()

    asyncio.run(main())


def test_expired_session_moves_partitions(
    zk_client_factory: Factory, cluster: str, expire_session: Callable[..., None]
) -> None:
    async def main() -> None:
        c2 = zk_client_factory()
        suspended: list[str] = []
        m1 = ClusterMember(zk_client_factory(), cluster, "h1", 1)
        m2 = ClusterMember(
            c2,
            cluster,
            "h2",
            2,
            on_suspended=lambda: suspended.append("s"),
            on_resumed=lambda: suspended.append("r"),
        )
        await m1.start()
        await m2.start()
        v1, v2 = await _settled([m1, m2])
        delivered: list[dict[int, int]] = []

        async def record() -> None:
            delivered.extend([value async for value in m2.assignments()])

        recorder = asyncio.create_task(record())
        await asyncio.to_thread(expire_session, c2)
        # m2 is suspended until it has re-registered and an assignment for the new membership names it.
        assert m2.suspended
        await _eventually(lambda: not m2.suspended, 10)
        v1b, v2b = await _settled([m1, m2])
        assert m2.node is not None
        assert suspended == ["s", "r"]
        for p, g in v1.items():
            assert v1b[p] == g, "m1's partitions never moved"
        for p, g in v2b.items():
            # Either the partition never left m2 (same generation: m2 may keep serving it as it was), or it
            # moved to m1 and back, each move raising the generation.
            assert g == v2.get(p) or g >= v2.get(p, 0) + 2, (p, g, v2)
        # m2 never claimed to own nothing in between: a server keeps a partition that comes back unmoved.
        assert {} not in delivered
        recorder.cancel()
        await m1.close()
        await m2.close()

    asyncio.run(main())


_MEMBER_PROCESS = """
import asyncio, sys
from waltz.cluster import zk as zkutil
from waltz.cluster.membership import ClusterMember

async def main() -> None:
    client = zkutil.connect(sys.argv[1], session_timeout_ms=int(sys.argv[2]))
    member = ClusterMember(client, sys.argv[3], "crashing", 9)
    await member.start()
    await member.wait_for_partitions(lambda p: len(p) > 0, 20)
    print("ready", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def test_crashed_server_partitions_move_after_session_timeout(
    zk_client_factory: Factory, zk_connect_string: str, cluster: str
) -> None:
    """A server process killed with SIGKILL loses its partitions once its session times out."""
    session_timeout_ms = 2000

    async def main() -> None:
        m1 = ClusterMember(zk_client_factory(), cluster, "h1", 1)
        await m1.start()
        await m1.wait_for_partitions(lambda p: len(p) == N, 20)
        proc = await asyncio.create_subprocess_exec(
            *(sys.executable, "-c", _MEMBER_PROCESS, zk_connect_string, str(session_timeout_ms), cluster),
            stdout=subprocess.PIPE,
        )
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 30)
            assert line.strip() == b"ready"
            kept = await m1.wait_for_partitions(lambda p: len(p) == N // 2, 20)
            t0 = time.monotonic()
            proc.kill()
            parts = await m1.wait_for_partitions(lambda p: len(p) == N, 20)
            elapsed = time.monotonic() - t0
        finally:
            if proc.returncode is None:
                proc.kill()
            await asyncio.wait_for(proc.wait(), 10)
        for p, g in parts.items():
            assert g == kept.get(p, 3), "crashed server's partitions: 1 -> 2 (moved to it) -> 3"
        # Expiry is detected within the session timeout plus one tick, then one assignment round trip.
        assert elapsed < session_timeout_ms / 1000 + 3
        await m1.close()

    asyncio.run(main())


def test_network_drop_shorter_than_session_timeout_moves_nothing(
    zk: KazooClient, zk_client_factory: Factory, zk_proxy: Any, zk_chroot: str, cluster: str
) -> None:
    async def main() -> None:
        via_proxy = zk_client_factory(
            session_timeout_ms=6000, connect_string=f"127.0.0.1:{zk_proxy.port}{zk_chroot}"
        )
        signals: list[str] = []
        m1 = ClusterMember(zk_client_factory(), cluster, "h1", 1)
        m2 = ClusterMember(
            via_proxy,
            cluster,
            "h2",
            2,
            on_suspended=lambda: signals.append("suspended"),
            on_resumed=lambda: signals.append("resumed"),
        )
        await m1.start()
        await m2.start()
        views = await _settled([m1, m2])
        _, stat_before = _published(zk)
        zk_proxy.cut(1.5)
        await _eventually(lambda: signals == ["suspended", "resumed"], 15)
        assert signals == ["suspended", "resumed"]
        await asyncio.sleep(0.5)
        _, stat_after = _published(zk)
        assert stat_after.version == stat_before.version, "no new assignment was published"
        assert [m1.partitions, m2.partitions] == views
        await m1.close()
        await m2.close()

    asyncio.run(main())


def test_instant_connection_drop_suspends_and_resumes(
    zk_client_factory: Factory, cluster: str, drop_connection: Callable[..., None]
) -> None:
    async def main() -> None:
        client = zk_client_factory()
        signals: list[str] = []
        m = ClusterMember(
            client,
            cluster,
            "h",
            1,
            on_suspended=lambda: signals.append("s"),
            on_resumed=lambda: signals.append("r"),
        )
        await m.start()
        before = await m.wait_for_partitions(lambda p: len(p) == N, 20)
        await asyncio.to_thread(drop_connection, client)
        await _eventually(lambda: signals == ["s", "r"], 10)
        assert signals == ["s", "r"]
        assert m.partitions == before
        await m.close()

    asyncio.run(main())


def test_a_lost_session_is_one_log_line_not_one_per_failed_refresh(
    zk_client_factory: Factory,
    cluster: str,
    expire_session: Callable[..., None],
    drop_connection: Callable[..., None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # waltz.cluster.zk logs each ZooKeeper state change once; the member's refreshes that fail on it (the
    # connection is gone) must not add an INFO "refresh failed: ... ConnectionLoss" line each.
    async def main() -> None:
        client = zk_client_factory()
        other = ClusterMember(zk_client_factory(), cluster, "h2", 2)
        m = ClusterMember(client, cluster, "h", 1)
        await m.start()
        await other.start()
        await _settled([m, other])
        caplog.set_level("INFO", logger="waltz.cluster")
        for _ in range(3):
            await asyncio.to_thread(drop_connection, client)
            await _eventually(lambda: not m.suspended, 10)
        await asyncio.to_thread(expire_session, client)
        await _eventually(lambda: not m.suspended, 10)
        await _settled([m, other])
        await m.close()
        await other.close()

    asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if r.name == "waltz.cluster.membership"]
    assert not [line for line in lines if "refresh failed" in line], lines
