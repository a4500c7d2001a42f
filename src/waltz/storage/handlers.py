"""The requests a partition worker answers, other than appends (see ``StoragePartition._process``): one
function per request type, found in :data:`HANDLERS` by the message's type. Each checks the partition's
permissions for the request (``StoragePartition.check``) and returns the response; a refused or failed request
raises a :class:`~waltz.errors.WaltzError`, which the worker answers as a failure.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

from waltz.errors import SessionFencedError, StorageError
from waltz.protocol import storage as st
from waltz.storage.partition import PartitionLog
from waltz.storage.replica_check import truncation_refusal
from waltz.storage.retention import DetachedSegments, check_readable, delete_detached, trim_refusal
from waltz.storage.work import (
    MAX_DAMAGED_REPORTED,
    MAX_LIST_BYTES,
    MAX_LIST_RECORDS,
    REFUSAL_LOG_INTERVAL_S,
    Item,
)
from waltz.storage.worker import Handler, StoragePartition

log = logging.getLogger(__name__)


def _last_session_info(part: StoragePartition, item: Item) -> st.StorageMessage:
    msg = item.msg
    assert isinstance(msg, st.LastSessionInfoRequest)
    part.check(msg, msg.used_by_offline_recovery)
    info = part.info
    return st.LastSessionInfoResponse(
        msg.session_id,
        msg.seq_num,
        msg.partition_id,
        st.SessionInfo(
            info.session_id, info.low_water_mark, info.local_low_water_mark, part.lost is not None
        ),
    )


def _max_transaction_id(part: StoragePartition, item: Item) -> st.StorageMessage:
    msg = item.msg
    assert isinstance(msg, st.MaxTransactionIdRequest)
    plog = part.check(msg, msg.offline)
    return st.MaxTransactionIdResponse(msg.session_id, msg.seq_num, msg.partition_id, plog.max_transaction_id)


def _truncate_request(part: StoragePartition, item: Item) -> st.StorageMessage:
    msg = item.msg
    assert isinstance(msg, st.TruncateRequest)
    plog = part.check(msg, msg.offline)
    new_max = _truncate(part, plog, msg, item)
    return st.MaxTransactionIdResponse(msg.session_id, msg.seq_num, msg.partition_id, new_max)


def _record_header(part: StoragePartition, item: Item) -> st.StorageMessage:
    msg = item.msg
    assert isinstance(msg, st.RecordHeaderRequest)
    plog = part.check(msg, False)
    header = plog.read_header(msg.transaction_id)
    return st.RecordHeaderResponse(msg.session_id, msg.seq_num, msg.partition_id, header)


def _record(part: StoragePartition, item: Item) -> st.StorageMessage:
    msg = item.msg
    assert isinstance(msg, st.RecordRequest)
    plog = part.check(msg, False)
    record = plog.read_record(msg.transaction_id)
    if record is not None:
        part.read_bytes.inc(len(record.data))
    return st.RecordResponse(msg.session_id, msg.seq_num, msg.partition_id, record)


def _record_headers(part: StoragePartition, item: Item) -> st.StorageMessage:
    msg = item.msg
    assert isinstance(msg, st.RecordHeaderListRequest)
    plog = part.check(msg, False)
    n = max(0, min(msg.max_records, MAX_LIST_RECORDS))
    headers = plog.read_headers(msg.transaction_id, n, max_bytes=MAX_LIST_BYTES) if n else []
    return st.RecordHeaderListResponse(msg.session_id, msg.seq_num, msg.partition_id, tuple(headers))


def _record_list(part: StoragePartition, item: Item) -> st.StorageMessage:
    msg = item.msg
    assert isinstance(msg, st.RecordListRequest)
    plog = part.check(msg, False)
    n = max(0, min(msg.max_records, MAX_LIST_RECORDS))
    records = plog.read_wire(msg.transaction_id, n, max_bytes=MAX_LIST_BYTES) if n else ()
    part.read_bytes.inc(records.data_bytes if records else 0)
    return st.RecordListResponse(msg.session_id, msg.seq_num, msg.partition_id, records)


def _record_run(part: StoragePartition, item: Item) -> st.StorageMessage:
    msg = item.msg
    assert isinstance(msg, st.RecordRunRequest)
    plog = part.check(msg, False)
    n = max(0, min(msg.max_records, MAX_LIST_RECORDS))
    budget = max(0, min(msg.max_bytes, MAX_LIST_BYTES))
    count, run = plog.read_run(msg.transaction_id, n, max_bytes=budget) if n else (0, b"")
    part.read_bytes.inc(len(run))
    return st.RecordRunResponse(msg.session_id, msg.seq_num, msg.partition_id, count, run)


def _repair(part: StoragePartition, item: Item) -> st.StorageMessage:
    msg = item.msg
    assert isinstance(msg, st.RepairRequest)
    plog = part.check(msg, False)
    part.repaired(plog.repair(msg.records))
    return st.SuccessResponse(msg.session_id, msg.seq_num, msg.partition_id)


def _damaged_records(part: StoragePartition, item: Item) -> st.StorageMessage:
    msg = item.msg
    assert isinstance(msg, st.DamagedRecordsRequest)
    # Session-checked like a read: only the partition's current owner learns (and repairs) them.
    part.check(msg, False)
    n = max(0, min(msg.max_ids, MAX_DAMAGED_REPORTED))
    damaged = tuple(sorted(part.damaged)[:n])
    return st.DamagedRecordsResponse(msg.session_id, msg.seq_num, msg.partition_id, damaged)


def _segment_sizes(part: StoragePartition, item: Item) -> st.StorageMessage:
    msg = item.msg
    assert isinstance(msg, st.SegmentSizesRequest)
    plog = part.check(msg, False)  # session-checked like a read
    sizes = tuple(plog.segment_sizes(max(0, min(msg.max_segments, st.MAX_SEGMENT_SIZES))))
    return st.SegmentSizesResponse(msg.session_id, msg.seq_num, msg.partition_id, sizes)


def _trim_request(part: StoragePartition, item: Item) -> st.StorageMessage:
    msg = item.msg
    assert isinstance(msg, st.TrimRequest)
    in_force = trim(part, part.check(msg, msg.offline), msg.trim_point)
    return st.TrimResponse(msg.session_id, msg.seq_num, msg.partition_id, in_force)


def trim(part: StoragePartition, plog: PartitionLog, trim_point: int) -> int:
    """Raise the trim point (see :mod:`waltz.storage.retention`); returns the one in force."""
    refusal = trim_refusal(part.partition_id, trim_point)
    if refusal is not None:
        raise StorageError(refusal)
    control = part.node.control
    current = control.trim_point(part.partition_id)
    if trim_point <= current and current <= part.durable_max + 1:
        return current
    # Told again a trim point it has, a replica whose log a recovery cut below it (a truncation keeps the
    # records below the trim point that a segment straddling it holds) restarts there too: its catch-up would
    # otherwise ask a source for trimmed ids again and again.
    trim_point = max(trim_point, current)
    if trim_point > current:
        control.set_trim_point(part.partition_id, trim_point)
        log.info("partition %d: trim point raised from %d to %d", part.partition_id, current, trim_point)
    detached: DetachedSegments | None
    if trim_point > part.durable_max + 1:
        # A lagging replica: everything it holds is below the trim point; it starts again there.
        detached = plog.restart_at(trim_point)
        part.durable_max = plog.max_transaction_id
        log.info("partition %d: the log restarts empty at trim point %d", part.partition_id, trim_point)
    else:
        detached = plog.detach_below(trim_point)
    for txn in [t for t in part.damaged if t < trim_point]:
        del part.damaged[txn]  # no longer held, so no longer reported
    if detached is not None:
        part.node.tasks.spawn(_delete(part, detached), name=f"trim-delete-{part.partition_id}")
    return trim_point


async def _delete(part: StoragePartition, detached: DetachedSegments) -> None:
    """Delete trimmed segments' files in a thread, so appends are not blocked (see retention.py)."""
    try:
        freed = await asyncio.to_thread(
            functools.partial(
                delete_detached,
                part.node.fs,
                detached,
                max_bytes_per_second=part.node.config.delete_bytes_per_second,
            )
        )
    except Exception as e:  # noqa: BLE001 - reported; the next open of the log deletes them again
        log.error("partition %d: deleting trimmed segments %s failed: %r", part.partition_id, detached, e)
        return
    log.info(
        "partition %d: deleted %d trimmed segment(s) below transaction %d (%d bytes)",
        part.partition_id,
        len(detached.first_ids),
        detached.end_transaction_id,
        freed,
    )


