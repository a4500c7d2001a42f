"""The bank's automatic mode: several instances submit random operations at once, then the invariants.

Each instance runs one worker thread that submits deposits, withdrawals and (rarely) deactivations on random
accounts at a fixed rate, while a live table (rich) shows every instance's progress. Optional *drills* run at
given times during the run (the fault test kills a storage node and a server this way). Then the run
settles: every instance flushes its contexts and waits until its database has applied the log up to the
cluster's high-water marks, and the invariants are checked:

1. **money is conserved**: in every instance's database the sum of balances equals the deposits minus the
   withdrawals that the instances saw committed (``on_completion(True)``);
2. **no balance is negative**, and no withdrawal was applied to a deactivated or insufficient account (the
   anomalies table is empty), which is what the locks guarantee;
3. **every instance's database agrees**: same accounts, balances, flags and high-water marks;
4. **the log replays**: a fresh database fed by a new client from the start of the log ends up identical.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from demo.bank.app import BankInstance
from demo.bank.model import DEACTIVATE, DEPOSIT, WITHDRAW
from waltz.errors import WaltzError

InstanceFactory = Callable[[str], BankInstance]
"""Makes the instance named ``name`` ("0", "1", ..., or "replay") with a fresh, empty database."""

MAX_AMOUNT = 100


@dataclass(frozen=True)
class AutoOptions:
    instances: int = 3
    duration_s: float = 60.0
    accounts: int = 40
    rate_per_instance: float = 25.0
    """Operations per second per instance (0: as fast as back pressure allows)."""
    deactivate_probability: float = 0.002
    seed: int | None = None
    settle_timeout_s: float = 90.0
    display: bool = True


@dataclass(frozen=True)
class Drill:
    """An action run ``at_s`` seconds into the run (a fault drill: kill or restart a process)."""

    at_s: float
    description: str
    action: Callable[[], Any]


@dataclass
class AutoReport:
    violations: list[str]
    duration_s: float
    totals: dict[str, int]
    per_instance: dict[str, dict[str, int]]
    expected_money: int
    accounts: int
    high_water_marks: dict[int, int]
    drills: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def render(self) -> str:
        t = self.totals
        lines = [
            f"{t['committed']} transactions committed in {self.duration_s:.1f} s "
            f"({t['committed'] / max(self.duration_s, 1e-9):.1f}/s): {t.get(DEPOSIT, 0)} deposits, "
            f"{t.get(WITHDRAW, 0)} withdrawals, {t.get(DEACTIVATE, 0)} deactivations; "
            f"{t['declined']} declined, {t['failed']} failed, {t['lock_failures']} lock retries",
            f"{self.accounts} accounts hold {self.expected_money} in total; "
            f"log high-water marks {dict(sorted(self.high_water_marks.items()))}",
        ]
        lines += [f"drill: {d}" for d in self.drills]
        lines += [f"note: {n}" for n in self.notes]
        if self.ok:
            lines.append(
                "invariants hold: money conserved, no negative balance, all instances agree, log replays"
            )
        else:
            lines.append(f"INVARIANT VIOLATIONS ({len(self.violations)}):")
            lines += [f"  - {v}" for v in self.violations]
        return "\n".join(lines)


class _Worker(threading.Thread):
    def __init__(self, instance: BankInstance, opts: AutoOptions, seed: int, stop: threading.Event) -> None:
        super().__init__(name=f"bank-worker-{instance.name}", daemon=True)
        self.instance = instance
        self.opts = opts
        self.rng = random.Random(seed)
        self.stop = stop
        self.submit_errors = 0
        self.last_error = ""

    def next_op(self) -> tuple[str, int, int]:
        account = self.rng.randrange(self.opts.accounts)
        if self.rng.random() < self.opts.deactivate_probability:
            return DEACTIVATE, account, 0
        kind = DEPOSIT if self.rng.random() < 0.45 else WITHDRAW
        return kind, account, self.rng.randint(1, MAX_AMOUNT)

    def run(self) -> None:
        interval_s = 1.0 / self.opts.rate_per_instance if self.opts.rate_per_instance > 0 else 0.0
        next_at = time.monotonic()
        while not self.stop.is_set():
            kind, account, amount = self.next_op()
            try:
                self.instance.submit(kind, account, amount)
            except WaltzError as e:
                # The context ended with on_exception (counted as failed); the cluster may be failing over.
                self.submit_errors += 1
                self.last_error = repr(e)
                self.stop.wait(0.2)
            if interval_s:
                next_at += interval_s
                delay = next_at - time.monotonic()
                if delay > 0:
                    self.stop.wait(delay)
                else:
                    next_at = time.monotonic()  # Behind (back pressure): do not burst to catch up.


def _progress(
    instances: Sequence[BankInstance], elapsed_s: float, opts: AutoOptions, drills: list[str]
) -> Group:
    table = Table(title=f"bank: {len(instances)} instances, {elapsed_s:.0f}/{opts.duration_s:.0f} s")
    for col in ("instance", "submitted", "committed", "declined", "failed", "lock retries", "in flight"):
        table.add_column(col, justify="right")
    total = 0
    for inst in instances:
        s = inst.stats
        with s.lock:
            row = (s.submitted, s.committed, s.declined, s.failed, s.lock_failures, s.in_flight)
        total += row[1]
        table.add_row(inst.name, *(str(v) for v in row))
    rate = Text(f"{total / max(elapsed_s, 1e-9):.1f} committed transactions/s")
    return Group(table, rate, *(Text(f"drill: {d}") for d in drills[-5:]))


def _log_marks(instance: BankInstance) -> dict[int, int]:
    """The cluster's high-water mark of every partition."""
    return {p: instance.client.high_water_mark(p) for p in range(instance.client.num_partitions)}


