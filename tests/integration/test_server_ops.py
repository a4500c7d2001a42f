"""Operating a real server: /health and /metrics over HTTP, ``waltz server list|add-preferred-partition|
remove-preferred-partition``, and ``waltz server run`` refusing a bad configuration."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.integration.conftest import ClusterFactory
from tests.integration.raw_client import RawClient, append_stream
from tests.integration.server_process import ServerProcess, wait_until
from waltz.cluster.membership import ClusterWatcher

pytestmark = [pytest.mark.integration]


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read().decode()


def _waltz(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "waltz.cli.main", *args], capture_output=True, text=True, timeout=60
    )


@pytest.mark.timeout(120)
def test_health_follows_the_quorum_and_metrics_count_appends(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory()

    async def main() -> None:
        await cluster.start(storages=3, servers=1)
        server = cluster.servers[0]

        async def health() -> tuple[int, dict[str, object]]:
            status, body = await asyncio.to_thread(_get, server.http_port, "/health")
            return status, json.loads(body)

        async def owns_healthy_partition() -> bool:
            status, body = await health()
            return status == 200 and body["partitions"] == {"0": True}

        # Healthy means: ZooKeeper connected and every partition it owns healthy (none owned yet is fine).
        await wait_until(owns_healthy_partition, 20, "the server to report its partition healthy")
        status, body = await health()
        assert {k: body[k] for k in ("healthy", "zookeeper", "partitions", "problems")} == {
            "healthy": True,
            "zookeeper": True,
            "partitions": {"0": True},
            "problems": [],
        }

        async with ClusterWatcher(cluster.zk, cluster.root) as watcher:
            client = await RawClient(watcher, 1).start()
            try:
                for f in await append_stream(client, 500):
                    await f
            finally:
                await client.aclose()

        status, text = await asyncio.to_thread(_get, server.http_port, "/metrics")
        assert status == 200
        metrics = _samples(text)
        assert metrics['waltz_server_appends_total{partition="0"}'] == 500
        # One latency observation per committed batch (per-append observations cost the hot path).
        assert 1 <= metrics['waltz_server_append_seconds_count{partition="0"}'] <= 500
        assert metrics['waltz_server_high_water_mark{partition="0"}'] == 499
        assert metrics['waltz_server_partition_healthy{partition="0"}'] == 1
        assert metrics["waltz_server_partitions"] == 1

        # Two of three storage nodes down: no quorum, the partition (and the server) is unhealthy.
        cluster.storages[1].kill()
        cluster.storages[2].kill()
        await wait_until(lambda: _status_is(health, 503), 20, "the server to report unhealthy")
        status, body = await health()
        assert body["partitions"] == {"0": False}
        assert body["problems"] == [
            "partition 0: no open store session (recovering, or too few replicas reachable)"
        ]
        assert body["zookeeper"] is True
        await asyncio.gather(*(asyncio.to_thread(s.start) for s in cluster.storages[1:]))
        await wait_until(lambda: _status_is(health, 200), 30, "the server to be healthy again")

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_burst_of_appends_read_in_one_go_leaves_as_one_batch(cluster_factory: ClusterFactory) -> None:
    """Appends that arrive in one socket read while the store's writer is idle go to the storage nodes as
    one batch (one request and one fsync per replica), not as a lone first append followed by the rest; a
    lone append still leaves at once, a batch of its own. Counted by the batch-size histogram."""
    cluster = cluster_factory()

    def batches(text: str) -> tuple[float, float]:
        metrics = _samples(text)
        return (
            metrics['waltz_server_store_batch_appends_count{partition="0"}'],
            metrics['waltz_server_store_batch_appends_sum{partition="0"}'],
        )

    async def main() -> None:
        await cluster.start(storages=3, servers=1)
        server = cluster.servers[0]
        async with ClusterWatcher(cluster.zk, cluster.root) as watcher:
            client = await RawClient(watcher, 1).start()
            try:
                for _ in range(3):
                    await client.append_and_wait(b"alone")
                _, text = await asyncio.to_thread(_get, server.http_port, "/metrics")
                assert batches(text) == (3, 3)  # each lone append a batch of its own
                # Twenty appends sent in one write (no await yields in between), so read in one go.
                futures = [await client.append(b"burst %d" % i) for i in range(20)]
                for f in futures:
                    await f
            finally:
                await client.aclose()
        _, text = await asyncio.to_thread(_get, server.http_port, "/metrics")
        assert batches(text) == (4, 23)
        assert '{le="16.0",partition="0"} 3.0' in text
        assert '{le="32.0",partition="0"} 4.0' in text

    asyncio.run(main())


async def _status_is(check: object, wanted: int) -> bool:
    assert callable(check)
    status, _ = await check()
    return bool(status == wanted)


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


@pytest.mark.timeout(120)
def test_server_cli_list_and_preferred_partitions(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(num_partitions=2)

    async def main() -> None:
        await cluster.start(storages=3, servers=2)
        a, b = cluster.servers
        async with ClusterWatcher(cluster.zk, cluster.root) as watcher:
            endpoints = await watcher.wait_for(lambda e: len(e) == 2 and len({s for s, _ in e.values()}) == 2)
            on_a = next(p for p, (s, _) in endpoints.items() if s == a.address)

            async def listed(server: ServerProcess) -> str:
                done = await asyncio.to_thread(_waltz, "server", "list", "-s", server.address)
                assert done.returncode == 0, done.stderr
                return done.stdout

            await wait_until(
                lambda: _contains(listed(a), f"partition {on_a}: healthy"), 20, "partition healthy on A"
            )
            out = await listed(a)
            assert out.splitlines()[0] == f"partitions: {on_a}"
            for sp in cluster.storages:
                assert f"{cluster.address(sp)}: reachable" in out

            # B prefers A's partition: the assignment swaps them.
            done = await asyncio.to_thread(
                _waltz, "server", "add-preferred-partition", "-s", b.address, "-p", str(on_a)
            )
            assert done.returncode == 0, done.stderr
            moved = await watcher.wait_for(lambda e: e.get(on_a, ("", 0))[0] == b.address, 30)
            assert moved[on_a][1] > endpoints[on_a][1]
            await wait_until(
                lambda: _contains(listed(b), f"partition {on_a}: healthy"), 20, "the partition healthy on B"
            )
            done = await asyncio.to_thread(
                _waltz, "server", "remove-preferred-partition", "-s", b.address, "-p", str(on_a)
            )
            assert done.returncode == 0, done.stderr

            done = await asyncio.to_thread(
                _waltz, "server", "add-preferred-partition", "-s", b.address, "-p", "7"
            )
            assert done.returncode == 1
            assert "refused" in done.stderr + done.stdout

    asyncio.run(main())


async def _contains(text: object, wanted: str) -> bool:
    assert asyncio.iscoroutine(text)
    return wanted in await text


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"cluster.root": "/c"}, "server.port"),
        ({"cluster.root": "/c", "server.port": 0, "server.bogus": 1}, "server.bogus"),
        ({"cluster.root": "/c", "server.port": 70000}, "server.port"),
        ({"cluster.root": "/c", "server.port": 0, "zookeeper.sessionTimeout": "soon"}, "sessionTimeout"),
    ],
)
@pytest.mark.timeout(60)
def test_bad_server_config_exits_2_with_one_line(
    tmp_path: Path, values: dict[str, object], complaint: str
) -> None:
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump({"zookeeper.connectString": "127.0.0.1:1", **values}), encoding="utf-8")
    done = _waltz("server", "run", "--config", str(path))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("waltz: error: ")
    assert complaint in lines[0]
    assert done.stdout == ""


@pytest.mark.timeout(60)
def test_missing_server_config_file_exits_2(tmp_path: Path) -> None:
    done = _waltz("server", "run", "--config", str(tmp_path / "nope.yaml"))
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith("waltz: error: ")
