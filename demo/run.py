"""``python -m demo.run`` (what ``make demo`` runs): a local cluster, the bank under a fault drill, a report.

1. ``waltz local up``: ZooKeeper, 3 storage nodes, 2 servers, 4 partitions, each its own process on loopback.
2. The bank demo in automatic mode: 3 application instances, each with its own SQLite database applied
   through ``SqlClientCallbacks``, submit random deposits, withdrawals and deactivations for about a minute
   while storage node 2 is killed (as in a crash) and later restarted. At the end the invariants are checked:
   money is conserved, no balance is negative, every instance's database agrees, and the log replayed from
   the start into a fresh database gives the same balances.
3. The Spark report (``demo/report.py``) rebuilds every balance from the log alone with the ``waltz`` data
   source, writes Parquet, prints the tables, and must equal the bank databases' balances. Its page
   (lineage: cluster key, high-water marks read and when; operations by type per partition; money over the
   log; balance distribution) is written next to the Parquet output as ``report/report.html``; the demo
   prints the file's path and keeps it.
4. Snapshot, trim, bootstrap (``demo/bank/bootstrap.py``): instance 0's database is snapshotted, every
   partition trimmed below it, instance 1 deposits more, an instance with an empty database must fail with
   TrimmedError, and one started from the snapshot must catch up to instance 1's balances.
5. ``waltz local down``: everything started is stopped, whatever happened.

Exit status 0 only if every step succeeded. ``--seconds`` shortens the bank run; ``--dir`` keeps the cluster's
directory (logs, data, report) where you can look at it.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
from pathlib import Path

from demo.bank.__main__ import instance_factory
from demo.bank.app import make_engine
from demo.bank.auto import AutoOptions, Drill, run_auto
from demo.bank.bootstrap import bootstrap_drill
from demo.bank.model import BankDb
from waltz import ClientConfig, local
from waltz.errors import WaltzError
from waltz.local.overview import render_up


def bank_balances(directory: Path, instance: str) -> dict[int, int]:
    """The balances one bank instance's database holds."""
    engine, suffix = make_engine(None, directory, instance)
    try:
        return {account: balance for account, (balance, _active) in BankDb(engine, suffix).balances().items()}
    finally:
        engine.dispose()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m demo.run", description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="length of the bank run")
    parser.add_argument("--dir", type=Path, default=None, help="cluster directory (default: a temporary one)")
    parser.add_argument("--no-report", action="store_true", help="skip the Spark report")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kazoo").setLevel(logging.ERROR)

    base = args.dir or Path(tempfile.mkdtemp(prefix="waltz-demo-"))
    cluster_dir = base / "cluster"
    ok = False
    try:
        print(f"== waltz local up ({cluster_dir})", flush=True)
        cluster = local.up(local.UpOptions(cluster_dir, storages=3, servers=2, partitions=4))
        print(render_up(cluster), flush=True)
        client_yaml = cluster_dir / "client.yaml"

        kill_at, start_at = args.seconds / 3, 2 * args.seconds / 3
        drills = [
            Drill(kill_at, "kill -9 storage node 2", lambda: local.kill(cluster_dir, "storage", 2)),
            Drill(start_at, "restart storage node 2", lambda: local.start(cluster_dir, "storage", 2)),
        ]
        print(
            f"== bank: 3 instances for {args.seconds:.0f} s, storage node 2 killed and restarted", flush=True
        )
        bank_dir = base / "bank"
        factory = instance_factory(ClientConfig.from_yaml(client_yaml), bank_dir, None)
        report = run_auto(
            factory,
            AutoOptions(instances=3, duration_s=args.seconds, display=sys.stdout.isatty(), seed=7),
            drills,
        )
        print(report.render(), flush=True)
        if not report.ok:
            return 1

        if not args.no_report:
            print("== Spark report over the log (demo/report.py)", flush=True)
            from demo.report import run_report

            from_log = run_report(client_yaml, base / "report")
            from_db = bank_balances(bank_dir, "0")
            if from_log != from_db:
                differ = sorted(k for k in set(from_log) | set(from_db) if from_log.get(k) != from_db.get(k))
                print(f"REPORT MISMATCH: accounts {differ[:20]} differ between the log and the bank database")
                return 1
            print(f"report balances equal the bank databases' for all {len(from_db)} accounts", flush=True)

        # After the report: the Spark source reads the log from transaction 0, which the trim removes.
        print("== snapshot, trim, bootstrap (demo/bank/bootstrap.py)", flush=True)
        config = ClientConfig.from_yaml(client_yaml)
        if not bootstrap_drill(
            config, bank_dir, bank_dir / "snapshot.json", say=lambda s: print(s, flush=True)
        ):
            return 1
        ok = True
        return 0
    except WaltzError as e:
        print(f"demo: FAILED: {e}", file=sys.stderr)
        return 1
    finally:
        print("== waltz local down", flush=True)
        try:
            for line in local.down(cluster_dir):
                print(line)
        except WaltzError as e:
            print(f"demo: local down: {e}", file=sys.stderr)
        if args.dir is None and ok:
            # The cluster's data goes; the report (Parquet and report.html) stays for people to look at.
            for name in ("cluster", "bank"):
                shutil.rmtree(base / name, ignore_errors=True)
            if (base / "report" / "report.html").exists():
                print(f"report kept in {base / 'report'}; open {base / 'report' / 'report.html'}")
        elif not ok:
            print(f"demo: logs and data kept in {base}", file=sys.stderr)
        print("demo OK" if ok else "demo FAILED", flush=True)


if __name__ == "__main__":
    sys.exit(main())
