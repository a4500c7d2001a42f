"""``waltz storage recover-partition``: copy a partition into one replica from a healthy one, offline.

This is the way back after replicas were lost or wiped (``waltz storage remove-partition -d --force``, a
replaced disk): a store session cannot open while fewer than a quorum of a partition's replicas can vote, and
a wiped replica cannot vote (recovery classifies it *restored*, see ``docs/replication.md``). The steps, as
the original's ``StorageRecoveryRunnable`` with the changes noted:

1. The destination's partition is assigned if it is not, and marked **offline** (unavailable): no store
   session reads or writes it while it is rebuilt, and offline requests are refused on an online replica.
2. The source is checked against ZooKeeper's record of the last session (the same classification recovery
   uses): a replica that votes (or a laggard) is copied whole; a replica ZooKeeper records closed is copied
   up to its closing mark; an untrusted one up to its clean point; a restored or unlisted one is refused.
   The original always stopped at the source's local low-water mark, which drops everything the last store
   session wrote: here that is the whole point of the copy.
3. The destination is truncated to its own low-water mark, then records are read from the source's admin
   port batch by batch (checked: dense ids and record checksums), appended offline and fsynced, and the
   destination's low-water mark is advanced after each batch, so an interrupted run resumes where it stopped.
4. The last low-water mark is written with the source's session id, so the next store session classifies the
   copy like its source. The destination is then brought back online (unless asked not to), and the owning
   server's waiting recovery looks at it again within about a second (the store's idle probe interval).

Two separate overrides, each for one risk the operator accepts by name:

* ``untrusted_source`` (``--untrusted-source``): copy from a source recovery would not trust (restored, or not
  listed in ZooKeeper), when no trustworthy replica is left;
* ``shorten_destination`` (``--shorten-destination``): cut a destination that holds more records than the copy
  gives it (without it, such a destination is the better copy and the tool refuses). Cutting below a replica's
  persisted low-water mark is a repair the storage node must be told about (:func:`repair_truncate`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from waltz.cluster.partition_metadata import PartitionMetadata
from waltz.errors import ConfigError, CorruptionError, StorageError, TrimmedError
from waltz.ops.progress import PartitionCopyProgress
from waltz.ops.view import ClusterView
from waltz.protocol.records import Record
from waltz.protocol.storage import SessionInfo as WireSessionInfo
from waltz.server.storage_client import AdminClient, StorageClient
from waltz.server.store.interfaces import SessionInfo
from waltz.server.store.recovery import ReplicaClass, classify_replica

log = logging.getLogger(__name__)

DEFAULT_BATCH_RECORDS = 500
MAX_BATCH_RECORDS = 10_000
"""A storage node answers at most this many records per list request."""


@dataclass(frozen=True)
class RecoveryResult:
    partition: int
    source: str
    destination: str
    source_class: ReplicaClass | None
    target: int
    """The destination's max transaction id (and low-water mark) after the copy."""
    copied: int
    session_id: int
    """The session id the destination now carries."""
    destination_class: ReplicaClass | None
    """How the next store session will classify the destination (``None`` without ZooKeeper metadata)."""
    online: bool
    elapsed_s: float
    trim_point: int = 0
    """The source's trim point if the destination restarted at it (holding nothing below it), else 0."""


def _store_info(info: WireSessionInfo) -> SessionInfo:
    return SessionInfo(info.session_id, info.low_water_mark, info.local_low_water_mark, info.damaged)


def copy_target(
    metadata: PartitionMetadata | None,
    source: str,
    info: WireSessionInfo,
    max_id: int,
    *,
    untrusted_source: bool = False,
) -> tuple[int, ReplicaClass | None]:
    """How far the source may be copied, from ZooKeeper's record of the last session (see the module doc).
    A damaged source (its node found it lost records it held) is refused whatever the flags: it is what
    needs the repair. A damaged destination is fine."""
    if info.damaged:
        raise ConfigError(
            f"source {source} holds a damaged replica (its node found it lost records it held: see its "
            "ERROR line, /health or its metrics' replicaDamaged): copying it would spread the loss; pick "
            "another source (this one is repaired by a copy into it)"
        )
    if metadata is None or not metadata.replicas:
        return max_id, None
    c = classify_replica(metadata, source, _store_info(info), max_id)
    if c.kind in (ReplicaClass.RESTORED, ReplicaClass.NEW) and not untrusted_source:
        raise ConfigError(
            f"source {source} is not a trustworthy copy of the partition (recovery classifies it "
            f"{c.kind.value}: "
            + (
                "its session is older than ZooKeeper's record of it, as after a wipe or a restore"
                if c.kind is ReplicaClass.RESTORED
                else "ZooKeeper does not list it as a replica"
            )
            + "); pick another source, or give --untrusted-source"
        )
    if c.kind in (ReplicaClass.RESTORED, ReplicaClass.NEW):
        return max_id, c.kind  # no trustworthy replica is left: copy everything this one holds
    target = max_id if c.truncate_to is None else min(max_id, c.truncate_to)
    return target, c.kind


