"""The demo bank on the MockDriver: operations, locks, the automatic mode and its invariant checks."""

from __future__ import annotations

import io
import subprocess
import threading
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from demo.bank.__main__ import instance_factory, interactive
from demo.bank.app import BankInstance, make_engine
from demo.bank.auto import AutoOptions, Drill, run_auto
from demo.bank.model import COMMITTED, DECLINED, BankDb
from rich.console import Console

from waltz import ClientConfig
from waltz.testing import MockCluster, MockDriver

pytestmark = pytest.mark.timeout(120)


def make_instance(tmp_path: Path, name: str, cluster: MockCluster) -> BankInstance:
    engine, suffix = make_engine(None, tmp_path, name)
    return BankInstance(name, engine, ClientConfig(), suffix=suffix, driver=MockDriver(cluster=cluster))


def test_deposit_withdraw_deactivate(tmp_path: Path) -> None:
    with make_instance(tmp_path, "a", MockCluster(2)) as bank:
        assert bank.wait_applied(bank.deposit(1, 100)) == COMMITTED
        assert bank.balance(1) == (100, True)
        assert bank.wait_applied(bank.withdraw(1, 30)) == COMMITTED
        assert bank.wait_applied(bank.withdraw(1, 500)) == DECLINED  # insufficient
        assert bank.wait_applied(bank.withdraw(9, 1)) == DECLINED  # unknown account
        assert bank.wait_applied(bank.deactivate(1)) == COMMITTED
        assert bank.wait_applied(bank.withdraw(1, 10)) == DECLINED  # inactive
        assert bank.wait_applied(bank.deactivate(1)) == DECLINED  # already inactive
        assert bank.balance(1) == (70, False)
        assert bank.db.anomaly_list() == []


def test_racing_withdrawals_cannot_overdraw(tmp_path: Path) -> None:
    cluster = MockCluster(1)
    driver = MockDriver(cluster=cluster)
    engine, _ = make_engine(None, tmp_path, "race")
    with BankInstance("race", engine, ClientConfig(), driver=driver) as bank:
        bank.wait_applied(bank.deposit(3, 100))
        driver.suspend_feed()  # both withdrawals read the balance 100
        first, second = bank.withdraw(3, 70), bank.withdraw(3, 70)
        driver.resume_feed()
        outcomes = sorted([bank.wait_applied(first) or "", bank.wait_applied(second) or ""])
        assert outcomes == [COMMITTED, DECLINED]
        # The loser executed again on the fresh balance: the two contexts of this client took turns on the
        # account's write lock (waltz.client.lock_queue), so it was re-executed without a lock failure.
        assert sorted([first.result.attempts, second.result.attempts]) == [1, 2]
        assert bank.balance(3) == (30, True)


def test_deactivation_makes_a_racing_withdrawal_fail(tmp_path: Path) -> None:
    driver = MockDriver(cluster=MockCluster(1))
    engine, _ = make_engine(None, tmp_path, "deact")
    with BankInstance("deact", engine, ClientConfig(), driver=driver) as bank:
        bank.wait_applied(bank.deposit(4, 50))
        driver.suspend_feed()
        deactivate, withdraw = bank.deactivate(4), bank.withdraw(4, 10)
        driver.resume_feed()
        assert bank.wait_applied(deactivate) == COMMITTED
        assert bank.wait_applied(withdraw) == DECLINED
        assert bank.balance(4) == (50, False)


def test_two_instances_with_their_own_databases_agree(tmp_path: Path) -> None:
    cluster = MockCluster(2)
    with make_instance(tmp_path, "x", cluster) as x, make_instance(tmp_path, "y", cluster) as y:
        x.wait_applied(x.deposit(1, 10))
        y.wait_applied(y.deposit(2, 20))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not x.db.balances() == y.db.balances() == {
            1: (10, True),
            2: (20, True),
        }:
            time.sleep(0.02)
        assert x.db.balances() == y.db.balances() == {1: (10, True), 2: (20, True)}
        assert x.db.high_water_marks() == y.db.high_water_marks()


def test_tables_are_suffixed_per_instance_in_a_shared_database(tmp_path: Path) -> None:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'shared.db'}")
    BankDb(engine, "_1")
    BankDb(engine, "_2")
    names = set(sa.inspect(engine).get_table_names())
    assert {"bank_accounts_1", "bank_accounts_2", "bank_hwm_1", "bank_hwm_2"} <= names
    engine.dispose()


def test_automatic_mode_holds_its_invariants_under_dropped_appends(tmp_path: Path) -> None:
    cluster = MockCluster(3)
    drivers: list[MockDriver] = []

    def driver() -> MockDriver:
        d = MockDriver(cluster=cluster, seed=len(drivers))
        d.set_fault_rate(0.1)
        drivers.append(d)
        return d

    factory = instance_factory(ClientConfig(long_wait_threshold_ms=50), tmp_path, None, driver)
    fired: list[str] = []
    opts = AutoOptions(
        instances=3, duration_s=3, accounts=10, rate_per_instance=60, seed=7, settle_timeout_s=30
    )
    report = run_auto(
        factory,
        opts,
        [Drill(1, "mark", lambda: fired.append("x"))],
        Console(file=io.StringIO()),
    )
    assert report.ok, report.render()
    assert fired == ["x"]
    assert report.totals["committed"] > 20
    assert "invariants hold" in report.render()
    assert sum(d.appends_dropped for d in drivers) > 0


