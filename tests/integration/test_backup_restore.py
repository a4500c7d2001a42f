"""The runbooks "Back up" and "Restore to a new cluster" of docs/operations.md, step by step, on real clusters
(ZooKeeper, storage processes, server processes), through the ``waltz`` command as an operator runs it.

* A full backup and an incremental one taken while clients keep appending, restored into a new cluster created
  with the source's cluster key: every replica holds every record up to the cut byte for byte (ids, request
  ids, headers, data, checksums); a server started on it serves exactly the restored high-water mark, and
  appends continue from there.
* A point-in-time restore stops each partition at the id asked for.
* Bad input, each one error naming the file or partition that changes nothing: an incremental backup from
  another cluster's backup, a backup file that does not match its manifest, a partial backup (no manifest),
  a restore into a cluster that holds data, an unreadable record in the source.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import shutil
import uuid
from pathlib import Path

import pytest

from tests.integration.conftest import ClusterFactory
from tests.integration.raw_client import RawClient
from tests.integration.server_process import Cluster, wait_until
from waltz.cli.main import main
from waltz.client.config import ClientConfig
from waltz.client.reader import LogReader
from waltz.cluster import store_metadata as sm
from waltz.cluster.membership import ClusterWatcher
from waltz.ops.backup_format import MANIFEST_NAME, read_manifest
from waltz.protocol.records import Record

pytestmark = [pytest.mark.integration]

PARTITIONS = 2
SOURCE_KEY = uuid.UUID("0b5c1d2e-3f40-4a51-8b62-7c83d94ea5f6")


def _cli_yaml(cluster: Cluster) -> Path:
    path = cluster.base.parent / f"cli{cluster.root.replace('/', '-')}.yaml"
    path.write_text(
        f"zookeeper.connectString: {cluster.zk_connect}\n"
        "zookeeper.sessionTimeout: 10000\n"
        f"cluster.root: {cluster.root}\n"
    )
    return path


async def _waltz(*argv: str) -> tuple[int, str, str]:
    """Run the ``waltz`` command in a thread (it runs its own event loop); its exit status, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()

    def run() -> int:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            return main(list(argv))

    rc = await asyncio.to_thread(run)
    return rc, out.getvalue(), err.getvalue()


async def _writers(cluster: Cluster, stop: asyncio.Event, counts: list[int]) -> None:
    """One client per partition appending until ``stop``, each with its own headers and data."""
    async with ClusterWatcher(cluster.zk, cluster.root) as watcher:
        clients = [await RawClient(watcher, 10 + p, p, max_in_flight=32).start() for p in range(PARTITIONS)]

        async def write(p: int, client: RawClient) -> None:
            i = 0
            while not stop.is_set():
                await client.append(f"p{p}-{i}".encode() * (1 + i % 7), header=(p << 20) + i)
                counts[p] += 1
                i += 1
                if i % 200 == 0:
                    await asyncio.sleep(0)  # let the backup run beside the writers

        try:
            await asyncio.gather(*(write(p, c) for p, c in enumerate(clients)))
            for c in clients:
                await c.wait_idle(30)
                assert c.violations == []
        finally:
            for c in clients:
                await c.aclose()


async def _log(cluster: Cluster, upto: list[int]) -> list[list[Record]]:
    """Every replica's records of every partition up to ``upto[p]``: [storage][partition] flattened per
    partition as a list of per-storage lists."""
    out = []
    for p in range(PARTITIONS):
        logs = [await cluster.read_log(sp, p, upto[p]) for sp in cluster.storages]
        out.append(logs)
    return out


async def _empty(cluster: Cluster) -> bool:
    for sp in cluster.storages:
        for p in range(PARTITIONS):
            if await cluster.max_transaction_id(sp, p) != -1:
                return False
    return all(
        not sm.read_partition_metadata(cluster.zk, cluster.root, p)[0].replicas for p in range(PARTITIONS)
    )


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def _target(cluster_factory: ClusterFactory, root: str, key: uuid.UUID | None = None) -> Cluster:
    """A new, empty cluster: ``waltz cluster create`` (here through the library), storage nodes assigned."""
    return cluster_factory(num_partitions=PARTITIONS, root=root, cluster_key=key or uuid.uuid4())


