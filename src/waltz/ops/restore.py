"""``waltz restore``: write a backup (a full backup and the incremental ones after it) into a new, empty
cluster, keeping every record as it was: transaction ids, request ids, headers, data and checksums.

Keeping ids and request ids means writing below a server's append path, as a store session does. The steps,
for each partition that holds records, with no server running (the restore refuses to start while any is
registered):

1. **Take a store session** the way a server does: the next session id by a version-checked write of the
   partition's metadata in ZooKeeper (:func:`waltz.cluster.store_metadata.write_partition_metadata`). Storage
   nodes accept a session id only once the cluster's metadata records it, and its first request on each
   replica fences every older session.
2. **Write every replica**: the backup's blocks are read in order, cut at the restore's point in time,
   unpacked (every checksum verified) and appended to every replica ZooKeeper assigns the partition to, a few
   batches in flight; each append is fsynced before the node answers. Nothing is ever truncated: the target
   is empty.
   A backup of a trimmed partition starts at its trim point: each replica is first given that trim point
   (storage ``TrimRequest``), so its empty log starts there.
3. **Set the low-water mark** of every replica to the restored high-water mark, with the session's id.
4. **Verify** (the end check against the manifest): every replica's records are read back as stored and their
   SHA-256 compared with that of the bytes restored from the backup, whose files were checked against the
   manifest's SHA-256 before anything was written.
5. **Record the session as closed** in ZooKeeper: every replica ``(session, closing high-water mark = the
   restored mark)`` (version-checked). A server started afterwards classifies each replica *closed* at that
   mark (:mod:`waltz.server.store.recovery`), so its recovery resolves exactly the restored high-water mark
   and truncates nothing. The trim point (see below) is recorded in ZooKeeper (``<root>/store/trim``) first,
   so the servers refuse reads below it with ``TrimmedError`` as the source cluster did, not with empty data.

**Trim points.** A partition's restored trim point is the first id its full backup holds, or the trim point
the chain's last manifest recorded if higher (and at most the restored high-water mark + 1). A point in time
below the first id the backup holds is refused.

Before writing anything the restore checks, and refuses with a :class:`~waltz.errors.BackupError` naming the
file or the partition: every backup file against its manifest (size, SHA-256, blocks, record checksums); that
the backups form one chain of one cluster; that the target has as many partitions, every partition has
replicas, no server is registered, and no replica or metadata holds anything (a cluster that already holds
data).

The cluster key is the target's: to keep the source's (so readers' checkpoints and anything keyed on it stay
valid), create the target with it (``waltz cluster create --cluster-key``) before its storage nodes start.

A restore interrupted in step 2 or 3 leaves the target holding part of a partition with no closing mark in
ZooKeeper: start again from a new empty cluster (do not start servers on it).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from kazoo.client import KazooClient

from waltz.cluster import store_metadata as sm
from waltz.cluster.partition_metadata import PartitionMetadata, ReplicaState
from waltz.cluster.trim_points import raise_trim_point
from waltz.errors import BackupError, WaltzError
from waltz.ops.backup import run_all
from waltz.ops.backup_format import BackupManifest, check_chain, iter_blocks, verify_backup
from waltz.ops.progress import CopyProgress, OnProgress, records_per_s
from waltz.ops.view import ClusterView
from waltz.protocol import storage as st
from waltz.protocol.record_run import run_bounds, run_records
from waltz.server.storage_client import StorageClient

__all__ = ["RestoreResult", "plan_restore", "restore"]

log = logging.getLogger(__name__)

MAX_INFLIGHT_BATCHES = 4
"""Appends in flight per replica (each is one block of the backup, at most 10,000 records)."""
DEFAULT_CONCURRENCY = 4
"""Partitions restored at once."""
VERIFY_RECORDS = 10_000
VERIFY_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class RestorePlan:
    """What a restore will write: the backups (oldest first) and each partition's last id to restore."""

    directories: tuple[Path, ...]
    manifests: tuple[BackupManifest, ...]
    targets: tuple[int, ...]
    trim_points: tuple[int, ...] = ()
    """Each partition's trim point to recreate (0: none); empty means none for every partition."""

    def trim_point(self, p: int) -> int:
        return self.trim_points[p] if self.trim_points else 0

    @property
    def total(self) -> int:
        return sum(t + 1 - self.trim_point(p) for p, t in enumerate(self.targets))


@dataclass(frozen=True)
class RestoreResult:
    high_water_marks: tuple[int, ...]
    records: int
    elapsed_s: float

    @property
    def records_per_s(self) -> float:
        return records_per_s(self.records, self.elapsed_s)


