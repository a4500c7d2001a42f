"""The bank's data, its transactions, and how a committed transaction changes the database.

The database is a *materialized view of the log*: nothing writes to it except :class:`BankCallbacks`, which
applies each committed transaction exactly once, in log order, together with the partition's high-water mark
(``SqlClientCallbacks``). So any instance, or a fresh database replaying the log from the start, ends up with
the same balances.

Operations (one JSON object per transaction; partition = account id modulo the partition count, so every
lock on an account lives in one partition):

============  ==================================================================  ==========================
operation     execute()                                                           locks
============  ==================================================================  ==========================
deposit       always appends                                                      none
withdraw      reads the balance and the active flag; gives up if the account is   write ``withdrawal:id``,
              unknown, inactive, or the balance is insufficient                    read ``account:id``
deactivate    gives up if the account is unknown or already inactive               write ``account:id``
============  ==================================================================  ==========================

Two withdrawals computed from the same balance conflict on ``withdrawal:id``: the second is rejected and
executed again on the new balance. A deactivation takes ``account:id``, so a withdrawal that read the account
while it was active is rejected. Therefore a correct cluster never lets a balance go negative and never
applies a withdrawal to an inactive account; :class:`BankCallbacks` applies every transaction
deterministically anyway and records any such case in the anomalies table, which the invariant check
requires to be empty.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from waltz import PartitionLocalLock, Transaction, TransactionBuilder, TransactionContext
from waltz.client.serializer import JsonSerializer
from waltz.client.sql import GuardedConnection, SqlClientCallbacks, high_water_mark_table

JSON = JsonSerializer()

DEPOSIT = "deposit"
WITHDRAW = "withdraw"
DEACTIVATE = "deactivate"


class BankDb:
    """One instance's tables. ``suffix`` names them apart, so several instances can share one database
    server (``--db-url``) and still each keep its own view: ``bank_accounts<suffix>``,
    ``bank_anomalies<suffix>``, ``bank_hwm<suffix>`` (the high-water marks)."""

    def __init__(self, engine: sa.Engine, suffix: str = "") -> None:
        self.engine = engine
        self.suffix = suffix
        self.metadata = sa.MetaData()
        self.accounts = sa.Table(
            f"bank_accounts{suffix}",
            self.metadata,
            sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
            sa.Column("balance", sa.BigInteger, nullable=False),
            sa.Column("active", sa.Boolean, nullable=False),
        )
        self.anomalies = sa.Table(
            f"bank_anomalies{suffix}",
            self.metadata,
            sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
            sa.Column("partition_id", sa.Integer, nullable=False),
            sa.Column("transaction_id", sa.BigInteger, nullable=False),
            sa.Column("what", sa.String(200), nullable=False),
        )
        self.hwm_table_name = f"bank_hwm{suffix}"
        self.hwm = high_water_mark_table(self.metadata, self.hwm_table_name)
        self.metadata.create_all(engine)

    def account(self, account_id: int) -> tuple[int, bool] | None:
        """(balance, active) as the database has it now, or None for an unknown account."""
        a = self.accounts
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(a.c.balance, a.c.active).where(a.c.id == account_id)).first()
        return None if row is None else (int(row.balance), bool(row.active))

    def balances(self) -> dict[int, tuple[int, bool]]:
        a = self.accounts
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(a.c.id, a.c.balance, a.c.active).order_by(a.c.id)).all()
        return {int(r.id): (int(r.balance), bool(r.active)) for r in rows}

    def anomaly_list(self) -> list[str]:
        t = self.anomalies
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(t.c.partition_id, t.c.transaction_id, t.c.what).order_by(t.c.id)
            ).all()
        return [f"partition {r.partition_id} transaction {r.transaction_id}: {r.what}" for r in rows]

    def high_water_marks(self) -> dict[int, int]:
        t = self.hwm
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(t.c.partition_id, t.c.high_water_mark)).all()
        return {int(r.partition_id): int(r.high_water_mark) for r in rows}

    def drop(self) -> None:
        self.metadata.drop_all(self.engine)


class BankCallbacks(SqlClientCallbacks):
    """Applies committed bank transactions to a :class:`BankDb`, exactly once each (see the module doc)."""

    def __init__(self, db: BankDb) -> None:
        super().__init__(db.engine, table_name=db.hwm_table_name)
        self.db = db
        self.errors: list[str] = []
        self._errors_lock = threading.Lock()

    def apply(self, transaction: Transaction, connection: GuardedConnection) -> None:
        op = transaction.get_transaction_data(JSON)
        a = self.db.accounts
        kind, account_id = op["op"], int(op["account"])
        row = connection.execute(sa.select(a.c.balance, a.c.active).where(a.c.id == account_id)).first()
        where = a.c.id == account_id

        def anomaly(what: str) -> None:
            connection.execute(
                sa.insert(self.db.anomalies).values(
                    partition_id=transaction.partition_id,
                    transaction_id=transaction.transaction_id,
                    what=what,
                )
            )

        if kind in (DEPOSIT, WITHDRAW) and int(op["amount"]) <= 0:
            # Written by an older version that accepted them: applying it would create money.
            anomaly(f"{kind} of a non-positive amount {op['amount']} to account {account_id}, not applied")
            return
        if kind == DEPOSIT:
            amount = int(op["amount"])
            if row is None:
                connection.execute(sa.insert(a).values(id=account_id, balance=amount, active=True))
            else:
                connection.execute(sa.update(a).where(where).values(balance=a.c.balance + amount))
        elif kind == WITHDRAW:
            amount = int(op["amount"])
            if row is None:
                anomaly(f"withdrawal of {amount} from unknown account {account_id}")
                connection.execute(sa.insert(a).values(id=account_id, balance=-amount, active=True))
                return
            if not row.active:
                anomaly(f"withdrawal of {amount} from deactivated account {account_id}")
            if row.balance < amount:
                anomaly(f"withdrawal of {amount} from account {account_id} holding {row.balance}")
            connection.execute(sa.update(a).where(where).values(balance=a.c.balance - amount))
        elif kind == DEACTIVATE:
            if row is None:
                connection.execute(sa.insert(a).values(id=account_id, balance=0, active=False))
            else:
                connection.execute(sa.update(a).where(where).values(active=False))
        else:
            anomaly(f"unknown operation {kind!r}")

    def uncaught_exception(self, partition_id: int, transaction_id: int, exception: BaseException) -> None:
        with self._errors_lock:
            self.errors.append(f"partition {partition_id} transaction {transaction_id}: {exception!r}")
        super().uncaught_exception(partition_id, transaction_id, exception)


# ------------------------------------------------------------------------------------------------- contexts

COMMITTED = "committed"
DECLINED = "declined"
FAILED = "failed"

Outcome = Callable[["BankContext", str], None]


@dataclass
class OpResult:
    """What became of one operation (set once its context ended)."""

    outcome: str | None = None
    error: BaseException | None = None
    attempts: int = 0
    lock_failures: int = 0


class BankContext(TransactionContext):
    """Common part of the bank's contexts: partitioning by account and recording the outcome.

    ``done`` (optional) is called once, from a client callback thread, when the context ends.
    """

    kind = ""

    def __init__(self, db: BankDb, account_id: int, amount: int = 0, done: Outcome | None = None) -> None:
        super().__init__()
        self.db = db
        self.account_id = account_id
        self.amount = amount
        self.result = OpResult()
        self._done = done
        self._finished = threading.Event()

    def partition_id(self, num_partitions: int) -> int:
        return self.account_id % num_partitions

    def op(self) -> dict[str, Any]:
        return {"op": self.kind, "account": self.account_id, "amount": self.amount}

    def on_completion(self, result: bool) -> None:
        self._finish(COMMITTED if result else DECLINED)

    def on_exception(self, exception: BaseException) -> None:
        self.result.error = exception
        self._finish(FAILED)

    def on_lock_failure(self) -> None:
        self.result.lock_failures += 1

    def _finish(self, outcome: str) -> None:
        self.result.outcome = outcome
        if self._done is not None:
            self._done(self, outcome)
        self._finished.set()

    def wait(self, timeout_s: float) -> str | None:
        """Block until the context ended (its outcome), or None after ``timeout_s``."""
        self._finished.wait(timeout_s)
        return self.result.outcome


class Deposit(BankContext):
    kind = DEPOSIT

    def execute(self, builder: TransactionBuilder) -> bool:
        self.result.attempts += 1
        builder.set_transaction_data(self.op(), JSON)
        return True


class Withdraw(BankContext):
    kind = WITHDRAW

    def execute(self, builder: TransactionBuilder) -> bool:
        self.result.attempts += 1
        state = self.db.account(self.account_id)
        if state is None or not state[1] or state[0] < self.amount:
            return False  # Unknown, inactive or insufficient funds: abort.
        builder.set_transaction_data(self.op(), JSON)
        # A withdrawal committed since our read changed the balance we checked.
        builder.set_write_locks([PartitionLocalLock("withdrawal", self.account_id)])
        # A deactivation committed since our read makes the account unusable.
        builder.set_read_locks([PartitionLocalLock("account", self.account_id)])
        return True


class Deactivate(BankContext):
    kind = DEACTIVATE

    def execute(self, builder: TransactionBuilder) -> bool:
        self.result.attempts += 1
        state = self.db.account(self.account_id)
        if state is None or not state[1]:
            return False
        builder.set_transaction_data(self.op(), JSON)
        builder.set_write_locks([PartitionLocalLock("account", self.account_id)])
        return True


def check_amount(kind: str, amount: int) -> None:
    """Deposits and withdrawals move a positive amount; ValueError otherwise."""
    if kind in (DEPOSIT, WITHDRAW) and amount <= 0:
        raise ValueError(f"the amount of a {kind} must be positive, got {amount}")


def make_context(
    kind: str, db: BankDb, account_id: int, amount: int = 0, done: Outcome | None = None
) -> BankContext:
    """The context for operation ``kind`` (KeyError for an unknown one)."""
    factories: dict[str, Callable[[], BankContext]] = {
        DEPOSIT: lambda: Deposit(db, account_id, amount, done),
        WITHDRAW: lambda: Withdraw(db, account_id, amount, done),
        DEACTIVATE: lambda: Deactivate(db, account_id, amount, done),
    }
    return factories[kind]()