def _readable(handler: Handler) -> Handler:
    """``handler`` (a read) refusing with TrimmedError a read that starts below the trim point."""

    def checked(part: StoragePartition, item: Item) -> st.StorageMessage:
        start: int = getattr(item.msg, "transaction_id")  # noqa: B009 - every read request has it
        check_readable(part.partition_id, start, part.node.control.trim_point(part.partition_id))
        return handler(part, item)

    return checked


def _truncate(part: StoragePartition, plog: PartitionLog, msg: st.TruncateRequest, item: Item) -> int:
    """A TruncateRequest: refused below the persisted low-water mark unless an operator's repair asks (one
    ERROR line per 10 s); every truncation that cuts records is one INFO line (from, to, why, who)."""
    info = part.info
    before = plog.max_transaction_id
    target = msg.transaction_id
    who = (
        f"{'an offline tool' if msg.offline else 'store session'} {msg.session_id} from "
        f"{item.conn.peername if item.conn is not None else 'this node'}"
    )
    refusal = truncation_refusal(part.partition_id, info, before, target)
    if refusal is not None and not msg.operator_repair:
        now = time.monotonic()
        if now - part.last_truncate_refusal_log_s >= REFUSAL_LOG_INTERVAL_S:
            part.last_truncate_refusal_log_s = now
            log.error("%s (asked by %s: %s)", refusal, who, msg.reason or "no reason given")
        raise StorageError(refusal)
    if refusal is not None:
        # The operator accepts the loss: the marks follow the log down, or the replica would be reported
        # damaged (its log below its local mark) and every later low-water mark refused.
        part.node.control.update(
            part.partition_id,
            low_water_mark=min(info.low_water_mark, target),
            local_low_water_mark=min(info.local_low_water_mark, target),
        )
    new_max = plog.truncate(target)
    part.durable_max = min(part.durable_max, new_max)
    part.forget_damage_above(new_max)
    if new_max < before:
        log.info(
            "partition %d truncated from %d to %d (%s), asked by %s%s",
            part.partition_id,
            before,
            new_max,
            msg.reason or "no reason given",
            who,
            f"; an operator's repair below the low-water mark {info.low_water_mark}, lowered with it"
            if refusal is not None
            else "",
        )
    return new_max


