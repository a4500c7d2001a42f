"""Hostile peers against real processes (issue 15): a forged store session id, an anonymous ZooKeeper write,
a flipped byte in a replica read by ``LogReader.read_run``. Each probe failed on the code before the fix; the
cluster's own clients keep committing beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError

from tests.integration.conftest import ClusterFactory
from tests.integration.raw_client import RawClient
from tests.integration.server_process import Cluster, wait_until
from tests.integration.storage_process import StorageProcess
from waltz.client.config import ClientConfig
from waltz.client.reader import LogReader
from waltz.cluster import store_metadata as sm
from waltz.cluster import zk as zkutil
from waltz.cluster.membership import ClusterWatcher
from waltz.cluster.partition_metadata import PartitionMetadata
from waltz.cluster.zk import ClusterPaths, ZkAuth, digest_id
from waltz.errors import CorruptionError, SessionFencedError
from waltz.protocol.records import Record, ReqId
from waltz.server.storage_client import StorageClient

pytestmark = [pytest.mark.integration]

FORGED_SESSION_ID = 2**62


def _zk_storage_config(cluster: Cluster) -> None:
    # Storage nodes that know the cluster's metadata (as `waltz local` runs them), so they can check ids.
    cluster.storage_config.update(
        {"zookeeper.connectString": cluster.zk_connect, "cluster.root": cluster.root}
    )


async def _append(client: RawClient, n: int, tag: bytes) -> list[int]:
    return [await asyncio.wait_for(client.append_and_wait(tag + b"-%d" % i), 15) for i in range(n)]


@pytest.mark.timeout(90)
def test_a_forged_session_id_fences_nothing_and_persists_nothing(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory()
    _zk_storage_config(cluster)

    async def main() -> None:
        await cluster.start(storages=3, servers=1)
        async with ClusterWatcher(cluster.zk, cluster.root) as watcher:
            client = await RawClient(watcher, 1).start()
            try:
                assert await _append(client, 5, b"before") == list(range(5))
                # The hostile peer knows the cluster key (it was readable in ZooKeeper) and reaches the data
                # ports of two of the three replicas: a quorum of them.
                for sp in cluster.storages[:2]:
                    peer = await StorageClient.connect(
                        "127.0.0.1", sp.port, cluster.cluster_key, cluster.num_partitions
                    )
                    async with peer:
                        with pytest.raises(SessionFencedError, match="never handed out"):
                            await peer.max_transaction_id(FORGED_SESSION_ID, 0)
                        # The second message that persisted the fence in the control file.
                        with pytest.raises(SessionFencedError):
                            await peer.set_low_water_mark(FORGED_SESSION_ID, 0, 2**40)
                # The partition is still served: new transactions commit on the same replicas.
                assert await _append(client, 5, b"after") == list(range(5, 10))
                assert client.violations == []
            finally:
                await client.aclose()
        metadata, _ = sm.read_partition_metadata(cluster.zk, cluster.root, 0)
        for sp in cluster.storages:
            async with await cluster.admin(sp) as admin:
                info = await admin.last_session_info(0)
            assert info.session_id <= metadata.session_id, f"{sp.name} persisted session {info.session_id}"
        for sp in cluster.storages[:2]:
            assert "refused session id" in sp.log_text()

        # A restart of everything finds nothing fenced either.
        for proc in [*cluster.servers, *cluster.storages]:
            await asyncio.to_thread(proc.stop)
        for proc in [*cluster.storages, *cluster.servers]:
            await asyncio.to_thread(proc.start)
        async with ClusterWatcher(cluster.zk, cluster.root) as watcher:
            client = await RawClient(watcher, 2).start()
            try:
                await wait_until(lambda: client.hwm >= 9, 20, "the feed to reach 9 after the restart")
                assert await _append(client, 3, b"restarted") == [10, 11, 12]
            finally:
                await client.aclose()

    asyncio.run(main())


@pytest.mark.timeout(90)
def test_zookeeper_acls_refuse_anonymous_reads_and_writes(
    tmp_path: Path, zk: KazooClient, zk_connect_string: str
) -> None:
    cluster_auth, app_auth = tmp_path / "cluster.auth", tmp_path / "app.auth"
    cluster_auth.write_text("waltz:cluster-secret\n")
    app_auth.write_text("app:app-secret\n")
    reader = digest_id("app:app-secret")
    identity = {"zookeeper.authFile": str(cluster_auth), "zookeeper.aclReaders": reader}
    operator = zkutil.connect(
        zk_connect_string, session_timeout_ms=4000, auth=ZkAuth("waltz:cluster-secret", (reader,))
    )
    app = zkutil.connect(zk_connect_string, session_timeout_ms=4000, auth=ZkAuth("app:app-secret"))
    cluster = Cluster(tmp_path / "c", operator, zk_connect_string, server_config=identity)
    cluster.storage_config.update(identity)
    _zk_storage_config(cluster)

    async def main() -> None:
        await cluster.start(storages=3, servers=1)
        async with ClusterWatcher(operator, cluster.root) as watcher:
            client = await RawClient(watcher, 1).start()
            try:
                assert await _append(client, 3, b"before") == [0, 1, 2]
                paths = ClusterPaths(cluster.root)
                forged = PartitionMetadata(generation=1002, session_id=0).encode(0)
                # Anonymous: cannot read the cluster key, cannot rewrite a partition's metadata or register
                # a fake server.
                with pytest.raises(NoAuthError):
                    zk.get(paths.store)
                with pytest.raises(NoAuthError):
                    zk.set(paths.partition(0), forged)
                with pytest.raises(NoAuthError):
                    zk.create(paths.server_descriptor_prefix + "forged", b"x")
                # The application identity reads what discovery needs and takes client ids, nothing more.
                assert sm.read_store_params(app, cluster.root).cluster_key == cluster.cluster_key
                assert sm.next_id(app, cluster.root, "client") >= 1
                with pytest.raises(NoAuthError):
                    app.set(paths.partition(0), forged)
                config = ClientConfig(
                    zookeeper_connect_string=zk_connect_string,
                    cluster_root=cluster.root,
                    zookeeper_auth_file=str(app_auth),
                )
                async with LogReader(config) as log_reader:
                    assert await log_reader.high_water_mark(0) == 2
                # A server restart (the moment the forged generation used to bite) serves on.
                await asyncio.to_thread(cluster.servers[0].restart)
                assert await _append(client, 3, b"after") == [3, 4, 5]
                assert client.violations == []
            finally:
                await client.aclose()

    try:
        asyncio.run(main())
    finally:
        cluster.stop()
        with contextlib.suppress(Exception):
            operator.delete(cluster.root, recursive=True)
        zkutil.close(app)
        zkutil.close(operator)


def _flip_byte(sp: StorageProcess, partition: int, needle: bytes) -> None:
    """Flip one byte of ``needle`` inside the partition's segment data on disk (the node keeps running)."""
    (seg,) = sorted((sp.directory / str(partition)).glob("*.seg"))
    with seg.open("r+b") as f:
        raw = f.read()
        at = raw.index(needle) + len(needle) - 1
        f.seek(at)
        f.write(bytes([raw[at] ^ 0xFF]))


