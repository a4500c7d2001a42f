"""``waltz client validate|high-water-mark`` (REFERENCE §7.1 ClientCli; a thin layer over
:mod:`waltz.perf.validate`). ``-c`` is a client YAML; ``--mock N`` uses an in-memory MockDriver."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from waltz.cli.perf import add_client_args, client_setup, progress_line, run_on_fast_loop
from waltz.perf.common import current_marks
from waltz.perf.validate import ValidateOptions, run_validation


def register(groups: Any) -> None:
    parser = groups.add_parser("client", help="client-side checks of a cluster")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    val = sub.add_parser("validate", help="serializability check: every value must equal its transaction id")
    add_client_args(val)
    val.add_argument("--txns-per-client", type=int, required=True, metavar="N")
    val.add_argument("--clients", type=int, default=2, metavar="C")
    val.add_argument("--interval-ms", type=float, default=0.0, metavar="MS")
    val.add_argument("--partitions", type=int, default=None, metavar="P", help="use partitions 0..P-1")
    val.add_argument("--json", action="store_true")
    val.set_defaults(handler=cmd_validate)

    hwm = sub.add_parser("high-water-mark", help="print a partition's high-water mark")
    add_client_args(hwm)
    hwm.add_argument("-p", "--partition", type=int, default=None, help="one partition (default: all)")
    hwm.set_defaults(handler=cmd_high_water_mark)


def cmd_validate(args: argparse.Namespace) -> int:
    config, drivers = client_setup(args)
    opts = ValidateOptions(
        txns_per_client=args.txns_per_client,
        clients=args.clients,
        interval_ms=args.interval_ms,
        partitions=args.partitions,
    )
    with progress_line(not args.json) as show:
        report = run_on_fast_loop(run_validation(config, opts, drivers, show_progress=show))
    if args.json:
        print(
            json.dumps(
                {
                    "ok": report.ok,
                    "committed": report.committed,
                    "failed": report.failed,
                    "retries": report.retries,
                    "seconds": round(report.seconds, 3),
                    "violation_count": report.violation_count,
                    "violations": report.violations,
                }
            )
        )
    else:
        print(report.render())
    return 0 if report.ok and not report.failed else 1


def cmd_high_water_mark(args: argparse.Namespace) -> int:
    config, drivers = client_setup(args)
    marks, n = asyncio.run(current_marks(config, drivers))
    if args.partition is not None:
        if not 0 <= args.partition < n:
            print(f"waltz: error: partition {args.partition} out of range: the cluster has {n} partitions")
            return 2
        print(marks[args.partition])
    else:
        for p in range(n):
            print(f"partition {p}: {marks[p]}")
    return 0
