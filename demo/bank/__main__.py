"""``python -m demo.bank``: the bank service, interactive or automatic.

    python -m demo.bank -c D/client.yaml                 # interactive: deposit / withdraw / balance / ...
    python -m demo.bank -c D/client.yaml auto --seconds 60 --instances 3
    python -m demo.bank --mock 4 auto --seconds 10       # no cluster: an in-memory MockDriver, 4 partitions
    python -m demo.bank -c D/client.yaml snapshot --out S.json --trim --margin 100   # snapshot, then trim
    python -m demo.bank -c D/client.yaml --name new --from-snapshot S.json  # a new instance, from a snapshot

Databases: one SQLite file per instance under ``--dir`` (default ``./bank-data``), or ``--db-url`` (for
example ``postgresql://user@localhost/bank``) for one database holding every instance's tables.
``--name`` names the instance (default ``interactive``; ``auto`` names its instances ``0``, ``1``, ...), and
so its database. ``snapshot`` copies that instance's database consistently (``demo.bank.snapshot``); with
``--trim`` it then raises each partition's trim point to the snapshot's high-water mark + 1 - ``--margin``.
``--from-snapshot`` loads a snapshot into the instance's empty database before it starts (an instance whose
database is behind the log's trim point fails with TrimmedError, exit status 1, and must start so).
Exit status of ``auto``: 0 if every invariant holds, 1 otherwise; of ``snapshot``: 1 if a trim was refused.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from demo.bank.app import BankInstance, make_engine
from demo.bank.auto import AutoOptions, Drill, InstanceFactory, run_auto
from demo.bank.model import BankDb
from demo.bank.snapshot import (
    SnapshotError,
    read_snapshot,
    restore_snapshot,
    take_snapshot,
    trim_below,
    trimming_client,
    write_snapshot,
)
from waltz import ClientConfig
from waltz.client.driver import ClientDriver
from waltz.errors import TrimmedError, WaltzError
from waltz.testing import MockCluster, MockDriver

HELP = """commands:
  deposit ACCOUNT AMOUNT     add money (creates the account)
  withdraw ACCOUNT AMOUNT    take money out; aborts if the balance is insufficient
  balance ACCOUNT            this instance's view of the account
  deactivate ACCOUNT         close the account (racing withdrawals fail)
  quit