def _checked_request(
    view: ClusterView, partition: int, source: str, destination: str, batch_records: int
) -> tuple[str, str]:
    """The source and destination of a valid :func:`recover_partition` request; ConfigError otherwise."""
    view.check_partition(partition)
    source, destination = view.check_storage(source), view.check_storage(destination)
    if source == destination:
        raise ConfigError("the source and the destination are the same storage node")
    if not 1 <= batch_records <= MAX_BATCH_RECORDS:
        raise ConfigError(f"the batch size must be 1..{MAX_BATCH_RECORDS}, got {batch_records}")
    return source, destination


async def _prepare_destination(
    dst_admin: AdminClient,
    dst: StorageClient,
    partition: int,
    source: str,
    destination: str,
    target: int,
    shorten_destination: bool,
) -> tuple[WireSessionInfo, int]:
    """Take the destination's replica offline (assigning it first if needed) and cut it to its clean point
    (and to ``target`` with ``shorten_destination``); return its session info and the id it now ends at.
    Raises ConfigError, having changed only its availability, if it holds more than ``target``."""
    statuses = {s.partition_id: s.available for s in await dst_admin.partition_statuses()}
    if partition not in statuses:
        log.info("assigning partition %d on %s", partition, destination)
        await dst_admin.set_assigned([partition], True)
    await dst_admin.set_available([partition], False)
    log.info("partition %d on %s is offline for recovery from %s", partition, destination, source)

    info = await dst_admin.last_session_info(partition)
    dst_max = await dst_admin.max_transaction_id(partition)
    if dst_max > target and not shorten_destination:
        raise ConfigError(
            f"{destination} holds partition {partition} up to {dst_max}, beyond what {source} can give "
            f"({target}): it is the better copy; nothing was changed but its availability (give "
            "--shorten-destination to cut it to the source's copy anyway)"
        )
    session = info.session_id
    current = dst_max
    if current > info.low_water_mark:
        # Anything above the destination's clean point may be a dirty tail: copy it again from the source.
        current = await dst.truncate(
            session,
            partition,
            info.low_water_mark,
            offline=True,
            reason=f"recover-partition from {source}: above the destination's clean point",
        )
    if current > target:  # --shorten-destination: cut it down to what the source gives
        current = await repair_truncate(
            dst,
            session,
            partition,
            target,
            reason=f"recover-partition --shorten-destination from {source}",
        )
    return info, current


async def _finish_destination(
    dst_admin: AdminClient,
    metadata: PartitionMetadata | None,
    partition: int,
    destination: str,
    current: int,
    leave_offline: bool,
) -> tuple[WireSessionInfo, ReplicaClass | None]:
    """The destination's final control info and class (None without metadata); back online unless told."""
    final = await dst_admin.last_session_info(partition)
    dst_class = None
    if metadata is not None and metadata.replicas:
        dst_class = classify_replica(metadata, destination, _store_info(final), current).kind
    if not leave_offline:
        await dst_admin.set_available([partition], True)
        log.info("partition %d on %s is online again, holding 0..%d", partition, destination, current)
    return final, dst_class


async def recover_partition(
    view: ClusterView,
    partition: int,
    source: str,
    destination: str,
    *,
    batch_records: int = DEFAULT_BATCH_RECORDS,
    untrusted_source: bool = False,
    shorten_destination: bool = False,
    leave_offline: bool = False,
    progress: Callable[[PartitionCopyProgress], None] | None = None,
) -> RecoveryResult:
    """Copy ``partition`` from ``source`` into ``destination`` (storage data addresses, as in ZooKeeper).

    Raises ConfigError for a refused request (unknown node or partition, untrusted source, a destination
    that holds more), and Waltz storage errors if a node fails; the destination then stays offline and a
    second run resumes from its low-water mark.
    """
    source, destination = _checked_request(view, partition, source, destination, batch_records)
    metadata = view.metadata(partition)
    started = time.monotonic()
    async with (
        view.admin(source) as src,
        view.admin(destination) as dst_admin,
        view.data(destination) as dst,
    ):
        src_info = await src.last_session_info(partition)
        src_max = await src.max_transaction_id(partition)
        target, src_class = copy_target(
            metadata, source, src_info, src_max, untrusted_source=untrusted_source
        )
        info, current = await _prepare_destination(
            dst_admin, dst, partition, source, destination, target, shorten_destination
        )
        session = info.session_id  # the destination's: the copy writes under it
        floor = max(info.low_water_mark, info.local_low_water_mark)
        first = current + 1
        total = max(0, target - current)

        def on_batch(current: int) -> None:
            if progress is not None:
                done, elapsed_s = current - first + 1, time.monotonic() - started
                progress(PartitionCopyProgress(done, total, elapsed_s, partition, current + 1, target))

        restarts: list[int] = []
        current = await copy_records(
            src, dst, session, partition, current, target, floor, batch_records, on_batch, restarts.append
        )
        if restarts:
            total = max(0, current - (restarts[-1] - 1))
        # Carry the source's session id, so the copy is classified like its source (see node.py).
        adopted = max(session, src_info.session_id)
        if adopted != session and current >= floor:
            await dst.set_low_water_mark(adopted, partition, current, offline=True)
        final, dst_class = await _finish_destination(
            dst_admin, metadata, partition, destination, current, leave_offline
        )
    return RecoveryResult(
        partition=partition,
        source=source,
        destination=destination,
        source_class=src_class,
        target=current,
        copied=total,
        session_id=final.session_id,
        destination_class=dst_class,
        online=not leave_offline,
        elapsed_s=time.monotonic() - started,
        trim_point=restarts[-1] if restarts else 0,
    )