def _health(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
        return dict(json.loads(r.read()))


@pytest.mark.timeout(90)
def test_a_flipped_byte_in_one_replica_is_read_around_reported_and_repaired(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory()

    async def main() -> None:
        await cluster.start(storages=3, servers=1)
        bad = cluster.storages[0]
        async with ClusterWatcher(cluster.zk, cluster.root) as watcher:
            client = await RawClient(watcher, 1).start()
            try:
                ids = [await client.append_and_wait(b"record-%04d" % i) for i in range(60)]
                assert ids == list(range(60))
                _flip_byte(bad, 0, b"record-0017")
                config = ClientConfig(zookeeper_connect_string=cluster.zk_connect, cluster_root=cluster.root)
                async with LogReader(config) as reader:
                    # Bulk reads (the Spark path): each picks a replica at random; every one must verify,
                    # while another client keeps committing.
                    for i in range(30):
                        run = await reader.read_run(0, 0, 60)
                        records = run.records()
                        assert [r.data for r in records] == [b"record-%04d" % n for n in range(60)]
                        assert await client.append_and_wait(b"more-%d" % i) == 60 + i
                assert client.violations == []
            finally:
                await client.aclose()
        assert "stored transaction 17 is damaged" in bad.log_text()
        server = cluster.servers[0]
        health = await asyncio.to_thread(_health, server.http_port)
        assert health["damagedReplicaReads"]["0"] == {Cluster.address(bad): ANY_POSITIVE}

        async def repaired() -> bool:
            async with await cluster.admin(bad) as admin:
                try:
                    (rec,) = await admin.read_records(0, 17, 1)
                except CorruptionError:
                    return False
            return rec.data == b"record-0017" and rec.verify()

        await wait_until(repaired, 20, "the damaged copy to be repaired from a good replica")
        async with await cluster.admin(bad) as admin:
            assert json.loads(await admin.metrics_json())["partitions"]["0"]["damagedTransactions"] == []

    asyncio.run(main())


class _AnyPositive:
    def __eq__(self, other: object) -> bool:
        return isinstance(other, int) and other > 0

    def __hash__(self) -> int:
        return 0


ANY_POSITIVE: Any = _AnyPositive()


@pytest.mark.timeout(60)
def test_the_background_scrub_finds_a_flipped_byte_nobody_read(tmp_path: Path) -> None:
    config = {"storage.scrub.bytesPerSecond": 10_000_000, "storage.scrub.pauseMs": 100}
    with StorageProcess(tmp_path, config=config).start() as sp:

        async def main() -> None:
            admin = await sp.admin_client()
            data = await sp.data_client()
            async with admin, data:
                await admin.set_assigned([0], True)
                batch = [Record.build(i, ReqId.of(1, 1, 0, i), 0, b"scrubbed-%04d" % i) for i in range(200)]
                await data.append(0, 0, batch)
                _flip_byte(sp, 0, b"scrubbed-0150")

                async def found() -> bool:
                    metrics = json.loads(await admin.metrics_json())
                    return bool(metrics["partitions"]["0"]["damagedTransactions"] == [150])

                await wait_until(found, 20, "the scrub to report transaction 150 damaged")
                assert "stored transaction 150 is damaged" in sp.log_text()
                # Repaired from a good copy (as a server does after a read found it), it verifies again.
                await data.repair(0, 0, batch[150:151])
                (rec,) = await admin.read_records(0, 150, 1)
                assert rec == batch[150]
                assert json.loads(await admin.metrics_json())["partitions"]["0"]["damagedTransactions"] == []

        asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_control_entry_with_both_copies_corrupt_takes_down_only_its_partition(tmp_path: Path) -> None:
    sp = StorageProcess(tmp_path)
    batch = [Record.build(i, ReqId.of(1, 1, 0, i), 0, b"kept-%d" % i) for i in range(5)]

    async def fill() -> None:
        admin = await sp.admin_client()
        data = await sp.data_client()
        async with admin, data:
            await admin.set_assigned([0, 1], True)
            await data.append(0, 0, batch)
            await data.append(0, 1, batch)

    async def after_restart() -> None:
        admin = await sp.admin_client()
        data = await sp.data_client()
        async with admin, data:
            # Partition 0 serves on; partition 1 is down with a reason that says what to do.
            assert await data.read_records(0, 0, 0, 10) == batch
            with pytest.raises(CorruptionError, match="control file entry is damaged"):
                await data.read_records(0, 1, 0, 10)
            metrics = json.loads(await admin.metrics_json())
            assert list(metrics["damagedControlEntries"]) == ["1"]
            # The repair path: remove the replica with its files (it is then copied again from the others).
            with pytest.raises(CorruptionError, match="unassign it with its files deleted"):
                await admin.set_assigned([1], True)
            await admin.set_assigned([1], False, delete_files=True)
            await admin.set_assigned([1], True)
            assert await data.max_transaction_id(0, 1) == -1
            await data.append(0, 1, batch[:1])
            assert json.loads(await admin.metrics_json())["damagedControlEntries"] == {}

    with sp.start():
        asyncio.run(fill())
    sp.stop()
    control = sp.directory / "waltz-storage.ctl"
    raw = bytearray(control.read_bytes())
    entry = 128 + 76 * 1  # header, then 76 bytes per partition: id, struct A, struct B
    raw[entry + 4 + 5] ^= 0xFF
    raw[entry + 40 + 5] ^= 0xFF
    control.write_bytes(bytes(raw))
    with sp.start():
        asyncio.run(after_restart())
    assert "partition 1 is down on this node" in sp.log_text()