def _wait_applied(instance: BankInstance, target: dict[int, int], deadline: float) -> bool:
    while True:
        marks = instance.db.high_water_marks()
        if all(marks.get(p, -1) >= hwm for p, hwm in target.items()):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def run_auto(
    factory: InstanceFactory,
    opts: AutoOptions,
    drills: Sequence[Drill] = (),
    console: Console | None = None,
) -> AutoReport:
    """Run the automatic mode (see the module docstring) and return the report; never raises for a violated
    invariant (the report lists it), only for a failure to start."""
    console = console or Console()
    rng = random.Random(opts.seed)
    instances: list[BankInstance] = []
    violations: list[str] = []
    drill_log: list[str] = []
    notes: list[str] = []
    try:
        for i in range(opts.instances):
            instances.append(factory(str(i)))  # noqa: PERF401 - each one is closed if a later one fails
        # The log may hold an earlier run's transactions: the fresh databases replay them first, and the
        # money they hold is the baseline of the conservation check.
        start_marks = _log_marks(instances[0])
        for inst in instances:
            # A trimmed log stops a fresh database's partitions: wait_caught_up raises that TrimmedError.
            if not inst.wait_caught_up(opts.settle_timeout_s):
                raise WaltzError(f"instance {inst.name} could not catch up with the log {start_marks}")
        baseline = sum(b for b, _ in instances[0].db.balances().values())
        if any(h >= 0 for h in start_marks.values()):
            notes.append(
                f"the log already held {sum(h + 1 for h in start_marks.values())} transactions "
                f"(money {baseline}) before this run"
            )
        stop = threading.Event()
        workers = [_Worker(inst, opts, rng.randrange(2**32), stop) for inst in instances]
        started = time.monotonic()
        for w in workers:
            w.start()
        pending = sorted(drills, key=lambda d: d.at_s)

        def run_drills() -> None:
            for drill in pending:
                if stop.wait(max(0.0, started + drill.at_s - time.monotonic())):
                    return
                t0 = time.monotonic()
                try:
                    drill.action()
                    drill_log.append(
                        f"{drill.at_s:.0f} s: {drill.description} (took {time.monotonic() - t0:.1f} s)"
                    )
                except Exception as e:  # noqa: BLE001 - a failed drill is reported, the run goes on
                    drill_log.append(f"{drill.at_s:.0f} s: {drill.description} FAILED: {e!r}")
                    violations.append(f"drill {drill.description!r} failed: {e!r}")

        driller = threading.Thread(target=run_drills, name="bank-drills", daemon=True)
        driller.start()
        try:
            if opts.display:
                with Live(console=console, refresh_per_second=4, transient=False) as live:
                    while (elapsed := time.monotonic() - started) < opts.duration_s:
                        live.update(_progress(instances, elapsed, opts, drill_log))
                        time.sleep(0.25)
                    live.update(_progress(instances, time.monotonic() - started, opts, drill_log))
                console.print()
            else:
                time.sleep(max(0.0, opts.duration_s - (time.monotonic() - started)))
        finally:
            stop.set()
            for w in workers:
                w.join(timeout=opts.settle_timeout_s)
            driller.join(timeout=opts.settle_timeout_s)
        duration_s = time.monotonic() - started
        notes.extend(
            f"instance {w.instance.name}: {w.submit_errors} submits failed (last: {w.last_error})"
            for w in workers
            if w.submit_errors
        )

        # -- settle --
        deadline = time.monotonic() + opts.settle_timeout_s
        for inst in instances:
            try:
                inst.client.flush_transactions(timeout=max(1.0, deadline - time.monotonic()))
            except WaltzError as e:
                violations.append(f"instance {inst.name}: contexts still unresolved after the run: {e}")
        target = _log_marks(instances[0])
        violations.extend(
            f"instance {inst.name}: database high-water marks {inst.db.high_water_marks()} did not "
            f"reach the log's {target} within {opts.settle_timeout_s:g} s"
            for inst in instances
            if not _wait_applied(inst, target, deadline)
        )
        report = _check(instances, target, violations, duration_s, baseline)
        report.drills, report.notes = drill_log, notes

        # -- replay --
        replay = factory("replay")
        try:
            if not _wait_applied(replay, target, time.monotonic() + opts.settle_timeout_s):
                violations.append(f"replay: did not reach the log's high-water marks {target}")
            reference = instances[0].db.balances()
            replayed = replay.db.balances()
            if replayed != reference:
                violations.append(f"replay: a fresh database differs: {_diff(reference, replayed)}")
            violations.extend(f"replay: anomaly {a}" for a in replay.db.anomaly_list())
        finally:
            replay.close()
        return report
    finally:
        for inst in instances:
            try:
                inst.close()
            except Exception as e:  # noqa: BLE001 - close the others whatever happens
                notes.append(f"instance {inst.name}: close failed: {e!r}")


