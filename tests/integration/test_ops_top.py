"""``waltz top``: the snapshot library against a real cluster, and one frame printed by the command."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml

from tests.integration.conftest import ClusterFactory
from tests.integration.raw_client import RawClient
from waltz.cli.main import main as waltz_main
from waltz.cluster.membership import ClusterWatcher
from waltz.ops.top import TopSnapshot, gather

pytestmark = [pytest.mark.integration]


def replica_states(snapshot: TopSnapshot, partition: int) -> dict[str, tuple[str, int]]:
    return {r.storage: (r.state, r.lag) for r in snapshot.partitions[partition].replicas}


@pytest.mark.timeout(120)
def test_top_follows_appends_a_dead_node_an_offline_replica_and_a_dead_server(
    cluster_factory: ClusterFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = cluster_factory(num_partitions=2)
    cli_config = tmp_path / "cli.yaml"
    cli_config.write_text(
        yaml.safe_dump({"zookeeper.connectString": cluster.zk_connect, "cluster.root": cluster.root})
    )

    async def main() -> None:
        await cluster.start(storages=3, servers=1)
        server = cluster.servers[0]
        storages = [cluster.address(sp) for sp in cluster.storages]
        async with ClusterWatcher(cluster.zk, cluster.root) as watcher:
            client = await RawClient(watcher, 1).start()
            try:
                for i in range(10):
                    await client.append_and_wait(b"%d" % i)
                first = await gather(cluster.zk, cluster.root)
                for i in range(10):
                    await client.append_and_wait(b"%d" % i)
            finally:
                await client.aclose()

        # A healthy cluster: every partition served by the one server, every replica holds everything.
        assert [p.health for p in first.partitions] == ["ok", "ok"]
        assert first.partitions[0].high_water_mark == 9
        assert first.partitions[1].high_water_mark == -1
        assert first.partitions[0].owner == f"{server.server_id}@127.0.0.1:{server.port}"
        assert first.partitions[0].generation == cluster.partition_metadata_generation(0)
        assert first.partitions[0].append_rate is None  # no previous snapshot
        assert replica_states(first, 0) == dict.fromkeys(storages, ("ok", 0))
        assert [(p.kind, p.alive) for p in first.processes] == [("server", True)] + [("storage", True)] * 3
        assert first.healthy

        second = await gather(cluster.zk, cluster.root, previous=first)
        assert second.partitions[0].high_water_mark == 19
        assert second.partitions[0].append_rate is not None
        assert second.partitions[0].append_rate > 0
        assert second.partitions[1].append_rate == 0

        # A storage node dies and another takes partition 1 offline.
        cluster.storages[2].kill()
        async with await cluster.admin(cluster.storages[1]) as admin:
            await admin.set_available([1], False)
        third = await gather(cluster.zk, cluster.root, previous=second, timeout_s=1.0)
        assert replica_states(third, 0)[storages[2]] == ("down", -1)
        assert replica_states(third, 1)[storages[1]][0] == "offline"
        # Not healthy; the store session that lost the node ends at once and reopens without it, so the
        # owner may answer "not served" for that moment.
        assert third.partitions[1].health in ("degraded", "unhealthy", "unserved")
        dead = [p for p in third.processes if p.address == storages[2]]
        assert [(p.alive, p.detail) for p in dead] == [(False, "did not answer")]
        assert not third.healthy

        # One frame from the command: plain text when stdout is not a terminal; exit status 1 (not healthy).
        assert await asyncio.to_thread(waltz_main, ["top", "-c", str(cli_config), "--once"]) == 1
        frame = capsys.readouterr().out
        assert "partitions" in frame
        assert f"{storages[2]} down" in frame
        assert "DOWN" in frame
        assert "\x1b[" not in frame  # no terminal escapes in a pipe

        # The only server dies: its partitions are unserved, and it is shown down.
        server.kill()
        fourth = await gather(cluster.zk, cluster.root, timeout_s=1.0)
        assert {p.health for p in fourth.partitions} == {"unserved"}
        assert all(p.high_water_mark is None for p in fourth.partitions)

    asyncio.run(main())
