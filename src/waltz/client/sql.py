"""``SqlClientCallbacks``: apply every transaction exactly once to a SQL database shared by many instances.

The application keeps each partition's high-water mark in a table of its own database::

    waltz_high_water_marks(partition_id INTEGER PRIMARY KEY, high_water_mark BIGINT NOT NULL)

and applies transaction ``n`` in the **same database transaction** that moves the mark from ``n - 1`` to
``n``::

    UPDATE waltz_high_water_marks SET high_water_mark = high_water_mark + 1
     WHERE partition_id = :p AND high_water_mark = :n - 1

* one row updated: this instance owns transaction ``n``; :meth:`SqlClientCallbacks.apply` runs on the same
  connection and everything commits together (or nothing does);
* no row updated: another instance already applied it; re-read the mark and move on.

Every instance receives every transaction, so whichever instance gets there first applies it and the others
skip it: each committed transaction is applied exactly once, atomically with the mark, whatever the number of
instances and however they crash. A conflict between instances only ever costs a re-read. Transient database
errors (``OperationalError``: lock timeouts, serialization failures, a lost connection) are retried with
backoff a bounded number of times; past that, the error goes to the client, which reports it through
``uncaught_exception`` and delivers the transaction again.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, TypeVar

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    Engine,
    Integer,
    MetaData,
    Table,
    insert,
    select,
    update,
)
from sqlalchemy.engine import CursorResult, Dialect, ScalarResult
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.sql import Executable

from waltz.client.api import ClientCallbacks
from waltz.client.transaction import Transaction
from waltz.errors import ClientError, TrimmedError

__all__ = ["DEFAULT_TABLE_NAME", "GuardedConnection", "SqlClientCallbacks", "high_water_mark_table"]

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_TABLE_NAME = "waltz_high_water_marks"

_Params = Mapping[str, Any] | Sequence[Mapping[str, Any]] | None


def high_water_mark_table(metadata: MetaData, name: str = DEFAULT_TABLE_NAME) -> Table:
    """The high-water-mark table, declared on ``metadata`` (to include it in the application's migrations)."""
    return Table(
        name,
        metadata,
        Column("partition_id", Integer, primary_key=True, autoincrement=False),
        Column("high_water_mark", BigInteger, nullable=False),
    )


class GuardedConnection:
    """The connection :meth:`SqlClientCallbacks.apply` gets: it runs statements, but the transaction belongs
    to the callbacks, so commit, rollback, begin and close are refused (with
    :class:`~waltz.errors.ClientError`)."""

    _FORBIDDEN = frozenset(
        {
            "begin",
            "begin_nested",
            "begin_twophase",
            "close",
            "commit",
            "detach",
            "execution_options",
            "invalidate",
            "rollback",
        }
    )

    def __init__(self, connection: Connection) -> None:
        self._connection = connection

    def execute(self, statement: Executable, parameters: _Params = None) -> CursorResult[Any]:
        return self._connection.execute(statement, parameters)

    def scalar(self, statement: Executable, parameters: Mapping[str, Any] | None = None) -> Any:
        return self._connection.scalar(statement, parameters)

    def scalars(
        self, statement: Executable, parameters: Mapping[str, Any] | None = None
    ) -> ScalarResult[Any]:
        return self._connection.scalars(statement, parameters)

    def exec_driver_sql(self, statement: str, parameters: Any = None) -> CursorResult[Any]:
        return self._connection.exec_driver_sql(statement, parameters)

    @property
    def dialect(self) -> Dialect:
        return self._connection.dialect

    def __getattr__(self, name: str) -> NoReturn:
        if name in self._FORBIDDEN:
            raise ClientError(
                f"{name}() is not allowed here: SqlClientCallbacks commits the application's changes "
                "together with the high-water mark"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


class SqlClientCallbacks(ClientCallbacks):
    """:class:`~waltz.client.api.ClientCallbacks` that apply each transaction exactly once to a database.

    Subclasses implement :meth:`apply` (write the transaction's effects with the given connection) and may
    override :meth:`uncaught_exception` (the default logs). ``engine`` is a SQLAlchemy engine; several
    application instances (processes or threads, each with its own client and engine) may share one database.

    ``isolation_level`` (for example ``"SERIALIZABLE"``) is set on the connections used to apply transactions;
    ``None`` keeps the engine's (the conditional UPDATE is correct under READ COMMITTED and stricter levels).
    ``max_attempts`` bounds the retries of transient database errors per call.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        table_name: str = DEFAULT_TABLE_NAME,
        create_table: bool = True,
        isolation_level: str | None = None,
        max_attempts: int = 10,
        initial_backoff_ms: float = 10.0,
        max_backoff_ms: float = 2000.0,
    ) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
        self.engine = engine
        self.table = high_water_mark_table(MetaData(), table_name)
        self._isolation_level = isolation_level
        self._max_attempts = max_attempts
        self._initial_backoff_ms = initial_backoff_ms
        self._max_backoff_ms = max_backoff_ms
        self._rng = random.Random()
        # partition -> last high-water mark seen in the database. Each partition is applied by one thread at
        # a time (the client's guarantee); the lock only protects the dict across partitions.
        self._cache: dict[int, int] = {}
        self._cache_lock = threading.Lock()
        self._failing_marks: set[int] = set()  # partitions whose mark read failed (logged once each)
        if create_table:
            self._retrying(
                lambda: self.table.create(engine, checkfirst=True), "create the high-water-mark table"
            )

    @abstractmethod
    def apply(self, transaction: Transaction, connection: GuardedConnection) -> None:
        """Apply ``transaction`` with ``connection``, inside the database transaction that advances the
        high-water mark. Raise to roll both back (the client will deliver the transaction again)."""

    def uncaught_exception(self, partition_id: int, transaction_id: int, exception: BaseException) -> None:
        """Have the transaction delivered again. A failed ``apply_transaction`` is logged by the client (its
        traceback once, then a one-line reminder), so only a failed ``client_high_water_mark`` (``-1``) is
        logged here, its traceback once per partition until a read succeeds."""
        if transaction_id >= 0 or partition_id in self._failing_marks or isinstance(exception, TrimmedError):
            return  # A trimmed mount stops the partition; the client logs that once.
        self._failing_marks.add(partition_id)
        log.error(
            "partition %d: reading the high-water mark failed; the client asks again with backoff",
            partition_id,
            exc_info=exception,
        )

    # -- ClientCallbacks ---------------------------------------------------------------------------------

    def client_high_water_mark(self, partition_id: int) -> int:
        """Read the partition's mark, creating its row (at -1) if this is the first instance to see it."""
        hwm = self._retrying(lambda: self._read_or_create(partition_id), f"read the mark of {partition_id}")
        self._set_cache(partition_id, hwm)
        self._failing_marks.discard(partition_id)
        return hwm

    def apply_transaction(self, transaction: Transaction) -> None:
        partition_id = transaction.partition_id
        transaction_id = transaction.transaction_id
        cached = self._get_cache(partition_id)
        if cached is None or cached < transaction_id - 1:
            # Unknown (the client did not ask us first) or apparently behind the feed: read the database.
            cached = self.client_high_water_mark(partition_id)
        if cached >= transaction_id:
            return  # Another instance applied it already.
        if cached < transaction_id - 1:
            raise ClientError(
                f"partition {partition_id}: the database high-water mark is {cached}, so transaction "
                f"{transaction_id} would leave a gap; is the table shared with another Waltz cluster?"
            )
        new_hwm = self._retrying(
            lambda: self._apply_once(transaction), f"apply transaction {partition_id}:{transaction_id}"
        )
        self._set_cache(partition_id, new_hwm)

    # -- internals ---------------------------------------------------------------------------------------

    def _apply_once(self, transaction: Transaction) -> int:
        """One database transaction: claim ``transaction`` and apply it, or learn that it was applied."""
        t = self.table
        partition_id = transaction.partition_id
        transaction_id = transaction.transaction_id
        with self.engine.connect() as connection:
            if self._isolation_level is not None:
                connection = connection.execution_options(isolation_level=self._isolation_level)
            with connection.begin():
                claimed = connection.execute(
                    update(t)
                    .where(t.c.partition_id == partition_id, t.c.high_water_mark == transaction_id - 1)
                    .values(high_water_mark=t.c.high_water_mark + 1)
                )
                if claimed.rowcount == 1:
                    self.apply(transaction, GuardedConnection(connection))
                    return transaction_id
                hwm = connection.execute(select(t.c.high_water_mark).where(t.c.partition_id == partition_id))
                value = hwm.scalar_one_or_none()
                if value is None:
                    raise ClientError(f"partition {partition_id}: the high-water-mark row disappeared")
                return int(value)

    def _read_or_create(self, partition_id: int) -> int:
        t = self.table
        query = select(t.c.high_water_mark).where(t.c.partition_id == partition_id)
        with self.engine.connect() as connection:
            value = connection.execute(query).scalar_one_or_none()
            connection.rollback()
        if value is not None:
            return int(value)
        try:
            with self.engine.begin() as connection:
                connection.execute(insert(t).values(partition_id=partition_id, high_water_mark=-1))
        except IntegrityError:
            pass  # Another instance created the row first: read theirs.
        with self.engine.connect() as connection:
            value = connection.execute(query).scalar_one()
            connection.rollback()
        return int(value)

    def _retrying(self, call: Callable[[], T], what: str) -> T:
        """``call()``, retried with capped exponential backoff on transient database errors."""
        for attempt in range(1, self._max_attempts + 1):
            try:
                return call()
            except OperationalError as e:
                if attempt == self._max_attempts:
                    raise
                bound_ms = min(self._max_backoff_ms, self._initial_backoff_ms * 2.0 ** (attempt - 1))
                log.warning("could not %s (attempt %d of %d): %s", what, attempt, self._max_attempts, e.orig)
                time.sleep(self._rng.uniform(bound_ms / 2, bound_ms) / 1000)
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    def _get_cache(self, partition_id: int) -> int | None:
        with self._cache_lock:
            return self._cache.get(partition_id)

    def _set_cache(self, partition_id: int, hwm: int) -> None:
        with self._cache_lock:
            self._cache[partition_id] = max(hwm, self._cache.get(partition_id, hwm))
