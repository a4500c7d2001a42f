"""``waltz disk``: inspect storage files on the local disk (no configuration, no running node needed).

Commands::

    verify-segment <file.seg> [-t TXN]          index offsets and record checksums; exit 1 on failures
    segment-stats <file.seg>                    rows and min/max/avg/median data bytes
    dump-control-file <file.ctl> [-p ID | -a]   header and partition infos (-a: assigned only)
    dump-segment <file.seg> [-m] [-r] [-t TXN] [--payload hex|utf8|json]
                                                header (-m), every record (-r) or one transaction (-t),
                                                with each record's data shown as hex, UTF-8 text or JSON

``waltz storage max-transaction-id --offline DIR -p N`` uses :func:`offline_max_transaction_id` from here.

Each command is a few lines over a library function below that returns data; tests call those directly.
Files are opened read-only and never locked, so they can be inspected while a storage node runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import dataclass
from typing import Any

from waltz.errors import ConfigError
from waltz.protocol.records import Record
from waltz.storage.controlfile import read_control_file_with_trims
from waltz.storage.fileio import OS_FS, FileSystem
from waltz.storage.partition import is_half_created
from waltz.storage.segment import Segment, data_file_name, parse_segment_name

READ_BATCH_RECORDS = 1000
PAYLOAD_FORMATS = ("hex", "utf8", "json")


def offline_max_transaction_id(
    directory: str | os.PathLike[str], partition: int, *, fs: FileSystem = OS_FS
) -> int:
    """A partition's max transaction id read from the segment files under ``directory/partition`` (the
    storage node may be stopped): the last segment's, -1 when there is none. The files are opened read-only
    and the answer is what the node's recovery will keep: records after the index's end are counted if they
    verify (a node killed leaves its newest index entries unwritten), index entries past the data's end (a
    truncate killed part-way) and a crash tail are not, nor a newest segment left half-created."""
    pdir = os.path.join(os.fspath(directory), str(partition))
    if not fs.exists(pdir):
        raise ConfigError(f"{pdir}: no such partition directory")
    names = fs.listdir(pdir)
    parsed = [p for p in map(parse_segment_name, names) if p is not None]
    firsts = sorted(first for first, ext in parsed if ext == ".seg")
    indexed = {first for first, ext in parsed if ext != ".seg"}
    # A newest segment a crash left half-created is removed by the node when it opens the partition (its
    # predecessor then is the last): skip it as the node will, rather than fail on its header.
    while firsts and is_half_created(fs, pdir, firsts[-1], firsts[-1] in indexed):
        firsts.pop()
    if not firsts:
        return -1
    seg = Segment.inspect(os.path.join(pdir, data_file_name(firsts[-1])), fs=fs)
    try:
        return seg.recovered_max_transaction_id()
    finally:
        seg.close()


def format_payload(data: bytes, how: str) -> str:
    """A record's data as ``hex``, ``utf8`` (undecodable bytes escaped) or ``json`` (compact; data that is not
    JSON is shown as hex, marked)."""
    if how == "hex":
        return data.hex()
    if how == "utf8":
        return data.decode("utf-8", errors="backslashreplace")
    if how == "json":
        try:
            return json.dumps(json.loads(data), sort_keys=True, separators=(",", ":"))
        except (ValueError, UnicodeDecodeError):
            return f"(not JSON) {data.hex()}"
    raise ConfigError(f"unknown payload format {how!r}: expected one of {', '.join(PAYLOAD_FORMATS)}")


def verify_segment(path: str, transaction_id: int | None = None, *, fs: FileSystem = OS_FS) -> list[str]:
    """Problems found in a segment (empty when it verifies)."""
    seg = Segment.inspect(path, fs=fs)
    try:
        return seg.verify(transaction_id)
    finally:
        seg.close()


@dataclass(frozen=True)
class SegmentStats:
    rows: int
    min_data_bytes: int
    max_data_bytes: int
    avg_data_bytes: float
    median_data_bytes: float


def _iter_records(seg: Segment) -> list[Record]:
    out: list[Record] = []
    txn = seg.first_transaction_id
    while txn <= seg.max_transaction_id:
        got = seg.read_records(txn, READ_BATCH_RECORDS)
        if not got:
            break
        out.extend(got)
        txn += len(got)
    return out


def segment_stats(path: str, *, fs: FileSystem = OS_FS) -> SegmentStats:
    """Row count and data-size statistics of a segment (every record is verified on the way)."""
    seg = Segment.inspect(path, fs=fs)
    try:
        sizes: list[int] = []
        txn = seg.first_transaction_id
        while txn <= seg.max_transaction_id:
            got = seg.read_records(txn, READ_BATCH_RECORDS)
            if not got:
                break
            sizes.extend(len(r.data) for r in got)
            txn += len(got)
    finally:
        seg.close()
    if not sizes:
        return SegmentStats(0, 0, 0, 0.0, 0.0)
    return SegmentStats(
        len(sizes), min(sizes), max(sizes), sum(sizes) / len(sizes), float(statistics.median(sizes))
    )


def dump_control_file(
    path: str, partition_id: int | None = None, assigned_only: bool = False, *, fs: FileSystem = OS_FS
) -> list[str]:
    """Lines describing a control file's header and partition infos."""
    header, infos, trims = read_control_file_with_trims(path, fs)
    lines = [
        f"version: {header.version}",
        f"creation time (ms): {header.creation_time_ms}",
        f"key: {header.key}",
        f"partitions: {header.num_partitions}",
    ]
    if partition_id is not None and not 0 <= partition_id < header.num_partitions:
        raise ConfigError(f"partition {partition_id} out of range 0..{header.num_partitions - 1}")
    for pid, (info, trim) in enumerate(zip(infos, trims, strict=True)):
        if partition_id is not None and pid != partition_id:
            continue
        if assigned_only and not info.assigned:
            continue
        lines.append(
            f"partition {pid}: session id {info.session_id}, low-water mark {info.low_water_mark}, "
            f"local low-water mark {info.local_low_water_mark}, assigned {info.assigned}, "
            f"available {info.available}" + (f", trim point {trim}" if trim else "")
        )
    return lines