def plan_restore(directories: list[Path], until: Mapping[int, int] | None = None) -> RestorePlan:
    """Check the backups (whole: every file against its manifest, every record) and decide each partition's
    last id: the chain's last backup's, or ``until[p]`` if lower (point in time). Reads only files."""
    manifests = [verify_backup(d) for d in directories]
    check_chain(directories, manifests)
    last = manifests[-1]
    targets, trims = [], []
    for entry, full in zip(last.partitions, manifests[0].partitions, strict=True):
        limit = (until or {}).get(entry.partition, entry.last)
        if limit < full.first - 1:
            held = f"the backup holds {full.first}..{entry.last}" + (
                f" (it was trimmed to {full.first})" if full.first > 0 else ""
            )
            raise BackupError(f"partition {entry.partition}: cannot restore up to {limit}: {held}")
        targets.append(min(entry.last, limit))
        trims.append(max(full.first, min(entry.trim_point, targets[-1] + 1)))
    for p in until or {}:
        if not 0 <= p < last.num_partitions:
            raise BackupError(f"partition {p}: the backup has partitions 0..{last.num_partitions - 1}")
    return RestorePlan(tuple(directories), tuple(manifests), tuple(targets), tuple(trims))


async def check_target(view: ClusterView, plan: RestorePlan) -> None:
    """Refuse a target that is not a new, empty cluster ready to take the backup (changes nothing)."""
    n = plan.manifests[-1].num_partitions
    root = view.info.root
    if view.num_partitions != n:
        raise BackupError(f"the cluster at {root} has {view.num_partitions} partitions, the backup {n}")
    if view.info.servers:
        raise BackupError(
            f"servers are registered in the cluster at {root} ({', '.join(sorted(view.info.servers))}): "
            "stop them before restoring"
        )
    for p in range(n):
        if not view.replicas_of(p):
            raise BackupError(f"partition {p} has no storage node assigned in the cluster at {root}")
        metadata = view.metadata(p)
        if metadata is None or metadata.replicas:
            raise BackupError(
                f"the cluster at {root} already holds data: partition {p} has had a store session"
            )
    for storage in sorted({s for p in range(n) for s in view.replicas_of(p)}):
        await _check_storage(view, storage, [p for p in range(n) if storage in view.replicas_of(p)])


async def _check_storage(view: ClusterView, storage: str, partitions: list[int]) -> None:
    """``storage`` holds each of ``partitions`` online and empty."""
    root = view.info.root
    try:
        async with view.admin(storage) as admin:
            statuses = {s.partition_id: s.available for s in await admin.partition_statuses()}
            for p in partitions:
                if p not in statuses:
                    raise BackupError(
                        f"{storage} does not hold partition {p} although ZooKeeper assigns it there: run "
                        "waltz storage sync-partitions first"
                    )
                if not statuses[p]:
                    raise BackupError(f"partition {p} is offline on {storage}")
                info = await admin.last_session_info(p)
                max_id = await admin.max_transaction_id(p)
                if max_id >= 0 or info.low_water_mark >= 0:
                    raise BackupError(
                        f"the cluster at {root} already holds data: {storage} holds partition {p} up to "
                        f"{max_id} (after a restore that stopped part way, start again from a new, empty "
                        "cluster)"
                    )
    except BackupError:
        raise
    except (WaltzError, OSError) as e:
        raise BackupError(f"storage node {storage} of the cluster at {root} cannot be asked: {e}") from e