def _set_low_water_mark(part: StoragePartition, item: Item) -> st.StorageMessage:
    # Offline recovery (``waltz storage recover-partition``) ends by persisting the session id of the
    # replica it copied, so the next store session classifies the copy like its source instead of as a
    # restored replica that cannot vote. Offline requests only reach a partition marked unavailable, which
    # no store session writes, and a later session's id is higher still and fences this one as usual.
    msg = item.msg
    assert isinstance(msg, st.SetLowWaterMarkRequest)
    plog = part.check(msg, msg.offline, may_adopt=msg.offline)
    info = part.info
    if msg.session_id < info.session_id:
        raise SessionFencedError(
            f"session {msg.session_id} is older than the persisted session {info.session_id}"
        )
    if msg.low_water_mark < info.low_water_mark or msg.low_water_mark < info.local_low_water_mark:
        raise StorageError(
            f"low-water mark {msg.low_water_mark} is below the persisted marks "
            f"({info.low_water_mark}, {info.local_low_water_mark})"
        )
    max_id = plog.max_transaction_id
    if max_id > msg.low_water_mark:
        raise StorageError(
            f"partition {part.partition_id} holds transaction {max_id} above the low-water mark "
            f"{msg.low_water_mark}; truncate first"
        )
    plog.flush()
    part.node.control.update(
        part.partition_id,
        session_id=msg.session_id,
        low_water_mark=msg.low_water_mark,
        local_low_water_mark=max_id,
    )
    # The fencing id never trails the persisted one (a restart initialises it from there): after an
    # offline adoption, sessions older than the adopted one stay fenced.
    part.session_id = max(part.session_id, msg.session_id)
    if part.lost is not None:
        part.marked_since_lost = True
        part.check_repaired()
    if msg.offline and msg.session_id != info.session_id:
        log.info(
            "partition %d: offline recovery set low-water mark %d and adopted session %d (was %d)",
            part.partition_id,
            msg.low_water_mark,
            msg.session_id,
            info.session_id,
        )
    return st.SuccessResponse(msg.session_id, msg.seq_num, msg.partition_id)


HANDLERS: dict[type[st.StorageMessage], Handler] = {
    st.LastSessionInfoRequest: _last_session_info,
    st.MaxTransactionIdRequest: _max_transaction_id,
    st.TruncateRequest: _truncate_request,
    st.SetLowWaterMarkRequest: _set_low_water_mark,
    st.RecordHeaderRequest: _readable(_record_header),
    st.RecordRequest: _readable(_record),
    st.RecordHeaderListRequest: _readable(_record_headers),
    st.RecordListRequest: _readable(_record_list),
    st.RecordRunRequest: _readable(_record_run),
    st.RepairRequest: _repair,
    st.DamagedRecordsRequest: _damaged_records,
    st.TrimRequest: _trim_request,
    st.SegmentSizesRequest: _segment_sizes,
}
"""The handler of each request type a partition worker answers (appends are group-committed instead)."""