@pytest.mark.timeout(300)
def test_backup_while_appending_then_restore_keeps_every_record(
    cluster_factory: ClusterFactory, tmp_path: Path
) -> None:
    src = cluster_factory(num_partitions=PARTITIONS, root="/source", cluster_key=SOURCE_KEY)

    async def body() -> None:
        await src.start(storages=2, servers=1)
        src_yaml = _cli_yaml(src)
        # `waltz cluster create --cluster-key` (restore runbook step 2) creates a cluster with a given key.
        keyed = src.base.parent / "keyed.yaml"
        keyed.write_text(src_yaml.read_text().replace(src.root, "/keyed"))
        assert (
            await _waltz(
                "cluster", "create", "-c", str(keyed), "-n", "k", "-p", "2", "--cluster-key", str(SOURCE_KEY)
            )
        )[0] == 0
        assert (await _waltz("cluster", "show-cluster-key", "-c", str(keyed)))[1].strip() == str(SOURCE_KEY)
        stop, counts = asyncio.Event(), [0] * PARTITIONS
        writers = asyncio.create_task(_writers(src, stop, counts))
        await wait_until(lambda: min(counts) >= 2000, 60, "2000 appends per partition")

        # Back up (runbook step 2): a full backup while appends go on.
        full, incr = tmp_path / "full", tmp_path / "incr"
        rc, out, err = await _waltz("backup", "-c", str(src_yaml), str(full))
        assert rc == 0, err
        assert "full backup" in out
        assert "records (100%)" in err  # the progress line (stderr is not a terminal here: its last one)
        first_cut = [e.last for e in read_manifest(full).partitions]
        assert min(first_cut) >= 1999
        before = list(counts)
        await wait_until(
            lambda: min(c - b for c, b in zip(counts, before, strict=True)) >= 1000, 60, "1000 more appends"
        )
        rc, out, err = await _waltz("backup", "-c", str(src_yaml), "--since", str(full), str(incr))
        assert rc == 0, err
        assert "incremental backup" in out
        cut = [e.last for e in read_manifest(incr).partitions]
        assert [e.first for e in read_manifest(incr).partitions] == [c + 1 for c in first_cut]
        assert all(c > f for c, f in zip(cut, first_cut, strict=True))
        # Appends went on after the cut: the backup holds a prefix of the log, not all of it.
        await wait_until(
            lambda: min(c - b for c, b in zip(counts, before, strict=True)) >= 1500,
            60,
            "appends after the cut",
        )
        stop.set()
        await writers

        rc, out, err = await _waltz("backup", "--verify", str(full), str(incr), "-c", str(src_yaml))
        assert rc == 0, err
        source = await _log(src, cut)
        for p in range(PARTITIONS):
            assert source[p][0] == source[p][1]
            assert len(source[p][0]) == cut[p] + 1

        # Restore to a new cluster (runbook): created with the source's key, storage nodes assigned, no
        # server.
        dst = _target(cluster_factory, "/restored", read_manifest(full).cluster_key)
        await dst.start(storages=2, servers=0)
        dst_yaml = _cli_yaml(dst)
        rc, out, err = await _waltz("restore", "-c", str(dst_yaml), str(full), str(incr))
        assert rc == 0, err
        assert f"cluster key {SOURCE_KEY} (kept)" in out
        restored = await _log(dst, cut)
        for p in range(PARTITIONS):
            for replica in restored[p]:
                assert replica == source[p][0]  # every field of every record, request ids included
            for sp in dst.storages:
                assert await dst.max_transaction_id(sp, p) == cut[p]

        # A server started afterwards serves exactly the restored high-water mark, and appends go on from it.
        await dst.add_server()
        rc, out, err = await _waltz("client", "high-water-mark", "-c", str(dst_yaml))
        assert rc == 0, err
        assert out.splitlines() == [f"partition {p}: {cut[p]}" for p in range(PARTITIONS)]
        config = ClientConfig(zookeeper_connect_string=dst.zk_connect, cluster_root=dst.root)
        async with LogReader(config) as reader:
            served = [r async for r in reader.read(1, 0, cut[1])]
            assert served == source[1][0]
        async with ClusterWatcher(dst.zk, dst.root) as watcher:
            client = await RawClient(watcher, 99, 0).start()
            try:
                assert await client.append_and_wait(b"after the restore") == cut[0] + 1
            finally:
                await client.aclose()

        async def verified() -> bool:
            return (await _waltz("cluster", "verify", "-c", str(dst_yaml)))[0] == 0

        await wait_until(verified, 30, "waltz cluster verify to print OK")

        # Point in time: a third cluster restored up to chosen ids.
        pit = _target(cluster_factory, "/point-in-time")
        await pit.start(storages=1, servers=0)
        limit = first_cut[0] + 7
        rc, out, err = await _waltz(
            "restore", "-c", str(_cli_yaml(pit)), str(full), str(incr), "--to-transaction", f"0={limit},1=5"
        )
        assert rc == 0, err
        assert "(new: the backup's was" in out
        assert await pit.read_log(pit.storages[0], 0) == source[0][0][: limit + 1]
        assert await pit.read_log(pit.storages[0], 1) == source[1][0][:6]

        # Bad input: a restore into a cluster that already holds data changes nothing.
        again = await _waltz("restore", "-c", str(dst_yaml), str(full))
        assert again[0] != 0
        assert "servers are registered" in again[2]
        dst.servers[0].stop()
        await wait_until(lambda: not sm.read_server_descriptors(dst.zk, dst.root)[0], 30, "server gone")
        rc, out, err = await _waltz("restore", "-c", str(_cli_yaml(pit)), str(full))
        assert rc == 1
        assert "already holds data" in err
        assert "/point-in-time" in err
        assert await pit.max_transaction_id(pit.storages[0], 0) == limit

    asyncio.run(body())


