"""Operator tools on trimmed partitions (issue 26), on real clusters: ``waltz backup`` of a trimmed partition
starts at its trim point and records it, ``waltz restore`` recreates it (reads below it fail with
TrimmedError on the restored cluster, not with empty data), an incremental backup that cannot continue past a
trim fails with TrimmedError, and ``waltz storage recover-partition`` copies a trimmed partition into a wiped
replica from the trim point on, after which ``waltz cluster verify`` says OK."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.integration.conftest import ClusterFactory
from tests.integration.ops_cli import (
    admin,
    cli_config,
    recover_partition,
    served,
    verify_lines,
    waltz,
    wipe_replicas,
)
from tests.integration.raw_client import RawClient, append_stream
from tests.integration.server_process import Cluster, wait_until
from waltz.client.config import ClientConfig
from waltz.client.reader import LogReader
from waltz.cluster.membership import ClusterWatcher
from waltz.cluster.trim_points import read_trim_points
from waltz.errors import TrimmedError
from waltz.ops.backup_format import read_manifest
from waltz.ops.trim import trim_partition

pytestmark = [pytest.mark.integration]

TRIM = 300


async def _append(cluster: Cluster, client_id: int, partition: int, count: int) -> None:
    async with ClusterWatcher(cluster.zk, cluster.root) as watcher:
        client = await RawClient(watcher, client_id, partition).start()
        try:
            await asyncio.wait_for(asyncio.gather(*await append_stream(client, count, size_bytes=64)), 60)
        finally:
            await client.aclose()


async def _trim(cluster: Cluster, partition: int, to: int) -> None:
    outcome = await asyncio.to_thread(
        trim_partition, cluster.zk, cluster.root, partition, to=to, min_kept_transactions=100, grace_ms=0
    )
    assert outcome.after == to


async def _refuses_below(cluster: Cluster, partition: int, trim: int) -> bool:
    """Whether every storage node of ``cluster`` refuses a read below ``trim`` (it took the trim point)."""
    for sp in cluster.storages:
        async with await cluster.admin(sp) as client:
            try:
                await client.read_records(partition, trim - 1, 1)
            except TrimmedError:
                continue
            return False
    return True


@pytest.mark.timeout(300)
def test_backup_of_a_trimmed_partition_starts_at_the_trim_point_and_restore_recreates_it(
    cluster_factory: ClusterFactory, tmp_path: Path
) -> None:
    src = cluster_factory(num_partitions=2, root="/source")

    async def body() -> None:
        await src.start(storages=2, servers=1)
        src_yaml = cli_config(src)
        await _append(src, 1, 0, 200)
        await _append(src, 2, 1, 50)
        early = tmp_path / "early"
        rc, _, err = await waltz("backup", "-c", src_yaml, str(early))
        assert rc == 0, err
        await _append(src, 1, 0, 400)
        await _trim(src, 0, TRIM)

        full = tmp_path / "full"
        rc, _, err = await waltz("backup", "-c", src_yaml, str(full))
        assert rc == 0, err
        entries = read_manifest(full).partitions
        assert [(e.first, e.last, e.trim_point) for e in entries] == [(TRIM, 599, TRIM), (0, 49, 0)]
        # The early backup ends at 199, below the trim point: an incremental one cannot continue it.
        rc, _, err = await waltz("backup", "-c", src_yaml, "--since", str(early), str(tmp_path / "incr"))
        assert rc != 0
        assert "partition 0: the previous backup" in err
        assert f"ends at 199, below the trim point {TRIM}" in err
        assert "take a full backup" in err
        # The backup's read path (LogReader range reads) refuses below the trim point, naming it.
        config = ClientConfig(zookeeper_connect_string=src.zk_connect, cluster_root=src.root)
        async with LogReader(config) as reader:
            with pytest.raises(TrimmedError) as e:
                await reader.read_run(0, 5, 10)
            assert (e.value.partition_id, e.value.transaction_id, e.value.trim_point) == (0, 5, TRIM)
        async with await src.admin(src.storages[0]) as client:
            source = await client.read_records(0, TRIM, 300)
        assert [r.transaction_id for r in source] == list(range(TRIM, 600))

        dst = cluster_factory(num_partitions=2, root="/restored")
        await dst.start(storages=2, servers=0)
        dst_yaml = cli_config(dst)
        rc, _, err = await waltz("restore", "-c", dst_yaml, str(full))
        assert rc == 0, err
        points = await asyncio.to_thread(read_trim_points, dst.zk, dst.root)
        assert (points.of(0), points.of(1)) == (TRIM, 0)
        assert await _refuses_below(dst, 0, TRIM)
        for sp in dst.storages:
            assert await dst.max_transaction_id(sp, 0) == 599
            async with await dst.admin(sp) as client:
                assert await client.read_records(0, TRIM, 300) == source

        # A server on the restored cluster answers reads below the trim point with TrimmedError.
        await dst.add_server()
        config = ClientConfig(zookeeper_connect_string=dst.zk_connect, cluster_root=dst.root)
        async with LogReader(config) as reader:
            assert await reader.high_water_mark(0) == 599
            with pytest.raises(TrimmedError) as e:
                await reader.read_range(0, 0, 10)
            assert (e.value.transaction_id, e.value.trim_point) == (0, TRIM)
            assert [r async for r in reader.read(0, TRIM, 599)] == source
            assert len(await reader.read_range(1, 0, 100)) == 50

        async def verified() -> bool:
            return (await verify_lines(dst_yaml))[0] == 0

        await wait_until(verified, 60, "waltz cluster verify to print OK on the restored cluster", 0.5)

    asyncio.run(body())


@pytest.mark.timeout(200)
def test_recover_partition_copies_a_trimmed_partition_from_the_trim_point(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(storage_config={"storage.segment.size.threshold": 4096})

    async def main() -> None:
        await cluster.start(storages=3, servers=1)
        config = cli_config(cluster)
        a, b, c = cluster.storages
        assert (await served(cluster, 1, 600)).hwm == 599
        await _trim(cluster, 0, TRIM)
        await wait_until(lambda: _refuses_below(cluster, 0, TRIM), 30, "every replica to take the trim point")

        # Two replicas wiped: the partition cannot be served until one is copied back.
        await wipe_replicas(config, b, c)
        code, out, err = await recover_partition(config, a, b)
        assert code == 0, err
        assert "copied 300 records" in out
        assert f"holds {TRIM}..599 (trimmed below)" in out
        assert await cluster.max_transaction_id(b) == 599
        async with await cluster.admin(b) as client:
            with pytest.raises(TrimmedError):
                await client.read_records(0, 0, 1)
            copied = await client.read_records(0, TRIM, 300)
        async with await cluster.admin(a) as client:
            assert copied == await client.read_records(0, TRIM, 300)

        async def healthy() -> bool:
            code, lines = await verify_lines(config)
            return code == 0 and lines == ["OK: every partition served, replicated and healthy"]

        await wait_until(healthy, 60, "waltz cluster verify to print OK", 0.5)
        reader_config = ClientConfig(zookeeper_connect_string=cluster.zk_connect, cluster_root=cluster.root)
        async with LogReader(reader_config) as reader:
            assert await reader.high_water_mark(0) == 599
            assert [r.transaction_id for r in await reader.read_range(0, TRIM, 10)] == list(range(300, 310))

    asyncio.run(main())


@pytest.mark.timeout(200)
def test_rebuild_metadata_of_a_trimmed_cluster_records_the_trim_point_again(
    cluster_factory: ClusterFactory,
) -> None:
    """ZooKeeper lost after a trim of everything committed: every replica's newest record is below its trim
    point, so the tool must not read it, and the rebuilt tree carries the trim point again."""
    cluster = cluster_factory()

    async def main() -> None:
        await cluster.start(storages=3, servers=1)
        config = cli_config(cluster)
        assert (await served(cluster, 1, 600)).hwm == 599
        outcome = await asyncio.to_thread(
            trim_partition, cluster.zk, cluster.root, 0, to=600, min_kept_transactions=0, grace_ms=0
        )
        assert outcome.after == 600
        await wait_until(lambda: _refuses_below(cluster, 0, 600), 30, "every replica to take the trim point")
        for server in cluster.servers:
            await asyncio.to_thread(server.stop)
        await asyncio.to_thread(cluster.zk.delete, cluster.root, recursive=True)

        storage_args = [a for sp in cluster.storages for a in ("--storage", admin(sp))]
        code, out, err = await waltz(
            "cluster", "rebuild-metadata", "-c", config, "--name", "test", *storage_args, "--yes"
        )
        assert code == 0, err
        assert "trim point 600" in out
        assert (await asyncio.to_thread(read_trim_points, cluster.zk, cluster.root)).of(0) == 600

        for server in cluster.servers:
            await asyncio.to_thread(server.start)
        reader_config = ClientConfig(zookeeper_connect_string=cluster.zk_connect, cluster_root=cluster.root)
        async with LogReader(reader_config) as reader:
            assert await reader.high_water_mark(0) == 599
            with pytest.raises(TrimmedError) as e:
                await reader.read_range(0, 5, 10)
            assert e.value.trim_point == 600

        async def healthy() -> bool:
            return (await verify_lines(config))[0] == 0

        await wait_until(healthy, 60, "waltz cluster verify to print OK", 0.5)

    asyncio.run(main())
