"""The bootstrap drill ``make demo`` runs after the bank's run: snapshot, trim, and a new instance from the
snapshot (``docs/client.md``, "Trimming the log, and bootstrapping from a snapshot").

1. the database instance ``source`` left at the end of the run is snapshotted (:mod:`demo.bank.snapshot`) and
   the snapshot written to a file;
2. every partition is trimmed to the snapshot's high-water mark + 1 - ``margin``;
3. instance ``reference`` (its own database, never emptied: it stands for an instance that never stopped)
   submits ``more`` deposits, past the snapshot;
4. an instance with an empty database must fail with TrimmedError (it cannot replay what was trimmed);
5. instance ``restored`` loads the snapshot into an empty database, mounts at its marks, catches up from the
   log, and must hold exactly the balances and marks of ``reference``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

from demo.bank.app import BankInstance, make_engine
from demo.bank.model import COMMITTED, BankDb
from demo.bank.snapshot import (
    read_snapshot,
    restore_snapshot,
    take_snapshot,
    trim_below,
    trimming_client,
    write_snapshot,
)
from waltz import ClientConfig
from waltz.cluster import zk
from waltz.cluster.retention import update_retention
from waltz.errors import TrimmedError

CATCH_UP_TIMEOUT_S = 60.0


def _open(config: ClientConfig, directory: Path, name: str, *, fresh: bool) -> BankInstance:
    engine, suffix = make_engine(None, directory, name)
    if fresh:
        BankDb(engine, suffix).drop()
    return BankInstance(name, engine, config, suffix=suffix)


def without_grace(config: ClientConfig) -> None:
    """Set the cluster's grace to 0, so a trim takes effect at once (an operator's setting, as ``waltz
    cluster retention set --grace-ms 0``; see ``docs/operations.md``, "Retention")."""
    client = zk.connect(
        config.zookeeper_connect_string,
        auth=config.zookeeper_auth(),
        session_timeout_ms=config.zookeeper_session_timeout_ms,
    )
    try:
        update_retention(client, config.cluster_root, grace_ms=0)
    finally:
        zk.close(client)


def bootstrap_drill(
    config: ClientConfig,
    directory: Path,
    snapshot_path: Path,
    *,
    source: str = "0",
    reference: str = "1",
    more: int = 20,
    margin: int = 10,
    min_kept_transactions: int = 10,
    say: Callable[[str], None] = print,
) -> bool:
    """Run the drill on the bank instances (SQLite files) in ``directory``; True if the restored instance
    ended equal to ``reference`` and the empty one failed with TrimmedError. Each step says one line."""
    engine, suffix = make_engine(None, directory, source)
    try:
        snapshot = take_snapshot(BankDb(engine, suffix))
    finally:
        engine.dispose()
    write_snapshot(snapshot, snapshot_path)
    say(f"snapshot of instance {source}: {snapshot.describe()}, written to {snapshot_path}")
    without_grace(config)
    say(
        "the drill's cluster trims at once (retention.graceMs 0; a cluster's default grace of one hour "
        "would keep the trim pending, and the data readable, for that hour)"
    )
    trimmed = False
    with trimming_client(config) as client:
        for partition_id in sorted(snapshot.high_water_marks):
            outcome = trim_below(
                client, snapshot, partition_id, margin=margin, min_kept_transactions=min_kept_transactions
            )
            trimmed = trimmed or outcome.after > 0
            say(outcome.message)
    with _open(config, directory, reference, fresh=False) as steady:
        contexts = [steady.deposit(i, 1 + i) for i in range(more)]
        if any(steady.wait_applied(c, CATCH_UP_TIMEOUT_S) != COMMITTED for c in contexts):
            say(f"FAILED: a deposit of instance {reference} did not commit")
            return False
        if not steady.wait_caught_up(CATCH_UP_TIMEOUT_S):
            say(f"FAILED: instance {reference} did not catch up within {CATCH_UP_TIMEOUT_S:g} s")
            return False
        say(f"instance {reference} (never emptied) made {more} more deposits")
        expected, expected_marks = steady.db.balances(), steady.db.high_water_marks()
    if trimmed and not _empty_instance_fails(config, directory, say):
        return False
    engine, suffix = make_engine(None, directory, "restored")
    BankDb(engine, suffix).drop()
    restore_snapshot(read_snapshot(snapshot_path), BankDb(engine, suffix))
    with BankInstance("restored", engine, config, suffix=suffix) as restored:
        if not restored.wait_caught_up(CATCH_UP_TIMEOUT_S):
            say(f"FAILED: the restored instance did not catch up within {CATCH_UP_TIMEOUT_S:g} s")
            return False
        balances, marks = restored.db.balances(), restored.db.high_water_marks()
    if (balances, marks) != (expected, expected_marks):
        differ = sorted(k for k in set(balances) | set(expected) if balances.get(k) != expected.get(k))
        say(f"FAILED: the restored instance differs from instance {reference}: accounts {differ[:20]}")
        return False
    say(
        f"instance restored started from the snapshot and caught up from the log: balances and high-water "
        f"marks equal instance {reference}'s for all {len(expected)} accounts"
    )
    return True


@contextlib.contextmanager
def _quiet_client_logs() -> Iterator[None]:
    """The drill expects the empty instance's partitions to fail: their ERROR lines would only alarm."""
    logger = logging.getLogger("waltz.client")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _empty_instance_fails(config: ClientConfig, directory: Path, say: Callable[[str], None]) -> bool:
    with _quiet_client_logs(), _open(config, directory, "empty", fresh=True) as empty:
        try:
            empty.wait_caught_up(CATCH_UP_TIMEOUT_S)
        except TrimmedError as e:
            say(f"an instance with an empty database fails at once: TrimmedError: {e}")
            return True
    say("FAILED: an instance with an empty database caught up with a trimmed log")
    return False
