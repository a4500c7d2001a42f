"""Snapshots of the demo bank's database (real SQLite, the MockDriver): consistent while transactions are
applied, a durable file, a restore into an empty database only, and an instance bootstrapped from one that
mounts at the snapshot's marks and ends with the same balances as an instance that never stopped. The trim and
the TrimmedError of an empty instance need a real cluster: tests/integration/test_bank_bootstrap.py."""

from __future__ import annotations

import builtins
import json
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from demo.bank.__main__ import main
from demo.bank.app import BankInstance, make_engine
from demo.bank.model import COMMITTED, BankDb
from demo.bank.snapshot import (
    Snapshot,
    SnapshotError,
    read_snapshot,
    restore_snapshot,
    take_snapshot,
    trim_point_below,
    write_snapshot,
)

from waltz import ClientConfig
from waltz.testing import MockCluster, MockDriver

pytestmark = pytest.mark.timeout(120)


def instance(tmp_path: Path, name: str, cluster: MockCluster) -> BankInstance:
    engine, suffix = make_engine(None, tmp_path, name)
    return BankInstance(name, engine, ClientConfig(), suffix=suffix, driver=MockDriver(cluster=cluster))


def db_of(tmp_path: Path, name: str) -> BankDb:
    engine, suffix = make_engine(None, tmp_path, name)
    return BankDb(engine, suffix)


def test_an_instance_bootstrapped_from_a_snapshot_ends_like_one_that_never_stopped(tmp_path: Path) -> None:
    cluster = MockCluster(2)
    with instance(tmp_path, "steady", cluster) as steady, instance(tmp_path, "source", cluster) as source:
        for account in range(6):
            steady.wait_applied(steady.deposit(account, 100 + account))
        assert source.wait_caught_up(10)
        assert source.wait_applied(source.withdraw(3, 50)) == COMMITTED
        snapshot = take_snapshot(source.db)
    write_snapshot(snapshot, tmp_path / "snap" / "s.json")
    assert snapshot.high_water_marks == {0: 2, 1: 3}  # accounts 0, 2, 4; 1, 3, 5 and the withdrawal
    with instance(tmp_path, "steady", cluster) as steady:  # its own database, still there
        assert steady.wait_caught_up(10)
        assert steady.wait_applied(steady.deposit(7, 70)) == COMMITTED
        assert steady.wait_applied(steady.withdraw(0, 100)) == COMMITTED
        expected = steady.db.balances()
        restored_db = db_of(tmp_path, "restored")
        restore_snapshot(read_snapshot(tmp_path / "snap" / "s.json"), restored_db)
        restored_db.engine.dispose()
        with instance(tmp_path, "restored", cluster) as restored:
            # The client mounts at the snapshot's marks: only what came after is delivered.
            assert restored.wait_caught_up(10)
            assert restored.client.applied_high_water_mark(0) == 3
            assert restored.db.balances() == expected
            assert restored.db.high_water_marks() == steady.db.high_water_marks() == {0: 3, 1: 4}
            assert restored.db.anomaly_list() == []


def test_a_snapshot_taken_while_a_transaction_commits_is_not_torn(tmp_path: Path) -> None:
    check_a_snapshot_is_not_torn(db_of(tmp_path, "busy"))


