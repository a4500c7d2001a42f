"""The admin port of a storage node."""

from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import TYPE_CHECKING, Any

from waltz.cluster.features import SUPPORTED_FEATURES
from waltz.errors import (
    ClosedResourceError,
    ClusterKeyMismatchError,
    ConnectionError_,
    CorruptionError,
    PartitionNotAssignedError,
    RemoteProtocolError,
    WaltzError,
)
from waltz.protocol import admin as adm
from waltz.protocol import storage as st
from waltz.storage.controlfile import FLAG_AVAILABLE
from waltz.storage.data_port import peer_refused
from waltz.storage.partition import delete_log_files
from waltz.storage.retention import check_readable
from waltz.storage.work import MAX_LIST_BYTES, MAX_LIST_RECORDS
from waltz.transport import (
    FramedConnection,
    RateLimitedLog,
    reason_kind,
)
from waltz.version import __version__

if TYPE_CHECKING:
    from waltz.storage.services import NodeServices

log = logging.getLogger(__name__)
_peer_warnings = RateLimitedLog(log)


async def assign(node: NodeServices, pid: int, assigned: bool, delete_files: bool = False) -> None:
    part = node.partitions[pid] if 0 <= pid < len(node.partitions) else None
    if part is None:
        raise PartitionNotAssignedError(f"Partition:{pid} does not exist.")

    def op() -> None:
        if pid in node.control.damaged:
            # The entry no longer says which session this replica took part in: its files cannot be
            # trusted either. Only removing them resets the entry (the replica is then re-copied).
            if assigned or not delete_files:
                raise CorruptionError(
                    f"partition {pid}'s control file entry is damaged on this node "
                    f"({node.control.damaged[pid]}); unassign it with its files deleted first"
                )
            node.control.reset(pid)
            node.control.update(pid, flags=FLAG_AVAILABLE)
            part.session_id = -1
            part.damaged.clear()  # The records it named are gone or no longer this node's business.
            part.close_log()
            delete_log_files(node.fs, os.path.join(node.config.directory, str(pid)))
            return
        if assigned:
            part.open_log()
            node.control.set_assigned(pid, True)
        else:
            node.control.update(
                pid, session_id=-1, low_water_mark=-1, local_low_water_mark=-1, flags=FLAG_AVAILABLE
            )
            part.session_id = -1
            part.lost = None  # the entry no longer describes anything this node held
            part.damaged.clear()  # The records it named are gone or no longer this node's business.
            part.close_log()
            if delete_files:
                # Never opened for deletion: a log that would not open (corrupt) must still go.
                delete_log_files(node.fs, os.path.join(node.config.directory, str(pid)))

    was = part.info.assigned
    await node.on_partition(pid, op)
    if assigned and not was:
        log.info(
            "partition %d assigned (max transaction id %d)",
            pid,
            part.log.max_transaction_id if part.log else -1,
        )
    elif not assigned and was:
        log.info("partition %d unassigned%s", pid, "; its files were deleted" if delete_files else "")


async def set_available(node: NodeServices, pid: int, available: bool) -> None:
    part = node.partitions[pid] if 0 <= pid < len(node.partitions) else None
    was = part.info.available if part is not None else None
    await node.on_partition(pid, lambda: node.control.set_available(pid, available))
    if was is not None and was != available:
        log.info("partition %d is now %s", pid, "available (online)" if available else "offline")


def statuses(node: NodeServices) -> list[adm.PartitionStatus]:
    out = []
    for p in node.partitions:
        info = p.info
        if p.partition_id in node.control.damaged:
            out.append(adm.PartitionStatus(p.partition_id, False))  # held here, and down
        elif info.assigned:
            out.append(adm.PartitionStatus(p.partition_id, info.assigned and info.available))
    return out


def metrics_json(node: NodeServices) -> str:
    transactions, entries = node.damage_report()
    parts: dict[str, Any] = {}
    for p in node.partitions:
        info = p.info
        if not info.assigned:
            continue
        parts[str(p.partition_id)] = {
            "sessionId": info.session_id,
            "fencingSessionId": p.session_id,
            "lowWaterMark": info.low_water_mark,
            "localLowWaterMark": info.local_low_water_mark,
            "flags": info.flags,
            "available": info.available,
            "replicaDamaged": p.lost,
            "maxTransactionId": p.log.max_transaction_id if p.log is not None else -1,
            "trimPoint": node.control.trim_point(p.partition_id),
            "queueSize": len(p.queue),
            "fsyncs": p.fsync_count,
            "threadedFsyncs": p.threaded_fsync_count,
            "extendingWrites": p.extending_writes,
            "preallocatedBytes": p.preallocated_bytes,
            "damagedTransactions": transactions.get(str(p.partition_id), []),
        }
    return json.dumps(
        {"partitions": parts, "numPartitions": len(node.partitions), "damagedControlEntries": entries},
        indent=2,
        sort_keys=True,
    )