async def repair_truncate(
    dst: StorageClient, session: int, partition: int, transaction_id: int, *, reason: str = "operator repair"
) -> int:
    """Cut an offline replica to ``transaction_id``, possibly below its persisted low-water mark: the one
    place operator repairs send such a truncate (``--shorten-destination``, ``waltz cluster accept-loss``).

    The seam for the storage node's operator-repair flag: a node that refuses a truncate below its low-water
    mark unless the request says it is a repair gets that flag here and nowhere else.
    """
    log.info("partition %d on %s: repair truncate to %d", partition, dst.address, transaction_id)
    return await dst.truncate(
        session, partition, transaction_id, offline=True, operator_repair=True, reason=reason
    )


async def copy_records(
    src: AdminClient,
    dst: StorageClient,
    session: int,
    partition: int,
    current: int,
    target: int,
    floor: int,
    batch_records: int,
    on_batch: Callable[[int], None] | None = None,
    on_restart: Callable[[int], None] | None = None,
) -> int:
    """Copy ``current + 1 .. target`` from ``src`` (admin reads, checked: dense ids, checksums) into the
    offline ``dst`` batch by batch, fsynced, advancing the destination's low-water mark once it passes
    ``floor`` (a low-water mark never goes down), so an interrupted copy resumes. Returns the new max id.

    A destination that lacks what the source trimmed is given the source's trim point and starts its log
    there, as a lagging replica does in a store session: a replica need not hold what is below it
    (``on_restart`` hears the trim point)."""
    while current < target:
        want = min(batch_records, target - current)
        try:
            records = await src.read_records(partition, current + 1, want)
        except TrimmedError as e:
            current = await _restart_at_trim_point(
                dst, session, partition, current, e.trim_point, src.address
            )
            if on_restart is not None:
                on_restart(e.trim_point)
            if current >= floor:
                await dst.set_low_water_mark(session, partition, current, offline=True)
            continue
        if not records:
            raise StorageError(f"{src.address} returned no records at {current + 1} (below {target})")
        _check_batch(src.address, records, current + 1)
        await dst.append(session, partition, records, offline=True)
        current += len(records)
        if current >= floor:
            await dst.set_low_water_mark(session, partition, current, offline=True)
        if on_batch is not None:
            on_batch(current)
    return current


async def _restart_at_trim_point(
    dst: StorageClient, session: int, partition: int, current: int, trim_point: int, source: str
) -> int:
    """Give the offline destination (holding up to ``current``) the source's trim point: its log restarts
    empty there. Returns its new max id (``trim_point - 1``)."""
    await dst.trim(session, partition, trim_point, offline=True)
    max_id = await dst.max_transaction_id(session, partition, offline=True)
    if max_id < trim_point - 1:
        raise StorageError(
            f"{dst.address} did not restart partition {partition} at trim point {trim_point} "
            f"(max id {max_id})"
        )
    log.info(
        "partition %d on %s: %s trimmed below %d, and the destination holds up to %d: it starts at the trim "
        "point",
        partition,
        dst.address,
        source,
        trim_point,
        current,
    )
    return max_id


def _check_batch(source: str, records: list[Record], first: int) -> None:
    for i, r in enumerate(records):
        if r.transaction_id != first + i:
            raise CorruptionError(f"{source} returned transaction {r.transaction_id}, expected {first + i}")
        if not r.verify():
            raise CorruptionError(f"{source}: transaction {r.transaction_id} fails its checksum")