@pytest.mark.timeout(300)
def test_bad_backups_are_refused_naming_the_file(cluster_factory: ClusterFactory, tmp_path: Path) -> None:
    src = cluster_factory(num_partitions=PARTITIONS, root="/source")
    other = cluster_factory(num_partitions=PARTITIONS, root="/other", cluster_key=uuid.uuid4())

    async def body() -> None:
        await src.start(storages=1, servers=1)
        await other.start(storages=1, servers=1)
        async with ClusterWatcher(src.zk, src.root) as watcher:
            client = await RawClient(watcher, 5, 1).start()
            for i in range(300):
                await client.append_and_wait(b"x" * (i % 50))
            await client.aclose()
        src_yaml = _cli_yaml(src)
        full = tmp_path / "full"
        assert (await _waltz("backup", "-c", str(src_yaml), str(full)))[0] == 0
        target = _target(cluster_factory, "/target")
        await target.start(storages=1, servers=0)
        target_yaml = str(_cli_yaml(target))

        # An incremental backup from another cluster's backup: nothing written.
        rc, _, err = await _waltz(
            "backup", "-c", str(_cli_yaml(other)), "--since", str(full), str(tmp_path / "x")
        )
        assert rc == 1
        assert f"{full / MANIFEST_NAME} is a backup of another cluster" in err
        assert not (tmp_path / "x").exists()
        rc, _, err = await _waltz("backup", "--verify", str(full), "-c", str(_cli_yaml(other)))
        assert rc == 1
        assert "another cluster" in err

        # A backup file that does not match its manifest.
        damaged = tmp_path / "damaged"
        shutil.copytree(full, damaged)
        data = bytearray((damaged / "partition-1.wbk").read_bytes())
        data[len(data) // 2] ^= 0x01
        (damaged / "partition-1.wbk").write_bytes(bytes(data))
        for argv in (("backup", "--verify", str(damaged)), ("restore", "-c", target_yaml, str(damaged))):
            rc, _, err = await _waltz(*argv)
            assert rc == 1, err
            assert f"{damaged / 'partition-1.wbk'}: does not match" in err, err

        # A partial or interrupted backup: no manifest.
        partial = tmp_path / "partial"
        shutil.copytree(full, partial)
        (partial / MANIFEST_NAME).unlink()
        rc, _, err = await _waltz("restore", "-c", target_yaml, str(partial))
        assert rc == 1
        assert f"{partial / MANIFEST_NAME} does not exist: a partial or interrupted backup" in err
        assert await _empty(target)

        # A target whose storage node does not hold a partition ZooKeeper assigns it.
        async with await target.admin(target.storages[0]) as admin:
            await admin.set_assigned([1], False)
            rc, _, err = await _waltz("restore", "-c", target_yaml, str(full))
            assert rc == 1
            assert "does not hold partition 1 although ZooKeeper assigns it there" in err
            await admin.set_assigned([1], True)
        assert await _empty(target)

        # An unreadable record in the source (damaged on disk under the running node, which finds it when it
        # reads it): the backup fails naming the partition and leaves nothing behind.
        segment = sorted((src.storages[0].directory / "1").glob("*.seg"))[0]
        _flip_byte(segment, 200)
        rc, _, err = await _waltz(
            "backup", "-c", str(src_yaml), "--request-timeout-ms", "5000", str(tmp_path / "bad-source")
        )
        assert rc == 1, err
        assert "partition 1: reading transactions 0..299 failed" in err, err
        assert f"{segment}: record 1 at offset 168: record checksum mismatch" in err, err
        assert not (tmp_path / "bad-source").exists()

    asyncio.run(body())