async def admin_request(node: NodeServices, msg: adm.AdminMessage, opened: bool) -> adm.AdminMessage:
    seq = msg.seq_num
    if not opened:
        raise ClusterKeyMismatchError("the admin connection has not been opened with the cluster key")
    if isinstance(msg, adm.PartitionAssignmentRequest):
        for pid in msg.partition_ids:
            await assign(node, pid, msg.assigned, msg.delete_storage_files)
        return adm.AdminSuccessResponse(seq)
    if isinstance(msg, adm.PartitionAvailableRequest):
        for pid in msg.partition_ids:
            await set_available(node, pid, msg.available)
        return adm.AdminSuccessResponse(seq)
    if isinstance(msg, adm.RecordListRequest):
        pid = msg.partition_id

        def read() -> list[Any]:
            plog = node.partitions[pid].log
            if plog is None:
                raise PartitionNotAssignedError(f"Partition:{pid} is not assigned.")
            check_readable(pid, msg.transaction_id, node.control.trim_point(pid))
            n = max(0, min(msg.max_records, MAX_LIST_RECORDS))
            return plog.read_records(msg.transaction_id, n, max_bytes=MAX_LIST_BYTES) if n else []

        records = await node.on_partition(pid, read)
        return adm.RecordListResponse(seq, pid, tuple(records))
    if isinstance(msg, adm.LastSessionInfoRequest):
        pid = msg.partition_id
        if not 0 <= pid < len(node.partitions):
            raise PartitionNotAssignedError(f"Partition:{pid} does not exist.")
        part = node.partitions[pid]
        info = part.info
        damaged = part.lost is not None  # as the data port says it (see waltz.storage.handlers)
        return adm.LastSessionInfoResponse(
            seq,
            pid,
            st.SessionInfo(info.session_id, info.low_water_mark, info.local_low_water_mark, damaged),
        )
    if isinstance(msg, adm.MaxTransactionIdRequest):
        pid = msg.partition_id

        def max_id() -> int:
            plog = node.partitions[pid].log
            if plog is None:
                raise PartitionNotAssignedError(f"Partition:{pid} is not assigned.")
            return plog.max_transaction_id

        return adm.MaxTransactionIdResponse(seq, pid, await node.on_partition(pid, max_id))
    if isinstance(msg, adm.MetricsRequest):
        return adm.MetricsResponse(seq, metrics_json(node))
    if isinstance(msg, adm.AssignedPartitionStatusRequest):
        return adm.AssignedPartitionStatusResponse(seq, tuple(statuses(node)))
    raise RemoteProtocolError(f"{type(msg).__name__} is not an admin request")


async def serve_admin(node: NodeServices, conn: FramedConnection) -> None:
    if peer_refused(node, conn, "admin"):
        return
    opened = False
    version = conn.negotiated_version
    with contextlib.suppress(ConnectionError_):
        while True:
            payload = await conn.receive()
            try:
                msg = adm.decode(payload, version)
            except RemoteProtocolError as e:
                _peer_warnings.warning(
                    conn.source,
                    reason_kind("admin-decode", e),
                    "closing admin connection from %s: %s",
                    conn.peername,
                    e,
                )
                return
            resp: adm.AdminMessage
            try:
                if isinstance(msg, adm.NodeIdentityRequest):
                    # Before the open on purpose: a tool rebuilding lost metadata learns the key here.
                    resp = adm.NodeIdentityResponse(
                        msg.seq_num, node.control.key, node.control.num_partitions, node.port
                    )
                elif isinstance(msg, adm.NodeVersionRequest):
                    # Before the open too: `waltz cluster raise-features` asks every node.
                    features = SUPPORTED_FEATURES
                    resp = adm.NodeVersionResponse(msg.seq_num, __version__, features.lo, features.hi)
                elif isinstance(msg, adm.AdminOpenRequest):
                    node.check_identity(msg.cluster_key, msg.num_partitions)
                    opened = True
                    resp = adm.AdminSuccessResponse(msg.seq_num)
                else:
                    resp = await admin_request(node, msg, opened)
            except WaltzError as e:
                resp = adm.failure_from_error(msg.seq_num, e)
            try:
                conn.send(adm.encode(resp))
                await conn.drain()
            except ClosedResourceError:
                return