amounts are positive integers"""
CATCH_UP_TIMEOUT_S = 30.0


def instance_factory(
    config: ClientConfig,
    directory: Path,
    db_url: str | None,
    driver_factory: Callable[[], ClientDriver | None] = lambda: None,
) -> InstanceFactory:
    """Instances named ``name`` with a fresh database each (old tables of the same name are dropped)."""

    def make(name: str) -> BankInstance:
        engine, suffix = make_engine(db_url, directory, name)
        BankDb(engine, suffix).drop()
        return BankInstance(name, engine, config, suffix=suffix, driver=driver_factory())

    return make


def _client_setup(args: argparse.Namespace) -> tuple[ClientConfig, Callable[[], ClientDriver | None]]:
    if args.mock:
        cluster = MockCluster(args.mock)
        return ClientConfig(), lambda: MockDriver(cluster=cluster)
    if not args.client_config:
        raise SystemExit("demo.bank: give -c CLIENT_YAML (from `waltz local up`) or --mock PARTITIONS")
    return ClientConfig.from_yaml(args.client_config), lambda: None


def _catch_up(instance: BankInstance) -> None:
    if not instance.wait_caught_up(CATCH_UP_TIMEOUT_S):
        print(f"(not caught up with the log after {CATCH_UP_TIMEOUT_S:g} s: answers may be out of date)")


def interactive(instance: BankInstance, lines: Sequence[str] | None = None) -> None:
    """The REPL. It answers only once this instance has applied everything already committed: at start,
    and before each ``balance`` (after an operation, ``wait_applied`` does the same)."""
    print(HELP)
    print("catching up with the log ...")
    _catch_up(instance)
    source = iter(lines) if lines is not None else None
    while True:
        try:
            line = next(source) if source is not None else input("bank> ")
        except (EOFError, StopIteration):
            return
        words = line.split()
        if not words:
            continue
        cmd, rest = words[0], words[1:]
        try:
            if cmd == "quit":
                return
            if cmd == "balance" and len(rest) == 1:
                account = int(rest[0])
                _catch_up(instance)
                state = instance.balance(account)
                print(
                    "unknown account"
                    if state is None
                    else f"{state[0]} ({'active' if state[1] else 'inactive'})"
                )
                continue
            if cmd in ("deposit", "withdraw") and len(rest) == 2:
                account, amount = int(rest[0]), int(rest[1])
                if amount <= 0:
                    print("amounts must be positive")
                    continue
                context = instance.submit(cmd, account, amount)
            elif cmd == "deactivate" and len(rest) == 1:
                context = instance.deactivate(int(rest[0]))
            else:
                print(HELP)
                continue
            outcome = instance.wait_applied(context)
            if outcome == "declined":
                outcome = "aborted (unknown account, inactive, or insufficient balance)"
            print(outcome or "no outcome yet (the cluster may be failing over)")
        except ValueError:
            print("accounts and amounts are integers")
        except WaltzError as e:
            print(f"error: {e}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m demo.bank", description=__doc__.split("\n")[0])
    parser.add_argument("-c", "--client-config", metavar="FILE", help="client YAML (D/client.yaml)")
    parser.add_argument("--mock", type=int, metavar="PARTITIONS", help="use an in-memory MockDriver")
    parser.add_argument("--db-url", metavar="URL", help="SQLAlchemy URL (default: SQLite files in --dir)")
    parser.add_argument("--dir", type=Path, default=Path("bank-data"), help="where SQLite files go")
    parser.add_argument("--name", default="interactive", help="the instance (and its database)")
    parser.add_argument(
        "--from-snapshot", type=Path, metavar="FILE", help="start from this snapshot (an empty database)"
    )
    sub = parser.add_subparsers(dest="mode")
    auto = sub.add_parser("auto", help="several instances submit random operations; then check invariants")
    auto.add_argument("--instances", type=int, default=3)
    auto.add_argument("--seconds", type=float, default=60.0)
    auto.add_argument("--accounts", type=int, default=40)
    auto.add_argument("--rate", type=float, default=25.0, help="operations/s per instance (0: unlimited)")
    auto.add_argument("--seed", type=int, default=None)
    auto.add_argument("--no-display", action="store_true", help="no live table (for logs)")
    snap = sub.add_parser("snapshot", help="snapshot instance --name's database; optionally trim below it")
    snap.add_argument("--out", type=Path, required=True, metavar="FILE", help="the snapshot file to write")
    snap.add_argument("--trim", action="store_true", help="then trim every partition below the snapshot")
    snap.add_argument(
        "--margin", type=int, default=1000, help="transactions kept below the snapshot's marks (default 1000)"
    )
    snap.add_argument("--min-kept", type=int, default=None, help="the trim's grace (default: the client's)")
    return parser


def main(argv: Sequence[str] | None = None, drills: Sequence[Drill] = ()) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kazoo").setLevel(logging.ERROR)
    if args.mode == "snapshot":
        return snapshot_command(args)
    config, driver_factory = _client_setup(args)
    if args.mode == "auto":
        opts = AutoOptions(
            instances=args.instances,
            duration_s=args.seconds,
            accounts=args.accounts,
            rate_per_instance=args.rate,
            seed=args.seed,
            display=not args.no_display,
        )
        try:
            report = run_auto(instance_factory(config, args.dir, args.db_url, driver_factory), opts, drills)
        except TrimmedError as e:
            print(f"demo.bank: auto starts every instance with an empty database: {e}", file=sys.stderr)
            return 1
        print(report.render())
        return 0 if report.ok else 1
    return interactive_command(args, config, driver_factory)


def interactive_command(
    args: argparse.Namespace, config: ClientConfig, driver_factory: Callable[[], ClientDriver | None]
) -> int:
    """The interactive instance ``--name``, first loaded from ``--from-snapshot`` if given."""
    engine, suffix = make_engine(args.db_url, args.dir, args.name)
    try:
        if args.from_snapshot is not None:
            snapshot = read_snapshot(args.from_snapshot)
            restore_snapshot(snapshot, BankDb(engine, suffix))
            print(f"instance {args.name} starts from {args.from_snapshot}: {snapshot.describe()}")
        with BankInstance(args.name, engine, config, suffix=suffix, driver=driver_factory()) as instance:
            interactive(instance)
    except SnapshotError as e:
        print(f"demo.bank: {e}", file=sys.stderr)
        return 1
    except TrimmedError as e:
        print(
            f"demo.bank: instance {args.name} cannot catch up: {e}\n"
            "start it from a snapshot of another instance's database (python -m demo.bank snapshot) "
            "with --from-snapshot FILE",
            file=sys.stderr,
        )
        return 1
    finally:
        engine.dispose()
    return 0


def snapshot_command(args: argparse.Namespace) -> int:
    """``snapshot``: write instance ``--name``'s state to ``--out``; with ``--trim``, trim below it."""
    engine, suffix = make_engine(args.db_url, args.dir, args.name)
    try:
        snapshot = take_snapshot(BankDb(engine, suffix))
    finally:
        engine.dispose()
    if not snapshot.high_water_marks:
        print(f"demo.bank: instance {args.name} applied nothing yet; no snapshot written", file=sys.stderr)
        return 1
    write_snapshot(snapshot, args.out)
    print(f"snapshot of instance {args.name}: {snapshot.describe()}, written to {args.out}")
    if not args.trim:
        return 0
    config, _ = _client_setup(args)
    refused = 0
    with trimming_client(config) as client:
        for partition_id in sorted(snapshot.high_water_marks):
            try:
                outcome = trim_below(
                    client, snapshot, partition_id, margin=args.margin, min_kept_transactions=args.min_kept
                )
                print(outcome.message)
            except WaltzError as e:
                refused += 1
                print(f"demo.bank: not trimmed: {e}", file=sys.stderr)
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
