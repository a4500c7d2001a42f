"""``python -m bench.faults``: run the fault suite over several seeds (see :mod:`bench.faults.suite`).

    python -m bench.faults --seeds 5              # seeds 0..4
    python -m bench.faults --seeds 17 --only      # replay seed 17
    python -m bench.faults --seeds 20 --first 100 --results runs.jsonl

Exit status 0 if every seed passed. A failed seed's directory (logs, data, the apps' acknowledgements) is
kept.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

from bench.faults.suite import ALL_KINDS, KNOWN_KINDS, Options, result_json, run_seed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Waltz fault suite")
    parser.add_argument("--seeds", type=int, default=3, help="how many seeds (or the one seed with --only)")
    parser.add_argument("--first", type=int, default=0, help="first seed")
    parser.add_argument("--only", action="store_true", help="run the single seed given by --seeds")
    parser.add_argument("--fault-phase-s", type=float, default=Options.fault_phase_s)
    parser.add_argument("--partitions", type=int, default=Options.partitions)
    parser.add_argument("--apps", type=int, default=Options.apps)
    parser.add_argument(
        "--short-zk-pauses",
        action="store_true",
        help="keep every SIGSTOP of ZooKeeper below the session timeout (by default half go past it)",
    )
    parser.add_argument(
        "--kinds",
        default=",".join(ALL_KINDS),
        help=f"fault kinds to draw from (default: all but the power cuts; known: {', '.join(KNOWN_KINDS)})",
    )
    parser.add_argument(
        "--fsync-noop",
        action="store_true",
        help="with power cuts: fsync does nothing on the storage nodes (the negative control: must fail)",
    )
    parser.add_argument(
        "--zk-strict-posix",
        action="store_true",
        help="with power cuts: ZooKeeper's directory keeps the strict model (it never fsyncs its directory)",
    )
    parser.add_argument("--dir", type=Path, default=None, help="parent directory of the runs")
    parser.add_argument("--keep", action="store_true", help="keep the directory of passing runs")
    parser.add_argument("--results", type=Path, default=None, help="append one JSON line per run")
    args = parser.parse_args(argv)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    unknown = set(kinds) - set(KNOWN_KINDS)
    if unknown:
        parser.error(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(KNOWN_KINDS)}")
    opts = dataclasses.replace(
        Options(),
        fault_phase_s=args.fault_phase_s,
        partitions=args.partitions,
        apps=args.apps,
        long_zk_pauses=not args.short_zk_pauses,
        kinds=kinds,
        fsync_noop=args.fsync_noop,
        zk_strict_posix=args.zk_strict_posix,
    )
    seeds = [args.seeds] if args.only else list(range(args.first, args.first + args.seeds))
    parent = args.dir if args.dir is not None else Path(tempfile.mkdtemp(prefix="waltz-faults-"))
    parent.mkdir(parents=True, exist_ok=True)
    failed = []
    for seed in seeds:
        result = run_seed(seed, opts, parent / f"seed-{seed}", keep=args.keep)
        print(result.summary(), flush=True)
        if args.results is not None:
            with args.results.open("a", encoding="utf-8") as f:
                f.write(result_json(result, opts) + "\n")
        if not result.ok:
            failed.append(seed)
    print(f"{len(seeds) - len(failed)}/{len(seeds)} seeds passed" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
