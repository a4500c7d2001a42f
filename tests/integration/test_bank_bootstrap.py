"""The demo bank bootstrapped from a snapshot on a real cluster (issue 26): an instance's SQLite database is
snapshotted at its high-water marks, the log is trimmed below them, and a new instance loads the snapshot,
mounts at those marks and catches up from the log to the balances of an instance that never stopped; an
instance with an empty database fails with TrimmedError at once; snapshots taken while transactions are
applied are each exactly the log's state at the marks they record. Through the library and the CLI."""

from __future__ import annotations

import asyncio
import builtins
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from demo.bank.__main__ import main
from demo.bank.app import BankInstance, make_engine
from demo.bank.bootstrap import bootstrap_drill
from demo.bank.model import COMMITTED, BankDb
from demo.bank.snapshot import (
    Snapshot,
    read_snapshot,
    restore_snapshot,
    take_snapshot,
    trim_below,
    trimming_client,
    write_snapshot,
)
from kazoo.client import KazooClient

from tests.integration.client_cluster import ClientTestCluster
from tests.integration.server_process import TEST_ZK_SESSION_TIMEOUT_MS
from waltz import ClientConfig
from waltz.client.reader import LogReader
from waltz.cluster.retention import update_retention
from waltz.errors import TrimmedError

pytestmark = pytest.mark.integration


def with_cluster(
    tmp_path: Path, zk: KazooClient, zk_connect: str, body: Callable[[ClientTestCluster], None]
) -> None:
    """Run ``body`` (blocking code: the bank's clients are WaltzClient) against a 2-partition cluster."""

    async def run() -> None:
        async with ClientTestCluster(tmp_path, zk, zk_connect, num_partitions=2) as cluster:
            # No grace: trims take effect at once (tests/integration/test_retention.py covers the grace).
            update_retention(zk, cluster.root, grace_ms=0)
            await asyncio.to_thread(body, cluster)

    asyncio.run(run())


def bank(directory: Path, name: str, config: ClientConfig) -> BankInstance:
    engine, suffix = make_engine(None, directory, name)
    return BankInstance(name, engine, config, suffix=suffix)


def restore(directory: Path, name: str, snapshot: Snapshot) -> None:
    engine, suffix = make_engine(None, directory, name)
    restore_snapshot(snapshot, BankDb(engine, suffix))
    engine.dispose()


def wait_for_log(cluster: ClientTestCluster, line: str, timeout_s: float = 30) -> None:
    """Until the server logged ``line`` (it learned a trim point from ZooKeeper and passed it on)."""
    deadline = time.monotonic() + timeout_s
    while line not in cluster.servers[0].log_text():
        if time.monotonic() > deadline:
            raise AssertionError(f"the server did not log {line!r} within {timeout_s} s")
        time.sleep(0.05)


@pytest.mark.timeout(180)
def test_an_instance_bootstrapped_from_a_snapshot_catches_up_to_a_never_stopped_one(
    tmp_path: Path, zk: KazooClient, zk_connect_string: str
) -> None:
    def body(cluster: ClientTestCluster) -> None:
        config, data, path = cluster.client_config(), tmp_path / "bank", tmp_path / "snapshot.json"
        with bank(data, "steady", config) as steady:
            with bank(data, "source", config) as source:
                for i in range(40):
                    steady.deposit(i % 8, 10 + i)
                steady.client.flush_transactions(30)
                assert source.wait_caught_up(30)
                for account in range(4):
                    assert source.wait_applied(source.withdraw(account, 5)) == COMMITTED
                assert source.wait_caught_up(30)
                snapshot = take_snapshot(source.db)
            write_snapshot(snapshot, path)
            # 20 deposits and 2 withdrawals per partition (accounts 0..7, partition = account % 2).
            assert snapshot.high_water_marks == {0: 21, 1: 21}
            with trimming_client(config) as client:
                outcomes = [
                    trim_below(client, snapshot, p, margin=5, min_kept_transactions=0) for p in (0, 1)
                ]
            assert [(o.before, o.after) for o in outcomes] == [(0, 17), (0, 17)]
            for p in (0, 1):
                wait_for_log(cluster, f"partition {p}: trim point 17 sent to replicas")

            # The never-stopped instance goes on past the snapshot.
            for i in range(20):
                steady.deposit(i % 8, 1000 + i)
            assert steady.wait_applied(steady.withdraw(5, 7)) == COMMITTED
            steady.client.flush_transactions(30)
            assert steady.wait_caught_up(30)

            # An empty database cannot replay what was trimmed: a clear error at once, not a wait.
            with bank(data, "empty", config) as empty:
                started = time.monotonic()
                with pytest.raises(TrimmedError, match="transaction 0 is below the trim point 17") as caught:
                    empty.wait_caught_up(60)
                assert time.monotonic() - started < 30
                assert "bootstrap from a snapshot" in str(caught.value)
                assert caught.value.trim_point == 17
                assert empty.db.balances() == {}

            restore(data, "restored", read_snapshot(path))
            with bank(data, "restored", config) as restored:
                assert restored.wait_caught_up(30)
                assert restored.db.balances() == steady.db.balances()
                assert restored.db.high_water_marks() == steady.db.high_water_marks() == {0: 31, 1: 32}
                assert restored.db.anomaly_list() == []
                assert restored.callbacks.errors == []

    with_cluster(tmp_path, zk, zk_connect_string, body)