def _record_line(r: Record, payload: str | None = None) -> str:
    line = (
        f"transaction {r.transaction_id}: {r.req_id!r} header {r.header} "
        f"data {len(r.data)} bytes checksum {r.checksum:#010x}"
    )
    return line if payload is None else f"{line}\n  data: {format_payload(r.data, payload)}"


def dump_segment(
    path: str,
    *,
    metadata: bool = False,
    records: bool = False,
    transaction_id: int | None = None,
    payload: str | None = None,
    fs: FileSystem = OS_FS,
) -> list[str]:
    """Lines describing a segment: its header (``metadata``), all records, or one transaction; with
    ``payload`` (``hex``, ``utf8`` or ``json``) each record is followed by its data."""
    seg = Segment.inspect(path, fs=fs)
    try:
        lines: list[str] = []
        if metadata or not (records or transaction_id is not None):
            h = seg.header
            lines += [
                f"version: {h.version}",
                f"creation time (ms): {h.creation_time_ms}",
                f"key: {h.key}",
                f"partition: {h.partition_id}",
                f"first transaction id: {h.first_transaction_id}",
                f"max transaction id: {seg.max_transaction_id}",
                f"data bytes: {seg.size_bytes}",
            ]
            if seg.zero_tail_bytes:
                # A writable segment's free space: the node keeps it zero-filled ahead of its appends.
                lines.append(f"preallocated zero bytes: {seg.zero_tail_bytes}")
        if transaction_id is not None:
            rec = seg.read_record(transaction_id)
            if rec is None:
                raise ConfigError(f"transaction {transaction_id} is not in {path}")
            lines.append(f"offset {seg.record_offset(transaction_id)}: {_record_line(rec, payload)}")
        elif records:
            lines += [_record_line(r, payload) for r in _iter_records(seg)]
        return lines
    finally:
        seg.close()


# ------------------------------------------------------------------------------------------------- argparse


def _print(lines: list[str]) -> None:
    for line in lines:
        print(line)


def _cmd_verify(args: argparse.Namespace) -> int:
    problems = verify_segment(args.segment, args.transaction)
    if problems:
        _print([f"FAILED: {p}" for p in problems])
        return 1
    print("OK")
    return 0


def _cmd_stats(args: argparse.Namespace) -> int:
    s = segment_stats(args.segment)
    _print(
        [
            f"rows: {s.rows}",
            f"min data bytes: {s.min_data_bytes}",
            f"max data bytes: {s.max_data_bytes}",
            f"avg data bytes: {s.avg_data_bytes:.1f}",
            f"median data bytes: {s.median_data_bytes:.1f}",
        ]
    )
    return 0


def _cmd_dump_control(args: argparse.Namespace) -> int:
    _print(dump_control_file(args.control_file, args.partition, args.assigned))
    return 0


def _cmd_dump_segment(args: argparse.Namespace) -> int:
    _print(
        dump_segment(
            args.segment,
            metadata=args.metadata,
            records=args.records or args.payload is not None,
            transaction_id=args.transaction,
            payload=args.payload,
        )
    )
    return 0


def register(subparsers: Any) -> None:
    """Add the ``disk`` command group to the ``waltz`` parser."""
    group = subparsers.add_parser("disk", help="inspect local storage files (segments, control file)")
    cmds = group.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = cmds.add_parser("verify-segment", help="check index offsets and record checksums of a segment")
    p.add_argument("segment", metavar="FILE.seg")
    p.add_argument("-t", "--transaction", type=int, help="check only this transaction id")
    p.set_defaults(handler=_cmd_verify)

    p = cmds.add_parser("segment-stats", help="row count and data size statistics of a segment")
    p.add_argument("segment", metavar="FILE.seg")
    p.set_defaults(handler=_cmd_stats)

    p = cmds.add_parser("dump-control-file", help="print a control file's header and partition infos")
    p.add_argument("control_file", metavar="FILE.ctl")
    which = p.add_mutually_exclusive_group()
    which.add_argument("-p", "--partition", type=int, help="only this partition")
    which.add_argument("-a", "--assigned", action="store_true", help="only assigned partitions")
    p.set_defaults(handler=_cmd_dump_control)

    p = cmds.add_parser("dump-segment", help="print a segment's header and/or records")
    p.add_argument("segment", metavar="FILE.seg")
    p.add_argument("-m", "--metadata", action="store_true", help="print the header")
    p.add_argument("-r", "--records", action="store_true", help="print every record")
    p.add_argument("-t", "--transaction", type=int, help="print this transaction only")
    p.add_argument(
        "-P",
        "--payload",
        choices=PAYLOAD_FORMATS,
        help="also print each record's data: hex, utf8 (text) or json (implies -r without -t)",
    )
    p.set_defaults(handler=_cmd_dump_segment)