def test_invariant_check_catches_a_database_that_diverged(tmp_path: Path) -> None:
    cluster = MockCluster(1)
    made: list[BankInstance] = []

    def factory(name: str) -> BankInstance:
        inst = instance_factory(ClientConfig(), tmp_path, None, lambda: MockDriver(cluster=cluster))(name)
        made.append(inst)
        return inst

    def tamper() -> None:
        with made[1].db.engine.begin() as conn:
            conn.execute(sa.insert(made[1].db.accounts).values(id=999, balance=-5, active=True))

    opts = AutoOptions(instances=2, duration_s=1.5, accounts=5, rate_per_instance=40, seed=8, display=False)
    report = run_auto(factory, opts, [Drill(0.5, "tamper", tamper)])
    assert not report.ok
    text = "\n".join(report.violations)
    assert "instance 1: money not conserved" in text
    assert "instance 1: negative balances {999: -5}" in text
    assert "instance 1 disagrees with instance 0" in text


def test_interactive_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with make_instance(tmp_path, "i", MockCluster(1)) as bank:
        interactive(
            bank, ["deposit 1 50", "withdraw 1 80", "balance 1", "deactivate 1", "balance 1", "bogus", "quit"]
        )
    out = capsys.readouterr().out
    assert "committed" in out
    assert "aborted" in out
    assert "50 (active)" in out
    assert "50 (inactive)" in out


def test_negative_amounts_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with make_instance(tmp_path, "neg", MockCluster(1)) as bank:
        bank.wait_applied(bank.deposit(4, 10))
        interactive(
            bank, ["deposit 3 -50", "withdraw 4 -1000", "deposit 3 0", "balance 3", "balance 4", "quit"]
        )
        out = capsys.readouterr().out
        assert out.count("amounts must be positive") == 3
        assert "unknown account" in out
        assert "10 (active)" in out
        for kind, amount in (("deposit", -50), ("withdraw", -1000), ("withdraw", 0)):
            with pytest.raises(ValueError, match="must be positive"):
                bank.submit(kind, 4, amount)
        assert bank.stats.submitted == 1
        assert bank.balance(4) == (10, True)


def test_a_negative_amount_in_the_log_is_not_applied(tmp_path: Path) -> None:
    """Transactions an older version wrote with negative amounts are recorded as anomalies, never applied."""
    from demo.bank.model import Deposit, Withdraw

    with make_instance(tmp_path, "old", MockCluster(1)) as bank:
        bank.wait_applied(bank.deposit(4, 10))
        for context in (Deposit(bank.db, 3, -50), Withdraw(bank.db, 4, -1000)):
            bank.client.submit(context)
            bank.wait_applied(context)
        assert bank.balance(3) is None
        assert bank.balance(4) == (10, True)
        anomalies = bank.db.anomaly_list()
        assert len(anomalies) == 2
        assert all("non-positive amount" in a for a in anomalies)


def test_the_repl_answers_only_once_caught_up(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cluster = MockCluster(1)
    with make_instance(tmp_path, "writer", cluster) as writer:
        writer.wait_applied(writer.deposit(1, 100))
    driver = MockDriver(cluster=cluster)
    engine, suffix = make_engine(None, tmp_path, "reader")
    driver.suspend_feed()  # the new instance has not received the deposit yet
    with BankInstance("reader", engine, ClientConfig(), suffix=suffix, driver=driver) as reader:
        threading.Timer(0.3, driver.resume_feed).start()
        interactive(reader, ["balance 1", "quit"])
    out = capsys.readouterr().out
    assert "100 (active)" in out
    assert "unknown account" not in out


def test_the_default_data_directory_is_ignored_by_git() -> None:
    root = Path(__file__).resolve().parents[2]
    probe = subprocess.run(
        ["git", "check-ignore", "-q", "bank-data/bank-interactive.db"], cwd=root, check=False
    )
    assert probe.returncode == 0


def test_the_quickstart_names_only_flags_demo_run_accepts() -> None:
    import re

    from demo.run import build_parser

    text = (Path(__file__).resolve().parents[2] / "docs" / "quickstart.md").read_text()
    paragraph = text[text.index("`python -m demo.run --help`") :].split("\n\n")[0]
    flags = set(re.findall(r"`(--[a-z-]+)", paragraph))
    assert flags == {"--seconds", "--dir", "--no-report"}
    accepted = {flag for action in build_parser()._actions for flag in action.option_strings}
    assert flags <= accepted, flags - accepted