@pytest.mark.timeout(180)
def test_the_command_line_snapshots_trims_and_bootstraps(
    tmp_path: Path,
    zk: KazooClient,
    zk_connect_string: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_input(_prompt: str = "") -> str:
        raise EOFError  # The REPL ends at once (after catching up).

    monkeypatch.setattr(builtins, "input", no_input)

    def body(cluster: ClientTestCluster) -> None:
        yaml = tmp_path / "client.yaml"
        yaml.write_text(
            f"zookeeper:\n  connectString: {cluster.zk_connect}\n"
            f"  sessionTimeout: {TEST_ZK_SESSION_TIMEOUT_MS}\ncluster.root: {cluster.root}\n"
        )
        data, path = tmp_path / "bank", tmp_path / "a.json"
        with bank(data, "a", cluster.client_config()) as a:
            for i in range(12):
                a.deposit(i % 4, 5 + i)
            a.client.flush_transactions(30)
            assert a.wait_caught_up(30)
            expected = a.db.balances()
        common = ["-c", str(yaml), "--dir", str(data)]
        trim = ["snapshot", "--out", str(path), "--trim", "--margin", "2", "--min-kept", "0"]
        assert main([*common, "--name", "a", *trim]) == 0
        out = capsys.readouterr().out
        assert "snapshot of instance a: 4 accounts at high-water marks {0: 5, 1: 5}" in out
        assert "partition 0: trim point raised from 0 to 4" in out
        assert "partition 1: trim point raised from 0 to 4" in out
        assert json.loads(path.read_text())["high_water_marks"] == {"0": 5, "1": 5}
        for p in (0, 1):
            wait_for_log(cluster, f"partition {p}: trim point 4 sent to replicas")

        # A trim into the grace is refused, named, and the exit status says so.
        refused = ["snapshot", "--out", str(tmp_path / "b.json"), "--trim", "--margin", "0"]
        assert main([*common, "--name", "a", *refused]) == 1
        assert "demo.bank: not trimmed: partition 0: trim point 6 would keep fewer than the 1000" in (
            capsys.readouterr().err
        )

        assert main([*common, "--name", "fresh"]) == 1
        err = capsys.readouterr().err
        assert "instance fresh cannot catch up: partition " in err
        assert "is below the trim point 4" in err
        assert "with --from-snapshot FILE" in err

        auto = ["auto", "--seconds", "1", "--instances", "1", "--no-display"]
        assert main([*common, *auto]) == 1
        err = capsys.readouterr().err
        assert "demo.bank: auto starts every instance with an empty database: partition " in err
        assert "is below the trim point 4" in err

        # The same instance (its marks left at -1) started again from the snapshot.
        assert main([*common, "--name", "fresh", "--from-snapshot", str(path)]) == 0
        assert f"instance fresh starts from {path}: 4 accounts" in capsys.readouterr().out
        engine, _ = make_engine(None, data, "fresh")
        assert BankDb(engine).balances() == expected
        engine.dispose()

    with_cluster(tmp_path, zk, zk_connect_string, body)


@pytest.mark.timeout(180)
def test_snapshots_taken_while_transactions_are_applied_reflect_exactly_their_marks(
    tmp_path: Path, zk: KazooClient, zk_connect_string: str
) -> None:
    def body(cluster: ClientTestCluster) -> None:
        config, data = cluster.client_config(), tmp_path / "bank"
        stop = threading.Event()
        with bank(data, "writer", config) as writer, bank(data, "busy", config) as busy:

            def write() -> None:
                i = 0
                while not stop.is_set():
                    writer.deposit(i % 10, 1 + i % 97)  # Back pressure paces it.
                    i += 1

            thread = threading.Thread(target=write, name="deposits")
            thread.start()
            snapshots: list[Snapshot] = []
            distinct: set[tuple[tuple[int, int], ...]] = set()
            deadline = time.monotonic() + 60
            try:
                while len(distinct) < 20 and time.monotonic() < deadline:
                    snapshot = take_snapshot(busy.db)
                    snapshots.append(snapshot)
                    distinct.add(tuple(sorted(snapshot.high_water_marks.items())))
            finally:
                stop.set()
                thread.join(30)
            assert len(distinct) >= 20, f"only {len(distinct)} distinct snapshots in 60 s"
            writer.client.flush_transactions(30)
            assert busy.wait_caught_up(30)
            final = busy.db.high_water_marks()
        deposits = asyncio.run(read_deposits(config, final))
        for snapshot in snapshots:
            expected: dict[int, int] = {}
            for p, hwm in snapshot.high_water_marks.items():
                for account, amount in deposits[p][: hwm + 1]:
                    expected[account] = expected.get(account, 0) + amount
            assert {i: b for i, b, _active in snapshot.accounts} == expected, snapshot.high_water_marks
        assert sum(final.values()) > max(sum(s.high_water_marks.values()) for s in snapshots)

    with_cluster(tmp_path, zk, zk_connect_string, body)


async def read_deposits(config: ClientConfig, marks: dict[int, int]) -> dict[int, list[tuple[int, int]]]:
    """Partition -> its deposits (account, amount) in log order, from the log itself."""
    found: dict[int, list[tuple[int, int]]] = {}
    async with LogReader(config) as reader:
        for p, hwm in marks.items():
            found[p] = []
            async for record in reader.read(p, start=0, end=hwm, batch_size=500):
                op = json.loads(record.data)
                assert op["op"] == "deposit"
                found[p].append((int(op["account"]), int(op["amount"])))
    return found


@pytest.mark.timeout(180)
def test_the_demo_bootstrap_drill(tmp_path: Path, zk: KazooClient, zk_connect_string: str) -> None:
    """What ``make demo`` runs after the bank's run (demo/bank/bootstrap.py), on instances 0 and 1."""

    def body(cluster: ClientTestCluster) -> None:
        config, data = cluster.client_config(), tmp_path / "bank"
        with bank(data, "0", config) as zero, bank(data, "1", config) as one:
            for i in range(60):
                (zero if i % 2 else one).deposit(i % 12, 3 + i)
            zero.client.flush_transactions(30)
            one.client.flush_transactions(30)
            assert zero.wait_caught_up(30)
            assert one.wait_caught_up(30)
        lines: list[str] = []
        assert bootstrap_drill(config, data, data / "snapshot.json", say=lines.append), lines
        assert lines[0].startswith("snapshot of instance 0: 12 accounts at high-water marks {0: 29, 1: 29}")
        assert lines[1].startswith("the drill's cluster trims at once (retention.graceMs 0;")
        assert lines[2:4] == [
            "partition 0: trim point raised from 0 to 20",
            "partition 1: trim point raised from 0 to 20",
        ]
        assert lines[4] == "instance 1 (never emptied) made 20 more deposits"
        assert lines[5].startswith(
            "an instance with an empty database fails at once: TrimmedError: partition"
        )
        assert "balances and high-water marks equal instance 1's for all 20 accounts" in lines[6]

    with_cluster(tmp_path, zk, zk_connect_string, body)
