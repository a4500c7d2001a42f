"""One instance of the bank service: its own Waltz client and its own database (a view of the log).

Databases: by default one SQLite file per instance (``<dir>/bank-<name>.db``); with a database URL (for
example ``postgresql://...``) every instance keeps its tables in that one database under its own suffix.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import sqlalchemy as sa

from demo.bank.model import (
    COMMITTED,
    DEACTIVATE,
    DECLINED,
    DEPOSIT,
    FAILED,
    WITHDRAW,
    BankCallbacks,
    BankContext,
    BankDb,
    check_amount,
    make_context,
)
from waltz import ClientConfig, WaltzClient
from waltz.client.driver import ClientDriver
from waltz.errors import ClientTimeoutError


def make_engine(db_url: str | None, directory: Path, name: str) -> tuple[sa.Engine, str]:
    """(engine, table suffix) for instance ``name``: its own SQLite file, or a suffix in a shared database."""
    if db_url:
        return sa.create_engine(db_url, pool_pre_ping=True), f"_{name}"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"bank-{name}.db"
    # A generous busy timeout: several callback threads of one instance write the same file.
    engine = sa.create_engine(f"sqlite:///{path}", connect_args={"timeout": 30})

    @sa.event.listens_for(engine, "connect")
    def _pragmas(dbapi_connection: Any, _record: Any) -> None:
        # WAL with synchronous=NORMAL: one commit per applied transaction stays cheap, and readers (withdraw's
        # balance check) never wait for the writer. Losing the last commits in a power cut is harmless here:
        # the high-water mark goes back with them and the client delivers those transactions again.
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    return engine, ""


@dataclass
class InstanceStats:
    """Counters of one instance's operations; updated from client callback threads under ``lock``."""

    submitted: int = 0
    committed: int = 0
    declined: int = 0
    failed: int = 0
    lock_failures: int = 0
    deposited: int = 0
    withdrawn: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def in_flight(self) -> int:
        return self.submitted - self.committed - self.declined - self.failed


class BankInstance:
    """A bank service instance. Thread-safe: operations may be submitted from several threads."""

    def __init__(
        self,
        name: str,
        engine: sa.Engine,
        config: ClientConfig,
        *,
        suffix: str = "",
        driver: ClientDriver | None = None,
    ) -> None:
        self.name = name
        self.db = BankDb(engine, suffix)
        self.callbacks = BankCallbacks(self.db)
        self.stats = InstanceStats()
        self.client = WaltzClient(self.callbacks, config, driver=driver)

    # -- operations --------------------------------------------------------------------------------------

    def _done(self, context: BankContext, outcome: str) -> None:
        s = self.stats
        with s.lock:
            s.lock_failures += context.result.lock_failures
            if outcome == COMMITTED:
                s.committed += 1
                s.by_kind[context.kind] = s.by_kind.get(context.kind, 0) + 1
                if context.kind == DEPOSIT:
                    s.deposited += context.amount
                elif context.kind == WITHDRAW:
                    s.withdrawn += context.amount
            elif outcome == DECLINED:
                s.declined += 1
            elif outcome == FAILED:
                s.failed += 1
                if len(s.errors) < 20:
                    s.errors.append(f"{context.kind} {context.account_id}: {context.result.error!r}")

    def submit(self, kind: str, account_id: int, amount: int = 0) -> BankContext:
        """Submit one operation; returns its context (``wait()`` for the outcome).

        Raises ValueError for an amount that is not positive (a negative deposit or withdrawal would move
        money the other way, creating it from nothing), and what ``WaltzClient.submit`` raises if the first
        attempt fails (the outcome is then FAILED).
        """
        check_amount(kind, amount)
        context = make_context(kind, self.db, account_id, amount, done=self._done)
        with self.stats.lock:
            self.stats.submitted += 1
        self.client.submit(context)
        return context

    def deposit(self, account_id: int, amount: int) -> BankContext:
        return self.submit(DEPOSIT, account_id, amount)

    def withdraw(self, account_id: int, amount: int) -> BankContext:
        return self.submit(WITHDRAW, account_id, amount)

    def deactivate(self, account_id: int) -> BankContext:
        return self.submit(DEACTIVATE, account_id)

    def balance(self, account_id: int) -> tuple[int, bool] | None:
        """(balance, active) in this instance's view, or None for an unknown account."""
        return self.db.account(account_id)

    def wait_caught_up(self, timeout_s: float = 30.0) -> bool:
        """Wait until this instance applied every transaction committed when the call started, on every
        partition it follows (so what it answers is not older than the log). False after ``timeout_s``.

        Raises :class:`~waltz.errors.TrimmedError` at once if a partition cannot catch up because the log
        was trimmed above this instance's high-water mark (an empty database against a trimmed log): such
        an instance starts from a snapshot instead (:mod:`demo.bank.snapshot`)."""
        deadline = time.monotonic() + timeout_s
        targets = {p: self.client.high_water_mark(p) for p in sorted(self.client.partitions)}
        for partition_id, hwm in targets.items():
            try:
                # The client's wait raises the error that stopped a partition (TrimmedError for a mount
                # below the trim point), where polling the database would only run into the timeout.
                self.client.wait_applied(partition_id, hwm, timeout=max(deadline - time.monotonic(), 0.0))
            except ClientTimeoutError:
                return False
        while True:
            applied = self.db.high_water_marks()
            if all(applied.get(p, -1) >= hwm for p, hwm in targets.items()):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)

    def wait_applied(self, context: BankContext, timeout_s: float = 30.0) -> str | None:
        """Wait for the outcome and, if committed, until this instance applied it (read-your-writes)."""
        outcome = context.wait(timeout_s)
        if outcome == COMMITTED:
            self.client.flush_transactions(timeout=timeout_s)
        return outcome

    # -- lifecycle ---------------------------------------------------------------------------------------

    def close(self) -> None:
        self.client.close()
        self.db.engine.dispose()

    def __enter__(self) -> BankInstance:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
