"""SqlClientCallbacks: the high-water mark lives in the application's database and advances in the same
database transaction that applies the transaction, so several application instances sharing the database
apply each transaction exactly once. Run on a SQLite file and on a real PostgreSQL."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import OperationalError

from waltz import ClientConfig, Transaction, TransactionBuilder, TransactionContext, WaltzClient
from waltz.client.serializer import JsonSerializer
from waltz.client.sql import GuardedConnection, SqlClientCallbacks
from waltz.errors import ClientError
from waltz.protocol.records import ReqId
from waltz.testing import MockCluster, MockDriver

JSON = JsonSerializer()
METADATA = sa.MetaData()
ACCOUNTS = sa.Table(
    "accounts",
    METADATA,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("balance", sa.BigInteger, nullable=False),
)
APPLIED = sa.Table(  # One row per applied transaction: the primary key catches a double application.
    "applied",
    METADATA,
    sa.Column("partition_id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("transaction_id", sa.BigInteger, primary_key=True, autoincrement=False),
    sa.Column("instance", sa.Integer, nullable=False),
)


class Bank(SqlClientCallbacks):
    """Applies deposits: ``{"account": id, "amount": n}``."""

    def __init__(self, engine: sa.Engine, instance: int = 0, **kwargs: Any) -> None:
        super().__init__(engine, **kwargs)
        self.instance = instance
        self.errors: list[BaseException] = []

    def apply(self, transaction: Transaction, connection: GuardedConnection) -> None:
        body = transaction.get_transaction_data(JSON)
        connection.execute(
            sa.insert(APPLIED).values(
                partition_id=transaction.partition_id,
                transaction_id=transaction.transaction_id,
                instance=self.instance,
            )
        )
        updated = connection.execute(
            sa.update(ACCOUNTS)
            .where(ACCOUNTS.c.id == body["account"])
            .values(balance=ACCOUNTS.c.balance + body["amount"])
        )
        if updated.rowcount == 0:
            connection.execute(sa.insert(ACCOUNTS).values(id=body["account"], balance=body["amount"]))

    @property
    def owned(self) -> int:
        """Transactions this instance applied and committed (a rolled-back attempt leaves no row)."""
        with self.engine.connect() as conn:
            query = sa.select(sa.func.count()).select_from(APPLIED).where(APPLIED.c.instance == self.instance)
            return int(conn.execute(query).scalar_one())

    def uncaught_exception(self, partition_id: int, transaction_id: int, exception: BaseException) -> None:
        self.errors.append(exception)


class Deposit(TransactionContext):
    def __init__(self, account: int, amount: int) -> None:
        super().__init__()
        self.account, self.amount = account, amount

    def partition_id(self, num_partitions: int) -> int:
        return self.account % num_partitions

    def execute(self, builder: TransactionBuilder) -> bool:
        builder.set_transaction_data({"account": self.account, "amount": self.amount}, JSON)
        return True


class _Source:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def fetch_blocking(self, partition_id: int, transaction_id: int) -> bytes:
        return self.data

    async def fetch(self, partition_id: int, transaction_id: int) -> bytes:
        return self.data


def txn(transaction_id: int, account: int = 1, amount: int = 10, partition: int = 0) -> Transaction:
    data = JSON.serialize({"account": account, "amount": amount})
    return Transaction(partition, transaction_id, 0, ReqId.of(0, 0, partition, 1), _Source(data))


def make_engine(url: str) -> sa.Engine:
    if url.startswith("sqlite"):
        # A generous busy timeout: instances (threads here) queue for SQLite's single writer lock.
        return sa.create_engine(url, connect_args={"timeout": 30})
    return sa.create_engine(url, pool_size=5, max_overflow=5)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.integration)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'app.db'}"
    url: str = request.getfixturevalue("pg_url")
    return url


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    engine = make_engine(db_url)
    METADATA.create_all(engine)
    yield engine
    engine.dispose()


def balances(engine: sa.Engine) -> dict[int, int]:
    with engine.connect() as conn:
        return {row.id: row.balance for row in conn.execute(sa.select(ACCOUNTS))}


def hwm_rows(engine: sa.Engine) -> dict[int, int]:
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT partition_id, high_water_mark FROM waltz_high_water_marks"))
        return {row[0]: row[1] for row in rows}


def test_high_water_mark_row_is_created_at_minus_one_and_advanced_with_each_apply(engine: sa.Engine) -> None:
    bank = Bank(engine)
    assert bank.client_high_water_mark(0) == -1
    assert bank.client_high_water_mark(0) == -1  # Created once.
    bank.apply_transaction(txn(0, amount=5))
    bank.apply_transaction(txn(1, amount=7))
    assert hwm_rows(engine) == {0: 1}
    assert balances(engine) == {1: 12}
    assert Bank(engine).client_high_water_mark(0) == 1  # A new instance starts from the database.


def test_second_instance_skips_what_the_first_applied(engine: sa.Engine) -> None:
    first, second = Bank(engine, 1), Bank(engine, 2)
    assert first.client_high_water_mark(0) == second.client_high_water_mark(0) == -1
    for i in range(3):
        first.apply_transaction(txn(i))
    for i in range(4):
        second.apply_transaction(txn(i))  # 0..2: UPDATE matches no row, re-read; 3: owned.
    assert (first.owned, second.owned) == (3, 1)
    assert balances(engine) == {1: 40}
    assert hwm_rows(engine) == {0: 3}


def test_failed_apply_rolls_back_the_application_and_the_mark(engine: sa.Engine) -> None:
    class Broken(Bank):
        def apply(self, transaction: Transaction, connection: GuardedConnection) -> None:
            super().apply(transaction, connection)
            raise ValueError("application bug")

    bank = Broken(engine)
    bank.client_high_water_mark(0)
    with pytest.raises(ValueError, match="application bug"):
        bank.apply_transaction(txn(0))
    assert hwm_rows(engine) == {0: -1}
    assert balances(engine) == {}
    Bank(engine).apply_transaction(txn(0))
    assert balances(engine) == {1: 10}


def test_transient_database_errors_are_retried(engine: sa.Engine) -> None:
    class Flaky(Bank):
        failures = 2

        def apply(self, transaction: Transaction, connection: GuardedConnection) -> None:
            if self.failures:
                self.failures -= 1
                raise OperationalError("UPDATE ...", {}, Exception("could not serialize access"))
            super().apply(transaction, connection)

    bank = Flaky(engine, initial_backoff_ms=1)
    bank.client_high_water_mark(0)
    bank.apply_transaction(txn(0))
    assert balances(engine) == {1: 10}
    assert hwm_rows(engine) == {0: 0}


def test_the_connection_given_to_apply_cannot_end_the_transaction(engine: sa.Engine) -> None:
    seen: list[str] = []

    class Sneaky(Bank):
        def apply(self, transaction: Transaction, connection: GuardedConnection) -> None:
            for name in ("commit", "rollback", "begin", "close"):
                with pytest.raises(ClientError, match=f"{name}\\(\\) is not allowed"):
                    getattr(connection, name)()
                seen.append(name)
            with pytest.raises(AttributeError):
                _ = connection.no_such_thing
            assert connection.scalar(sa.select(sa.literal(1))) == 1
            assert connection.dialect.name in ("sqlite", "postgresql")
            super().apply(transaction, connection)

    bank = Sneaky(engine)
    bank.client_high_water_mark(0)
    bank.apply_transaction(txn(0))
    assert seen == ["commit", "rollback", "begin", "close"]
    assert balances(engine) == {1: 10}


def test_a_gap_between_the_database_and_the_feed_is_an_error(engine: sa.Engine) -> None:
    bank = Bank(engine)
    bank.client_high_water_mark(0)
    with pytest.raises(ClientError, match="would leave a gap"):
        bank.apply_transaction(txn(5))


@pytest.mark.parametrize("instances", [3])
def test_many_instances_sharing_one_database_apply_every_transaction_exactly_once(
    db_url: str, engine: sa.Engine, instances: int
) -> None:
    cluster = MockCluster(num_partitions=2)
    config = ClientConfig(long_wait_threshold_ms=100, retry_initial_backoff_ms=1, retry_max_backoff_ms=20)
    isolation = "SERIALIZABLE" if db_url.startswith("postgresql") else None
    banks = [Bank(make_engine(db_url), n, isolation_level=isolation) for n in range(instances)]
    drivers = [MockDriver(cluster=cluster, seed=n) for n in range(instances)]
    for d in drivers:
        d.set_fault_rate(0.1)
        d.set_max_delay(2)
    clients = [WaltzClient(bank, config, driver=d) for bank, d in zip(banks, drivers, strict=True)]
    per_instance = 30
    try:

        def produce(n: int) -> None:
            for i in range(per_instance):
                clients[n].submit(Deposit(account=i % 5, amount=n * 1000 + i))
            clients[n].flush_transactions(timeout=60)

        threads = [threading.Thread(target=produce, args=(n,)) for n in range(instances)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        total = instances * per_instance
        assert cluster.high_water_mark(0) + cluster.high_water_mark(1) + 2 == total
        # Every instance follows the whole log; wait until each one's feed reached the end.
        deadline = time.monotonic() + 60
        expected = {0: cluster.high_water_mark(0), 1: cluster.high_water_mark(1)}
        while hwm_rows(engine) != expected and time.monotonic() < deadline:
            time.sleep(0.05)
        for client in clients:
            client.flush_transactions(timeout=60)
        owned = [bank.owned for bank in banks]
    finally:
        for client in clients:
            client.close()
        for bank in banks:
            bank.engine.dispose()
    assert hwm_rows(engine) == expected
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(APPLIED)).scalar_one() == total
    assert sum(owned) == total  # Each transaction applied by exactly one instance (PK on applied).
    expected_balances: dict[int, int] = {}
    for n in range(instances):
        for i in range(per_instance):
            expected_balances[i % 5] = expected_balances.get(i % 5, 0) + n * 1000 + i
    assert balances(engine) == expected_balances
    assert [e for bank in banks for e in bank.errors] == []


def test_a_poisoned_transaction_logs_one_traceback_however_often_it_is_redelivered(
    engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    attempts = threading.Semaphore(0)

    class Poisoned(Bank):
        uncaught_exception = SqlClientCallbacks.uncaught_exception  # type: ignore[assignment]

        def apply(self, transaction: Transaction, connection: GuardedConnection) -> None:
            attempts.release()
            raise ValueError("poisoned")

    cluster = MockCluster(num_partitions=1)
    client = WaltzClient(Poisoned(engine), ClientConfig(), driver=MockDriver(cluster=cluster))
    try:
        with caplog.at_level("ERROR", logger="waltz"):
            client.submit(Deposit(account=1, amount=5))
            for _ in range(6):  # The first delivery and five redeliveries.
                assert attempts.acquire(timeout=30)
    finally:
        client.close()
    tracebacks = [r for r in caplog.records if r.exc_info is not None]
    assert len(tracebacks) == 1, [r.getMessage() for r in tracebacks]
    assert "transaction 0" in tracebacks[0].getMessage()
