"""``waltz backup``: an online, consistent copy of every partition up to a cut, while appends go on.

The copy is read from the servers (:class:`~waltz.client.reader.LogReader`), not from storage replicas
directly, for the reasons :mod:`waltz.spark.cluster` gives: the owner of a partition is the one place that
knows its committed high-water mark and which replicas are clean in its current store session, and a range
read relays the storage node's record runs (the bytes of its data file) without decoding them, so reading
through the server costs it one frame per 10,000 records, not work per record.

**The cut.** The high-water mark of every partition is asked of its owner at one moment (all requests sent
together, before any record is read); each partition is then copied up to its mark and no further. Every
record at or below an owner's high-water mark is committed (the mark only moves once a quorum fsynced a batch,
and never goes down), so the backup holds exactly a prefix of each partition's committed log. Partitions are
independent logs in Waltz (no transaction spans two), so marks taken concurrently are a consistent cut: every
transaction acknowledged before the backup started is in it, and for each partition nothing after its mark is.

**Trimmed partitions.** The trim points are read from ZooKeeper (``<root>/store/trim``) just before the
cut: a full backup of a trimmed partition starts at its trim point, and the manifest records the trim point,
so a restore recreates it (reads below it then fail with ``TrimmedError``, as on the source). An incremental
backup whose previous backup ends below the trim point cannot continue it (the ids between were deleted): it
fails with ``TrimmedError`` naming the partition, and a new full backup is needed. A trim raised while the
backup copies fails it the same way; run it again.

**Incremental.** Given the directory of a previous backup (full or incremental) of the same cluster, each
partition is copied from the previous backup's last id + 1; the manifest names its parent, and a restore takes
the chain. The previous backup is verified (manifest hashes) first, and must be of this cluster.

**Bounds.** At most ``concurrency`` partitions are copied at once, each with ``fetch_depth`` range reads of at
most 10,000 records in flight (the server also caps a response's bytes), and each run is written out as it
arrives: memory does not grow with the log.

The file format is :mod:`waltz.ops.backup_format`. A backup that fails or is interrupted leaves no manifest,
so it can never be taken for a complete one; a failure removes the files this run wrote.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from waltz.client.config import ClientConfig
from waltz.client.reader import LogReader
from waltz.cluster import zk
from waltz.cluster.trim_points import TrimPoints, read_trim_points, wall_clock_ms
from waltz.errors import BackupError, TrimmedError, WaltzError
from waltz.ops.backup_format import (
    MANIFEST_NAME,
    BackupManifest,
    FileHeader,
    PartitionEntry,
    PartitionFileWriter,
    fsync_directory,
    manifest_sha256,
    partition_file_name,
    verify_backup,
    write_manifest,
)
from waltz.ops.progress import CopyProgress, OnProgress, records_per_s
from waltz.ops.view import ClusterView, read_view
from waltz.protocol.record_run import RecordRun

__all__ = ["BackupResult", "backup", "run_all"]

T = TypeVar("T")

log = logging.getLogger(__name__)

FETCH_RECORDS = 10_000
"""Records asked for per range read (the server's maximum)."""
DEFAULT_CONCURRENCY = 4
DEFAULT_FETCH_DEPTH = 4
DIAGNOSE_TIMEOUT_S = 10.0
"""Time allowed to ask one replica why a range cannot be read."""
DIAGNOSE_BATCH = 1000


@dataclass(frozen=True)
class BackupResult:
    directory: Path
    manifest: BackupManifest
    records: int
    bytes: int
    elapsed_s: float

    @property
    def records_per_s(self) -> float:
        return records_per_s(self.records, self.elapsed_s)


def _prepare_directory(directory: Path) -> bool:
    """Create the backup directory (True if this run created it); refuse one that holds anything."""
    if directory.exists():
        if not directory.is_dir():
            raise BackupError(f"{directory} exists and is not a directory")
        if any(directory.iterdir()):
            raise BackupError(f"{directory} is not empty: give a new directory for each backup")
        return False
    directory.mkdir(parents=True)
    fsync_directory(directory.parent)
    return True


def _previous(since: Path | None) -> tuple[BackupManifest | None, str | None]:
    if since is None:
        return None, None
    manifest = verify_backup(since, deep=False)
    return manifest, manifest_sha256(since)


async def backup(
    config: ClientConfig,
    directory: Path,
    *,
    since: Path | None = None,
    concurrency: int = DEFAULT_CONCURRENCY,
    fetch_depth: int = DEFAULT_FETCH_DEPTH,
    progress: OnProgress | None = None,
) -> BackupResult:
    """Back up every partition of the cluster ``config`` names into ``directory`` (new or empty),
    incrementally from the backup in ``since`` if given. Returns once the manifest is durable."""
    if concurrency < 1 or fetch_depth < 1:
        raise BackupError(f"concurrency and fetch depth must be positive, got {concurrency}, {fetch_depth}")
    previous, previous_sha = _previous(since)
    created = _prepare_directory(directory)
    written: list[Path] = []
    try:
        async with LogReader(config) as reader:
            key = await reader.cluster_key()
            if previous is not None and since is not None:
                _check_same_cluster(since, previous, key, reader.num_partitions)
            n = reader.num_partitions
            started = time.monotonic()
            created_ms = int(time.time() * 1000)
            # Trim points before the cut, so none is above a mark (a trim is at most a committed mark + 1).
            trims = await asyncio.to_thread(_trim_points, config)
            now_ms = wall_clock_ms()  # a pending trim point whose time has come is in force
            # The cut: every owner is asked at once, before anything is read.
            marks = await asyncio.gather(*(reader.high_water_mark(p) for p in range(n)))
            firsts = _firsts(previous, trims, now_ms, n, since)
            for p in range(n):
                if marks[p] < firsts[p] - 1:
                    raise BackupError(
                        f"partition {p} ends at {marks[p]}, before the previous backup's last id "
                        f"{firsts[p] - 1} ({since}): not the log that backup was taken of"
                    )
            log.info("backup of %s to %s: cut at %s", reader.cluster_name, directory, list(marks))
            counter = _Counter(sum(m - f + 1 for m, f in zip(marks, firsts, strict=True)), started, progress)
            limit = asyncio.Semaphore(concurrency)

            async def one(p: int) -> PartitionEntry:
                async with limit:
                    header = FileHeader(p, key, firsts[p], marks[p])
                    path = directory / partition_file_name(p)
                    written.append(path)
                    entry = await _copy_partition(
                        config, reader, PartitionFileWriter(path, header), fetch_depth, counter
                    )
                    return replace(entry, trim_point=trims.in_force(p, now_ms))

            entries = await run_all(one(p) for p in range(n))
            manifest = BackupManifest(
                uuid.uuid4(),
                created_ms,
                reader.cluster_name,
                key,
                n,
                None if previous is None or previous_sha is None else (previous.backup_id, previous_sha),
                tuple(entries),
            )
            fsync_directory(directory)
            write_manifest(directory, manifest)
    except BaseException:
        _remove(written, directory if created else None)
        raise
    elapsed = time.monotonic() - started
    size = sum(e.bytes for e in manifest.partitions)
    log.info("backup %s complete: %d records, %d bytes in %.1f s", directory, counter.copied, size, elapsed)
    return BackupResult(directory, manifest, counter.copied, size, elapsed)


async def run_all(coros: Iterable[Coroutine[Any, Any, T]]) -> list[T]:
    """Run ``coros`` as tasks of one group and return their results in order; if one fails, the others are
    cancelled and awaited, and its exception (not a group of one) is raised."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(c) for c in coros]
    except BaseExceptionGroup as eg:
        first = eg.exceptions[0]
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None
    return [t.result() for t in tasks]


def _firsts(
    previous: BackupManifest | None, trims: TrimPoints, now_ms: int, n: int, since: Path | None
) -> list[int]:
    """Each partition's first id to copy: its trim point in force for a full backup, the previous backup's
    last + 1 for an incremental one (TrimmedError if that was trimmed: the chain cannot continue)."""
    points = [trims.in_force(p, now_ms) for p in range(n)]
    if previous is None:
        return points
    firsts = [previous.partitions[p].last + 1 for p in range(n)]
    for p in range(n):
        if firsts[p] < points[p]:
            raise TrimmedError(
                f"partition {p}: the previous backup ({since}) ends at {firsts[p] - 1}, below the trim point "
                f"{points[p]} (transactions 0..{points[p] - 1} were trimmed): an incremental backup "
                "cannot continue it; take a full backup",
                partition_id=p,
                transaction_id=firsts[p],
                trim_point=points[p],
            )
    return firsts


def _trim_points(config: ClientConfig) -> TrimPoints:
    client = zk.connect(
        config.zookeeper_connect_string,
        session_timeout_ms=config.zookeeper_session_timeout_ms,
        auth=config.zookeeper_auth(),
    )
    try:
        return read_trim_points(client, config.cluster_root)
    finally:
        zk.close(client)


def _check_same_cluster(since: Path, previous: BackupManifest, key: uuid.UUID, n: int) -> None:
    if previous.cluster_key != key:
        raise BackupError(
            f"{since / MANIFEST_NAME} is a backup of another cluster (key {previous.cluster_key}; this "
            f"cluster's is {key})"
        )
    if previous.num_partitions != n:
        raise BackupError(
            f"{since / MANIFEST_NAME} has {previous.num_partitions} partitions, this cluster has {n}"
        )


class _Counter:
    def __init__(self, total: int, started: float, progress: OnProgress | None) -> None:
        self.total = total
        self.copied = 0
        self.started = started
        self.progress = progress

    def add(self, n: int) -> None:
        self.copied += n
        if self.progress is not None:
            self.progress(CopyProgress(self.copied, self.total, time.monotonic() - self.started))


async def _copy_partition(
    config: ClientConfig, reader: LogReader, writer: PartitionFileWriter, depth: int, counter: _Counter
) -> PartitionEntry:
    """Copy ``writer.header``'s range, ``depth`` range reads in flight; a response the server trimmed (a size
    limit, a segment's end) is followed by a read of what it left out, ahead of the ones already in flight."""
    header = writer.header
    p, end = header.partition, header.last + 1
    pending: deque[tuple[int, int, asyncio.Task[RecordRun]]] = deque()
    asked = header.first
    try:
        position = header.first
        while position < end:
            while len(pending) < depth and asked < end:
                count = min(FETCH_RECORDS, end - asked)
                pending.append((asked, count, asyncio.ensure_future(reader.read_run(p, asked, count))))
                asked += count
            first, count, task = pending.popleft()
            try:
                run = await task
            except TrimmedError:
                raise  # a trim raised during the backup: typed, it names the partition and the trim point
            except (WaltzError, OSError) as e:
                found = await diagnose(config, p, first, count)
                raise BackupError(
                    f"partition {p}: reading transactions {first}..{first + count - 1} failed ({e}); "
                    + (
                        f"the replicas say: {found}"
                        if found
                        else "every replica reads them (a server failure?)"
                    )
                ) from e
            if run.count == 0 or run.first != first:
                raise BackupError(
                    f"partition {p}: the server returned nothing at {first}, below the cut {end - 1}"
                )
            writer.add_run(run.first, run.count, run.run)
            counter.add(run.count)
            position = run.end
            if position < first + count:
                rest = first + count - position
                pending.appendleft(
                    (position, rest, asyncio.ensure_future(reader.read_run(p, position, rest)))
                )
        return writer.finish()
    except BaseException:
        writer.abort()
        for _, _, task in pending:
            task.cancel()
        for _, _, task in pending:
            with contextlib.suppress(BaseException):
                await task
        raise


async def diagnose(config: ClientConfig, partition: int, first: int, count: int) -> str:
    """Why ``first .. first + count - 1`` of ``partition`` cannot be read: each replica is asked for them
    through its admin port, and what each that fails says (a damaged record names its segment file and
    offset) is returned, "" if every replica reads them. Asking cannot fail: a replica that cannot be asked is
    named as such."""
    try:
        view = await asyncio.to_thread(_view, config)
    except WaltzError as e:
        return f"ZooKeeper could not be read to ask the replicas ({e})"
    problems = []
    for storage in view.replicas_of(partition):
        try:
            async with asyncio.timeout(DIAGNOSE_TIMEOUT_S), view.admin(storage) as admin:
                position, end = first, first + count
                while position < end:
                    got = await admin.read_records(partition, position, min(DIAGNOSE_BATCH, end - position))
                    if not got:
                        break
                    position += len(got)
        except (WaltzError, OSError, TimeoutError) as e:
            problems.append(f"{storage}: {e or type(e).__name__}")
    return "; ".join(problems)


def _view(config: ClientConfig) -> ClusterView:
    client = zk.connect(
        config.zookeeper_connect_string,
        session_timeout_ms=config.zookeeper_session_timeout_ms,
        auth=config.zookeeper_auth(),
    )
    try:
        return read_view(client, config.cluster_root, config.tls.client_context("client config"))
    finally:
        zk.close(client)


def _remove(paths: list[Path], directory: Path | None) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            path.unlink()
    with contextlib.suppress(OSError):
        (directory or Path("/nonexistent")).rmdir()
