"""Snapshots of a bank instance's database, the trim below them, and a new instance bootstrapped from one.

The database is a view of the log up to its high-water marks, and ``SqlClientCallbacks`` moves each mark in
the same database transaction as the changes it stands for. So a copy of the tables read in **one** snapshot
read (one read transaction that sees a single moment of the database, never statements that each see their
own) is the state of the log up to exactly the high-water marks it holds, and records them. That is the whole
consistency argument: no lock on the applier, no pause of the client.

The pattern (``docs/client.md``, "Bootstrapping from a snapshot"):

1. :func:`take_snapshot` reads the accounts, the anomalies and the marks in one snapshot read;
   :func:`write_snapshot` writes them to a file, durably (written, fsynced, renamed into place, directory
   fsynced), *before* anything is trimmed;
2. :func:`trim_below` raises each partition's trim point to ``mark + 1 - margin``: the ``margin`` most recent
   transactions the snapshot already holds stay in the log, for instances whose own database is a little
   behind the snapshot (they mount from their own mark, and a mark below the trim point - 1 cannot mount);
3. a new instance loads the snapshot into an empty database (:func:`restore_snapshot`) *before* its client
   starts: its ``client_high_water_mark`` then returns the snapshot's marks, the client mounts there and the
   log replays only what came after. An empty database against a trimmed log cannot catch up: its mount
   fails with :class:`~waltz.errors.TrimmedError` (``BankInstance.wait_caught_up`` raises it).

File format (UTF-8 JSON, one object)::

    {
      "format": "waltz-bank-snapshot",   constant
      "version": 1,                      this layout
      "taken_at_ms": 1764390000000,      wall clock when the snapshot read began (informational)
      "high_water_marks": {"0": 41, ...} partition id (a string, JSON keys are) -> the last transaction of
                                         that partition the state reflects (-1: none)
      "accounts": [[id, balance, active], ...]                 the accounts table, by id
      "anomalies": [[partition_id, transaction_id, what], ...] the anomalies table, in insertion order
    }
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from demo.bank.model import BankDb
from waltz import ClientConfig, Transaction, WaltzClient
from waltz.client.api import ClientCallbacks
from waltz.cluster.trim_points import TrimOutcome

FORMAT = "waltz-bank-snapshot"
VERSION = 1


class SnapshotError(ValueError):
    """A snapshot that cannot be read or restored (the message names the file or the database)."""


@dataclass(frozen=True)
class Snapshot:
    """The bank's state at ``high_water_marks`` (partition -> last transaction reflected)."""

    high_water_marks: dict[int, int]
    accounts: list[tuple[int, int, bool]]
    anomalies: list[tuple[int, int, str]]
    taken_at_ms: int

    def describe(self) -> str:
        marks = ", ".join(f"{p}: {h}" for p, h in sorted(self.high_water_marks.items()))
        return f"{len(self.accounts)} accounts at high-water marks {{{marks}}}"


# ---------------------------------------------------------------------------------------------- snapshot


@contextlib.contextmanager
def snapshot_read(engine: sa.Engine) -> Iterator[sa.Connection]:
    """A connection whose statements all read one moment of the database, rolled back at the end.

    SQLite: pysqlite opens no transaction for a SELECT, so each statement would read its own moment (a
    transaction applied between two of them would tear the copy); an explicit ``BEGIN`` makes every read
    until the rollback see the database as it was at the first one (in WAL mode, writers go on meanwhile).
    Other databases: ``REPEATABLE READ``, a snapshot from the first statement in PostgreSQL and MySQL.
    """
    with engine.connect() as connection:
        if connection.dialect.name == "sqlite":
            connection.exec_driver_sql("BEGIN")
        else:
            connection = connection.execution_options(isolation_level="REPEATABLE READ")
        try:
            yield connection
        finally:
            connection.rollback()


def take_snapshot(db: BankDb) -> Snapshot:
    """The instance's state and the high-water marks it reflects, read in one snapshot read (consistent
    while the instance goes on applying transactions)."""
    taken_at_ms = int(time.time() * 1000)
    a, t, h = db.accounts, db.anomalies, db.hwm
    with snapshot_read(db.engine) as connection:
        marks = connection.execute(sa.select(h.c.partition_id, h.c.high_water_mark)).all()
        accounts = connection.execute(sa.select(a.c.id, a.c.balance, a.c.active).order_by(a.c.id)).all()
        anomalies = connection.execute(
            sa.select(t.c.partition_id, t.c.transaction_id, t.c.what).order_by(t.c.id)
        ).all()
    return Snapshot(
        high_water_marks={int(r.partition_id): int(r.high_water_mark) for r in marks},
        accounts=[(int(r.id), int(r.balance), bool(r.active)) for r in accounts],
        anomalies=[(int(r.partition_id), int(r.transaction_id), str(r.what)) for r in anomalies],
        taken_at_ms=taken_at_ms,
    )


