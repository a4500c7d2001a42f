"""Disk faults on one of three real storage nodes while a client appends through a real server (issue 14).

* **A full disk**: the node's data directory is a small tmpfs, filled up by a ballast file mid-stream.
* **A failed fsync**: the node runs on the test-only failing file layer
  (:class:`waltz.testing.faultfs.FaultyFileSystem`), told to fail its next data fsync with EIO.

In both: the node says why in one ERROR line and fail-stops the partition; the cluster keeps committing
through the two other replicas (the server logs a WARNING for the replica it lost); once the disk has room
again (the ballast is deleted) or at once (the fsync), the partition heals itself (INFO), and the server,
which kept retrying the replica, brings it back into the writes (INFO) without a restart of anything.
Finally every replica holds the same records up to the high-water mark and every acknowledged append is
there at its id. (Once, a node stayed out of every replica set for minutes after a full disk, even after its
restart, until the owning server restarted.)
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import subprocess
from pathlib import Path

import pytest

from tests.integration.conftest import ClusterFactory
from tests.integration.raw_client import NotCommitted, RawClient, append_stream
from tests.integration.server_process import Cluster, assert_identical, settled_logs, wait_until
from tests.integration.storage_process import StorageProcess
from waltz.cluster.membership import ClusterWatcher
from waltz.protocol.records import Record

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

TMPFS_BYTES = 64 << 20


async def _writer(client: RawClient, stop: asyncio.Event) -> None:
    for f in await append_stream(client, None, size_bytes=256, stop=stop):
        with contextlib.suppress(NotCommitted):
            await f


async def _acks_grow(client: RawClient, by: int, timeout_s: float, what: str) -> None:
    target = client.stats.acknowledged + by
    await wait_until(
        lambda: client.stats.acknowledged >= target, timeout_s, f"{target} acknowledged ({what})"
    )


def _logged(proc: StorageProcess | object, text: str) -> bool:
    return text in proc.log_text()  # type: ignore[attr-defined]


async def _holds_at_least(cluster: Cluster, sp: StorageProcess, n: int) -> bool:
    try:
        return await cluster.max_transaction_id(sp) >= n
    except Exception:  # fail-stopped: not yet
        return False


def _check_acknowledged(client: RawClient, records: list[Record]) -> None:
    by_id = {r.transaction_id: r for r in records}
    for rid, txn in client.acked.items():
        rec = by_id.get(txn)
        assert rec is not None, f"acknowledged {rid!r} at {txn} is missing"
        assert rec.req_id == rid, f"id {txn} holds {rec.req_id!r}, {rid!r} was acknowledged there"


async def _fault_and_recover(cluster: Cluster, inject: object, release: object) -> None:
    """Append; ``inject()`` a fault into storage-2; check it fail-stops and the cluster goes on; ``release()``
    it; check it heals and rejoins; check the final logs."""
    await cluster.start(storages=3, servers=1)
    victim = cluster.storages[2]
    server = cluster.servers[0]
    async with ClusterWatcher(cluster.zk, cluster.root) as watcher:
        client = await RawClient(watcher, 1).start()
        try:
            stop = asyncio.Event()
            writer = asyncio.create_task(_writer(client, stop))
            await _acks_grow(client, 300, 30, "before the fault")
            await asyncio.to_thread(inject)  # type: ignore[operator]
            await wait_until(
                lambda: _logged(victim, "fail-stopped"), 30, "the node to fail-stop the partition"
            )
            assert " ERROR " in next(
                line for line in victim.log_text().splitlines() if "fail-stopped" in line
            )
            # The two other replicas carry on.
            await _acks_grow(client, 500, 30, "while the node is fail-stopped")
            await wait_until(lambda: _logged(server, "is out of the session"), 30, "the server's WARNING")
            await asyncio.to_thread(release)  # type: ignore[operator]
            await wait_until(lambda: _logged(victim, "healed"), 30, "the partition to heal")
            healed_at = client.hwm
            await wait_until(
                lambda: _holds_at_least(cluster, victim, healed_at + 300),
                60,
                "the healed replica to take part in the writes again",
                0.3,
            )
            assert _logged(server, "answers again")
            stop.set()
            await writer
            logs = await settled_logs(cluster, cluster.storages, client.hwm)
            assert_identical(logs, client.hwm)
            _check_acknowledged(client, logs[0])
            assert client.violations == []
        finally:
            await client.aclose()


def test_a_full_disk_fail_stops_the_replica_which_rejoins_when_space_returns(
    cluster_factory: ClusterFactory, tmp_path: Path
) -> None:
    cluster = cluster_factory()
    data = cluster.base / "storage-2-data"  # where StorageProcess puts storage-2's directory
    data.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(data)], check=True)
    ballast = data / "ballast"

    def fill() -> None:
        chunk = bytes(1 << 20)
        with ballast.open("wb") as f:
            while True:
                try:
                    f.write(chunk)
                    f.flush()
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
        # Whatever room the last chunk left is taken by the node's next appends.

    def free() -> None:
        ballast.unlink()

    try:
        asyncio.run(_fault_and_recover(cluster, fill, free))
    finally:
        cluster.stop()
        subprocess.run(["umount", "-l", str(data)], check=False)


def test_a_failed_fsync_fail_stops_the_replica_which_heals_and_rejoins(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory()
    cluster.faulty_storages = {2}

    def fail_next_fsync() -> None:
        cluster.storages[2].fail_next_fsync()

    asyncio.run(_fault_and_recover(cluster, fail_next_fsync, lambda: None))