async def restore(
    client: KazooClient,
    view: ClusterView,
    plan: RestorePlan,
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
    progress: OnProgress | None = None,
) -> RestoreResult:
    """Restore ``plan`` (from :func:`plan_restore`) into the empty cluster of ``view``; see the module doc."""
    await check_target(view, plan)
    started = time.monotonic()
    done = 0

    def advanced(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(CopyProgress(done, plan.total, time.monotonic() - started))

    limit = asyncio.Semaphore(concurrency)

    async def one(p: int, target: int) -> None:
        async with limit:
            await _restore_partition(client, view, plan, p, target, advanced)

    await run_all(one(p, t) for p, t in enumerate(plan.targets) if t >= 0)
    elapsed = time.monotonic() - started
    log.info("restored %d records into %s in %.1f s", done, view.info.root, elapsed)
    return RestoreResult(plan.targets, done, elapsed)


def _blocks(plan: RestorePlan, p: int, target: int) -> Iterator[tuple[int, int, bytes]]:
    """The partition's blocks across the chain from its trim point, the last one cut at ``target``."""
    trim = plan.trim_point(p)
    for directory, manifest in zip(plan.directories, plan.manifests, strict=True):
        entry = manifest.partitions[p]
        for _, first, count, run in iter_blocks(directory / entry.file, entry):
            if first > target:
                return
            if first + count <= trim:
                continue
            if first < trim:  # a later backup recorded a higher trim point: restore from it
                skip = trim - first
                run = run[_offset(run, skip) :]
                first, count = trim, count - skip
            if first + count - 1 > target:
                count = target - first + 1
                run = run[: _offset(run, count)]
            yield first, count, run


def _offset(run: bytes, count: int) -> int:
    """Where the record after the first ``count`` of a verified run starts (each record: 40 bytes + its
    length at offset 28)."""
    pos = 0
    for _ in range(count):
        length = int.from_bytes(run[pos + 28 : pos + 32], "big")
        pos += 40 + length
    return pos


async def _restore_partition(
    client: KazooClient,
    view: ClusterView,
    plan: RestorePlan,
    p: int,
    target: int,
    advanced: Callable[[int], None],
) -> None:
    root = view.info.root
    previous, version = await asyncio.to_thread(sm.read_partition_metadata, client, root, p)
    session = previous.session_id + 1
    claimed = PartitionMetadata(previous.generation, session, {})
    version = await asyncio.to_thread(sm.write_partition_metadata, client, root, p, claimed, version)
    replicas = view.replicas_of(p)
    trim = plan.trim_point(p)
    log.info(
        "partition %d: restoring %d..%d into %s with store session %d",
        p,
        trim,
        target,
        ", ".join(replicas),
        session,
    )
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(view.data(s)) for s in replicas]
        for c in clients:
            await c.last_session_info(session, p)  # fences any older session on that replica
            if trim > 0:
                await c.trim(session, p, trim)  # the empty log starts at the trim point
        written = await _write(clients, session, p, plan, target, advanced)
        for c in clients:
            await c.set_low_water_mark(session, p, target)
        for storage, c in zip(replicas, clients, strict=True):
            await _verify_replica(c, storage, session, p, trim, target, written)
    if trim > 0:
        await asyncio.to_thread(
            raise_trim_point, client, root, p, trim, target, min_kept_transactions=0, grace_ms=0
        )
    closed = PartitionMetadata(
        previous.generation, session, {s: ReplicaState(s, session, target) for s in replicas}
    )
    await asyncio.to_thread(sm.write_partition_metadata, client, root, p, closed, version)
    log.info("partition %d: restored up to %d on %d replicas, verified", p, target, len(replicas))


async def _write(
    clients: list[StorageClient],
    session: int,
    p: int,
    plan: RestorePlan,
    target: int,
    advanced: Callable[[int], None],
) -> str:
    """Append the partition's records to every replica; returns the SHA-256 of the restored record bytes."""
    sha = hashlib.sha256()
    in_flight: list[tuple[int, list[asyncio.Future[object]]]] = []
    try:
        for first, count, run in _blocks(plan, p, target):
            sha.update(run)
            body = st.append_request_body(run_records(run, first, count))
            in_flight.append((count, [c.start_append_encoded(session, p, body) for c in clients]))
            while len(in_flight) >= MAX_INFLIGHT_BATCHES:
                await _settle(in_flight.pop(0), advanced)
        while in_flight:
            await _settle(in_flight.pop(0), advanced)
    finally:
        for _, futures in in_flight:
            for f in futures:
                f.cancel()
    return sha.hexdigest()


async def _settle(batch: tuple[int, list[asyncio.Future[object]]], advanced: Callable[[int], None]) -> None:
    count, futures = batch
    for f in futures:
        answer = await f
        if not isinstance(answer, st.SuccessResponse):
            raise WaltzError(f"unexpected answer to an append: {type(answer).__name__}")
    advanced(count)


async def _verify_replica(
    c: StorageClient, storage: str, session: int, p: int, first: int, target: int, expected_sha: str
) -> None:
    sha = hashlib.sha256()
    position = first
    while position <= target:
        count, run = await c.read_run(
            session, p, position, min(VERIFY_RECORDS, target - position + 1), VERIFY_BYTES
        )
        if count == 0:
            raise BackupError(f"partition {p}: {storage} holds nothing at {position} after the restore")
        run_bounds(run, position, count)
        sha.update(run)
        position += count
    if sha.hexdigest() != expected_sha:
        raise BackupError(f"partition {p}: {storage} does not hold what was restored (SHA-256 differs)")