def write_snapshot(snapshot: Snapshot, path: Path) -> None:
    """Write ``snapshot`` to ``path`` durably: a temporary file beside it, fsynced, renamed over ``path``,
    then the directory fsynced. A crash leaves the old file or the new one, never a part of one."""
    body = {
        "format": FORMAT,
        "version": VERSION,
        "taken_at_ms": snapshot.taken_at_ms,
        "high_water_marks": {str(p): h for p, h in sorted(snapshot.high_water_marks.items())},
        "accounts": [list(row) for row in snapshot.accounts],
        "anomalies": [list(row) for row in snapshot.anomalies],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(body, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_snapshot(path: Path) -> Snapshot:
    """The snapshot in ``path``; :class:`SnapshotError` naming the file for one that is missing, not JSON,
    or not a bank snapshot of this version."""
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SnapshotError(f"snapshot {path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SnapshotError(f"snapshot {path}: cannot be read: {e}") from e
    try:
        return _decode(body)
    except (KeyError, TypeError, ValueError) as e:
        raise SnapshotError(f"snapshot {path}: not a bank snapshot of version {VERSION}: {e!r}") from e


def _decode(body: Any) -> Snapshot:
    if body["format"] != FORMAT or body["version"] != VERSION:
        raise ValueError(f"format {body['format']!r} version {body['version']!r}")
    marks = {int(p): int(h) for p, h in body["high_water_marks"].items()}
    if any(p < 0 or h < -1 for p, h in marks.items()):
        raise ValueError(f"bad high-water marks {marks}")
    return Snapshot(
        high_water_marks=marks,
        accounts=[(int(i), int(b), _bool(active)) for i, b, active in body["accounts"]],
        anomalies=[(int(p), int(t), str(what)) for p, t, what in body["anomalies"]],
        taken_at_ms=int(body["taken_at_ms"]),
    )


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"active must be true or false, got {value!r}")
    return value


# -------------------------------------------------------------------------------------------------- trim


def trim_point_below(snapshot: Snapshot, partition_id: int, margin: int) -> int:
    """The trim point that keeps ``margin`` transactions below the snapshot's mark of ``partition_id``
    (``mark + 1 - margin``, at least 0): everything the log still needs after the snapshot, and more."""
    if margin < 0:
        raise ValueError(f"the margin must be at least 0, got {margin}")
    if partition_id not in snapshot.high_water_marks:
        raise SnapshotError(f"the snapshot holds no high-water mark for partition {partition_id}")
    return max(0, snapshot.high_water_marks[partition_id] + 1 - margin)


def trim_below(
    client: WaltzClient,
    snapshot: Snapshot,
    partition_id: int,
    *,
    margin: int,
    min_kept_transactions: int | None = None,
) -> TrimOutcome:
    """Raise ``partition_id``'s trim point to :func:`trim_point_below` through ``client`` (under the rules of
    ``client.trim``: only up, never into the grace of ``min_kept_transactions``; a refusal raises
    :class:`~waltz.errors.MetadataError`). Call it only once the snapshot is on disk
    (:func:`write_snapshot`)."""
    target = trim_point_below(snapshot, partition_id, margin)
    return client.trim(partition_id, target, min_kept_transactions=min_kept_transactions)


# ------------------------------------------------------------------------------------------------ restore


def restore_snapshot(snapshot: Snapshot, db: BankDb) -> None:
    """Load ``snapshot`` into ``db``, in one database transaction, before the instance's client starts.

    ``db`` must not have applied anything: no account, no anomaly, no high-water mark above -1 (an instance
    that failed with TrimmedError left its marks at -1; they are replaced). A database that did apply
    transactions is refused with :class:`SnapshotError` naming its table, and left as it was.
    """
    a, t, h = db.accounts, db.anomalies, db.hwm
    with db.engine.begin() as connection:
        for table, applied in ((h, h.c.high_water_mark >= 0), (a, sa.true()), (t, sa.true())):
            if connection.execute(sa.select(sa.func.count()).select_from(table).where(applied)).scalar_one():
                raise SnapshotError(
                    f"table {table.name} of {db.engine.url.render_as_string()} is not empty: a snapshot "
                    "is restored into an empty database only (drop this instance's tables first)"
                )
        connection.execute(sa.delete(h))
        marks = [{"partition_id": p, "high_water_mark": m} for p, m in snapshot.high_water_marks.items()]
        if marks:
            connection.execute(sa.insert(h), marks)
        if snapshot.accounts:
            rows = [{"id": i, "balance": b, "active": act} for i, b, act in snapshot.accounts]
            connection.execute(sa.insert(a), rows)
        if snapshot.anomalies:
            found = [{"partition_id": p, "transaction_id": x, "what": w} for p, x, w in snapshot.anomalies]
            connection.execute(sa.insert(t), found)


class _NoFeed(ClientCallbacks):
    """The callbacks of a client that only trims: it mounts nothing, so nothing is ever applied."""

    def client_high_water_mark(self, partition_id: int) -> int:
        raise SnapshotError(f"the trimming client does not mount (asked for partition {partition_id})")

    def apply_transaction(self, transaction: Transaction) -> None:
        raise SnapshotError("the trimming client does not apply transactions")

    def uncaught_exception(self, partition_id: int, transaction_id: int, exception: BaseException) -> None:
        raise SnapshotError(f"partition {partition_id}: {exception!r}") from exception


def trimming_client(config: ClientConfig) -> WaltzClient:
    """A client for :func:`trim_below` alone: connected to the cluster of ``config``, mounting nothing."""
    return WaltzClient(_NoFeed(), config.replace(auto_mount=False))