def _diff(a: dict[int, tuple[int, bool]], b: dict[int, tuple[int, bool]]) -> str:
    keys = sorted(set(a) | set(b))
    diffs = [f"account {k}: {a.get(k)} vs {b.get(k)}" for k in keys if a.get(k) != b.get(k)]
    return "; ".join(diffs[:5]) + (f" (and {len(diffs) - 5} more)" if len(diffs) > 5 else "")


def _check(
    instances: Sequence[BankInstance],
    target: dict[int, int],
    violations: list[str],
    duration_s: float,
    baseline: int,
) -> AutoReport:
    totals: dict[str, int] = {"committed": 0, "declined": 0, "failed": 0, "lock_failures": 0}
    per_instance: dict[str, dict[str, int]] = {}
    deposited = withdrawn = 0
    for inst in instances:
        s = inst.stats
        with s.lock:
            row = {
                "submitted": s.submitted,
                "committed": s.committed,
                "declined": s.declined,
                "failed": s.failed,
                "lock_failures": s.lock_failures,
                **s.by_kind,
            }
            deposited += s.deposited
            withdrawn += s.withdrawn
        per_instance[inst.name] = row
        for k, v in row.items():
            if k != "submitted":
                totals[k] = totals.get(k, 0) + v
    expected = baseline + deposited - withdrawn
    reference = instances[0].db.balances()
    for inst in instances:
        balances = inst.db.balances()
        total = sum(b for b, _ in balances.values())
        if total != expected:
            violations.append(
                f"instance {inst.name}: money not conserved: balances sum to {total}, but the money before "
                f"the run plus committed deposits minus withdrawals is "
                f"{baseline} + {deposited} - {withdrawn} = {expected}"
            )
        negative = {k: b for k, (b, _) in balances.items() if b < 0}
        if negative:
            violations.append(f"instance {inst.name}: negative balances {negative}")
        violations.extend(f"instance {inst.name}: anomaly {a}" for a in inst.db.anomaly_list())
        if balances != reference:
            violations.append(
                f"instance {inst.name} disagrees with instance {instances[0].name}: "
                f"{_diff(reference, balances)}"
            )
        marks = {p: h for p, h in inst.db.high_water_marks().items() if p in target}
        if any(marks.get(p, -1) != h for p, h in target.items()):
            violations.append(f"instance {inst.name}: high-water marks {marks}, log {target}")
    return AutoReport(
        violations=violations,
        duration_s=duration_s,
        totals=totals,
        per_instance=per_instance,
        expected_money=expected,
        accounts=len(reference),
        high_water_marks=target,
    )