def check_a_snapshot_is_not_torn(db: BankDb) -> None:
    """The snapshot reads the marks first; a transaction applied (state and mark in one commit, as
    SqlClientCallbacks does) right after that read must not show in the accounts read next. Also run on
    PostgreSQL (tests/integration/sql/test_bank_snapshot_pg.py)."""
    with db.engine.begin() as conn:
        conn.execute(sa.insert(db.hwm).values(partition_id=0, high_water_mark=0))
        conn.execute(sa.insert(db.accounts).values(id=1, balance=10, active=True))
    sqlite = db.engine.dialect.name == "sqlite"
    writer = sa.create_engine(db.engine.url, connect_args={"timeout": 5} if sqlite else {})
    applied: list[int] = []

    @sa.event.listens_for(db.engine, "after_cursor_execute")
    def apply_one_more(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if db.hwm.name in statement and not applied:
            applied.append(1)
            with writer.begin() as conn:
                conn.execute(sa.update(db.accounts).values(balance=db.accounts.c.balance + 5))
                conn.execute(sa.update(db.hwm).values(high_water_mark=db.hwm.c.high_water_mark + 1))

    snapshot = take_snapshot(db)
    assert applied == [1]
    assert (snapshot.high_water_marks, snapshot.accounts) == ({0: 0}, [(1, 10, True)])
    assert (db.high_water_marks(), db.balances()) == ({0: 1}, {1: (15, True)})  # it did commit
    writer.dispose()
    db.engine.dispose()


def test_the_snapshot_file_round_trips_and_is_replaced_whole(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    first = Snapshot({0: 5, 1: -1}, [(1, 10, True), (2, 0, False)], [(0, 3, "odd")], 1234)
    write_snapshot(first, path)
    assert read_snapshot(path) == first
    second = Snapshot({0: 9}, [], [], 5678)
    write_snapshot(second, path)
    assert read_snapshot(path) == second
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json"]  # no temporary file left
    assert json.loads(path.read_text())["high_water_marks"] == {"0": 9}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        ("{not json", "cannot be read"),
        ('{"format": "other", "version": 1}', "not a bank snapshot of version 1"),
        (
            '{"format": "waltz-bank-snapshot", "version": 1, "taken_at_ms": 0, "high_water_marks": '
            '{"0": -2}, "accounts": [], "anomalies": []}',
            "bad high-water marks",
        ),
        (
            '{"format": "waltz-bank-snapshot", "version": 1, "taken_at_ms": 0, "high_water_marks": {}, '
            '"accounts": [[1, 2, "yes"]], "anomalies": []}',
            "active must be true or false",
        ),
    ],
)
def test_a_bad_snapshot_file_is_named(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "s.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SnapshotError, match=f"snapshot {path}: .*{message}"):
        read_snapshot(path)


def test_a_snapshot_is_restored_into_an_empty_database_only(tmp_path: Path) -> None:
    db = db_of(tmp_path, "used")
    with db.engine.begin() as conn:  # Marks at -1: an instance that mounted but applied nothing.
        conn.execute(sa.insert(db.hwm).values(partition_id=0, high_water_mark=-1))
        conn.execute(sa.insert(db.hwm).values(partition_id=1, high_water_mark=-1))
    restore_snapshot(Snapshot({0: 3}, [(1, 1, True)], [], 0), db)
    assert (db.high_water_marks(), db.balances()) == ({0: 3}, {1: (1, True)})
    with db.engine.begin() as conn:
        conn.execute(sa.update(db.hwm).values(high_water_mark=7))
    with pytest.raises(SnapshotError, match=r"table bank_hwm of sqlite:///.*bank-used\.db is not empty"):
        restore_snapshot(Snapshot({0: 3}, [(1, 1, True)], [], 0), db)
    assert (db.high_water_marks(), db.balances()) == ({0: 7}, {1: (1, True)})
    db.engine.dispose()


def test_the_trim_point_keeps_the_margin_below_the_snapshot() -> None:
    snapshot = Snapshot({0: 99, 1: 3, 2: -1}, [], [], 0)
    assert trim_point_below(snapshot, 0, 0) == 100
    assert trim_point_below(snapshot, 0, 10) == 90
    assert trim_point_below(snapshot, 1, 10) == 0
    assert trim_point_below(snapshot, 2, 0) == 0
    with pytest.raises(ValueError, match="the margin must be at least 0, got -1"):
        trim_point_below(snapshot, 0, -1)
    with pytest.raises(SnapshotError, match="no high-water mark for partition 5"):
        trim_point_below(snapshot, 5, 0)


def test_the_command_line_snapshots_and_starts_from_a_snapshot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "data"
    assert main(["--dir", str(data), "--name", "nobody", "snapshot", "--out", str(tmp_path / "x")]) == 1
    assert "instance nobody applied nothing yet; no snapshot written" in capsys.readouterr().err
    cluster = MockCluster(1)
    engine, _ = make_engine(None, data, "a")
    with BankInstance("a", engine, ClientConfig(), driver=MockDriver(cluster=cluster)) as a:
        a.wait_applied(a.deposit(4, 40))
    out = tmp_path / "a.json"
    assert main(["--dir", str(data), "--name", "a", "snapshot", "--out", str(out)]) == 0
    assert f"snapshot of instance a: 1 accounts at high-water marks {{0: 0}}, written to {out}" in (
        capsys.readouterr().out
    )

    def no_input(_prompt: str = "") -> str:
        raise EOFError

    monkeypatch.setattr(builtins, "input", no_input)
    args = ["--mock", "1", "--dir", str(data), "--name", "b", "--from-snapshot", str(out)]
    assert main(args) == 0
    assert f"instance b starts from {out}: 1 accounts" in capsys.readouterr().out
    assert db_of(data, "b").balances() == {4: (40, True)}
    assert main(args) == 1  # b's database is not empty any more
    assert "table bank_hwm of sqlite:///" in capsys.readouterr().err
