"""The bank report's logic (demo/report.py) on an in-memory log shaped like the ``waltz`` source's."""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from demo.report import (
    Lineage,
    ReportFigures,
    balances,
    compute_figures,
    operations,
    read_lineage,
    read_log,
    rejected_withdrawals,
    report_page,
    run_report,
)
from demo.report_stream import RETAIN_SUPERSEDED_S, publish_table, read_published

from tests.spark.conftest import NUM_PARTITIONS, WaltzTestCluster
from waltz.client.reader import LogReader
from waltz.spark.writer import MARKER_HEADER

pytestmark = [pytest.mark.spark, pytest.mark.timeout(240)]

LOG_SCHEMA = "partition INT, transactionId BIGINT, header INT, reqId BINARY, data BINARY"


@dataclass
class Replay:
    """What a bank log holds, computed in plain Python in log order (the reference for the report)."""

    ops: dict[int, dict[str, list[int]]] = field(default_factory=dict)  # partition -> op -> amounts
    by_id: dict[int, dict[int, tuple[str, int]]] = field(default_factory=dict)  # partition -> id -> op
    balance: dict[int, int] = field(default_factory=dict)
    active: dict[int, bool] = field(default_factory=dict)
    flagged: dict[int, int] = field(default_factory=dict)

    def add(self, partition: int, txn: int, data: dict[str, Any]) -> None:
        op, account, amount = data["op"], data["account"], data.get("amount", 0)
        # The bank's apply step (demo/bank/model.py): what it records as an anomaly.
        if op == "withdraw" and (
            account not in self.balance or not self.active[account] or self.balance[account] < amount
        ):
            self.flagged[account] = self.flagged.get(account, 0) + 1
        sign = {"deposit": 1, "withdraw": -1, "deactivate": 0}[op]
        self.balance[account] = self.balance.get(account, 0) + sign * amount
        self.active[account] = self.active.get(account, True) and op != "deactivate"
        self.ops.setdefault(partition, {}).setdefault(op, []).append(amount)
        self.by_id.setdefault(partition, {})[txn] = (op, amount)

    def by_partition(self) -> dict[int, dict[str, tuple[int, int]]]:
        return {p: {op: (len(a), sum(a)) for op, a in ops.items()} for p, ops in self.ops.items()}


def bank_ops(rng: random.Random, count: int, accounts: int, careful: bool) -> list[dict[str, Any]]:
    """Random bank operations; ``careful`` ones never overdraw (as the bank's execute step ensures)."""
    balance: dict[int, int] = {}
    out: list[dict[str, Any]] = []
    while len(out) < count:
        account, amount = rng.randrange(accounts), rng.randrange(1, 100)
        op = rng.choice(["deposit", "deposit", "withdraw", "withdraw", "withdraw"])
        if rng.random() < 0.01:
            op = "deactivate"
        if careful and op != "deposit" and balance.get(account, 0) < amount:
            continue  # declined before the append: never reaches the log
        if op == "deactivate":
            balance[account] = -(10**9)  # nothing more to withdraw from it
            out.append({"op": op, "account": account})
            continue
        balance[account] = balance.get(account, 0) + (amount if op == "deposit" else -amount)
        out.append({"op": op, "account": account, "amount": amount})
    return out


def in_memory_log(spark: Any, rows: list[tuple[int, dict[str, Any]]]) -> tuple[Any, Replay, dict[int, int]]:
    """A ``waltz``-shaped DataFrame of ``(partition, op)`` rows in log order, with its replay and marks."""
    replay, next_id = Replay(), [0] * NUM_PARTITIONS
    records = []
    for partition, data in rows:
        txn = next_id[partition]
        next_id[partition] += 1
        replay.add(partition, txn, data)
        records.append((partition, txn, 0, bytearray(16), bytearray(json.dumps(data).encode())))
    return spark.createDataFrame(records, LOG_SCHEMA), replay, {p: n - 1 for p, n in enumerate(next_id)}


def test_report_balances_match_a_replay_of_the_log(spark: Any) -> None:
    ops = bank_ops(random.Random(7), 300, 8, careful=False)
    log, replay, _ = in_memory_log(spark, [(0, o) for o in ops])
    parsed = operations(log)
    assert {r.account: r.balance for r in balances(parsed).collect()} == replay.balance
    flagged = {r.account: r.rejected_withdrawals for r in rejected_withdrawals(parsed).collect()}
    assert flagged == replay.flagged
    assert flagged  # careless operations do overdraw: the check finds them


def check_figures(fig: ReportFigures, replay: Replay, hwms: dict[int, int]) -> None:
    """Every figure of the report against what the log holds (the replay)."""
    assert fig.by_partition == replay.by_partition()
    assert dict(fig.balances) == replay.balance
    assert fig.deactivated == sum(not a for a in replay.active.values())
    assert fig.withdrawals_flagged == sum(replay.flagged.values())
    width = fig.range_width
    assert str(width).rstrip("0") in {"1", "2", "25", "5"}  # a round width
    assert max(len(bs) for bs in fig.over_log.values()) <= 24
    for p, hwm in hwms.items():
        buckets = fig.over_log[p]
        # Contiguous ranges of one width from 0 to the high-water mark; the last takes the partial tail.
        assert [b.first_id for b in buckets] == list(range(0, max(1, hwm + 1 - width + 1), width))
        assert [b.last_id + 1 for b in buckets[:-1]] == [b.first_id for b in buckets[1:]]
        assert min(width, hwm + 1) <= buckets[-1].last_id + 1 - buckets[-1].first_id < 2 * width
        assert buckets[-1].last_id == hwm
        money = 0
        for b in buckets:
            in_range = [replay.by_id[p][t] for t in range(b.first_id, b.last_id + 1) if t in replay.by_id[p]]
            assert b.deposited == sum(a for op, a in in_range if op == "deposit")
            assert b.withdrawn == sum(a for op, a in in_range if op == "withdraw")
            assert b.operations == len(in_range)
            money += b.deposited - b.withdrawn
            assert b.money_after == money
        # What the old chart got wrong: dense ids put the same count in every range; amounts are not flat.
        assert len({b.deposited for b in buckets}) > 1


def assert_partition_rows(page: str, replay: Replay, hwms: dict[int, int]) -> None:
    """The page's table: per partition, the high-water mark read, operations by type, money moved and held."""
    for p, hwm in hwms.items():
        ops = replay.by_partition().get(p, {})
        counts = [ops.get(op, (0, 0))[0] for op in ("deposit", "withdraw", "deactivate")]
        dep, wd = ops.get("deposit", (0, 0))[1], ops.get("withdraw", (0, 0))[1]
        cells = "".join(f'<td class="num">{v:,}</td>' for v in [hwm, *counts, dep, wd, dep - wd])
        assert f"<tr><td>partition {p}</td>{cells}</tr>" in page


def legends_clear_of_data(page: str) -> None:
    """In every chart, every legend item lies above the plot area (in the band under the title)."""
    charts = page.split("<svg")[1:]
    assert charts
    for svg in charts:
        plot_top = float(re.search(r'<rect class="plot" x="[\d.]+" y="([\d.]+)"', svg).group(1))  # type: ignore[union-attr]
        legend_ys = [float(y) for y in re.findall(r'<g class="legend"><rect x="[\d.]+" y="([\d.]+)" ', svg)]
        assert all(y + 10 <= plot_top for y in legend_ys), (legend_ys, plot_top)


def test_report_figures_equal_the_log(spark: Any) -> None:
    rng = random.Random(11)
    # As in the bank, an account's operations all go to one partition: its log order is the account's.
    rows = [(o["account"] % NUM_PARTITIONS, o) for o in bank_ops(rng, 900, 30, careful=True)]
    log, replay, hwms = in_memory_log(spark, rows)
    lineage = Lineage(
        "local", "0b5e2c1a-5f0e-4f7e-9d2b-2b8c1f7a6e11", datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC), hwms
    )
    fig = compute_figures(log, lineage)
    check_figures(fig, replay, hwms)
    assert fig.transactions == len(rows)
    page = report_page(fig)
    assert "cluster key <code>0b5e2c1a-5f0e-4f7e-9d2b-2b8c1f7a6e11</code>, at 2026-01-02 03:04:05 UTC" in page
    assert_partition_rows(page, replay, hwms)
    for p in hwms:
        deposits = len(replay.ops[p]["deposit"])
        assert f"partition {p}, deposits: {deposits}</title>" in page  # the bars
        last = fig.over_log[p][-1]
        assert f"partition {p} at {last.last_id:,}: {last.money_after:,}</title>" in page  # money held
    withdrawals = sum(len(ops.get("withdraw", [])) for ops in replay.ops.values())
    assert f"all {withdrawals:,} withdrawals in the log are covered" in page
    assert f"money supply <b>{sum(replay.balance.values()):,}</b>" in page
    assert "rejected withdrawals in the log: 0" not in page
    legends_clear_of_data(page)


def test_report_page_shows_overdrafts_and_records_that_are_not_bank_operations(spark: Any) -> None:
    rows = [(o["account"] % NUM_PARTITIONS, o) for o in bank_ops(random.Random(5), 40, 4, careful=False)]
    log, replay, hwms = in_memory_log(spark, rows)
    foreign = spark.createDataFrame([(0, hwms[0] + 1, 0, bytearray(16), bytearray(b"not json"))], LOG_SCHEMA)
    hwms[0] += 1
    lineage = Lineage("local", "k", datetime.now(UTC), hwms)
    fig = compute_figures(log.unionByName(foreign), lineage)
    check_figures(fig, replay, hwms)
    page = report_page(fig)
    flagged = sum(replay.flagged.values())
    assert flagged > 0
    withdrawals = sum(len(ops.get("withdraw", [])) for ops in replay.ops.values())
    assert f"{flagged:,} of {withdrawals:,} withdrawals in the log overdraw" in page
    assert f"({len(rows) + 1:,} transactions, 1 of them not bank operations)" in page


def test_report_on_a_cluster_reads_up_to_the_marks_it_records(
    spark: Any, waltz_cluster: WaltzTestCluster, tmp_path: Path
) -> None:
    rng = random.Random(3)
    ops = bank_ops(rng, 150, 12, careful=True)
    waltz_cluster.append([{"partition": 1, "data": b"not a bank operation"}])  # other tests append more
    waltz_cluster.append(
        [{"partition": o["account"] % NUM_PARTITIONS, "data": json.dumps(o).encode()} for o in ops]
    )
    before = datetime.now(UTC).replace(microsecond=0)  # readAt is written in whole seconds
    result = run_report(waltz_cluster.options, tmp_path, spark=spark)
    after = datetime.now(UTC)
    lineage = json.loads((tmp_path / "lineage.json").read_text())
    hwms = waltz_cluster.hwms()
    assert lineage["highWaterMarks"] == {str(p): h for p, h in hwms.items()}

    async def cluster_key() -> str:
        async with LogReader(waltz_cluster.client_config) as reader:
            return str(await reader.cluster_key())

    assert lineage["clusterKey"] == asyncio.run(cluster_key())
    assert before <= datetime.fromisoformat(lineage["readAt"]) <= after
    # Every figure against the whole log as the plain reader returns it (other tests' records are no
    # bank operations: left out, and counted).
    replay, foreign = Replay(), 0
    for p in range(NUM_PARTITIONS):
        for record in waltz_cluster.read_all(p):
            try:
                if record.header == MARKER_HEADER:
                    raise ValueError("an exactly-once sink's marker")
                replay.add(p, record.transaction_id, json.loads(record.data))
            except (ValueError, KeyError, TypeError):
                foreign += 1
    assert result == replay.balance
    page = (tmp_path / "report.html").read_text()
    assert lineage["clusterKey"] in page
    assert_partition_rows(page, replay, hwms)
    total = sum(h + 1 for h in hwms.values())
    assert foreign > 0
    assert f"({total:,} transactions, {foreign:,} of them not bank operations)" in page
    # The read stops at the marks recorded, whatever is appended meanwhile.
    recorded = read_lineage(waltz_cluster.options)
    waltz_cluster.append([{"partition": 0, "data": json.dumps(ops[0]).encode()}])
    assert read_log(spark, waltz_cluster.options, recorded).count() == sum(h + 1 for h in hwms.values())


def test_concurrent_readers_of_the_published_summary_never_fail(spark: Any, tmp_path: Path) -> None:
    table = tmp_path / "summary"

    def version(v: int) -> Any:
        return spark.range(200).selectExpr("id", f"{v} AS version")

    publish_table(version(0), table, "0")
    stop = threading.Event()
    failures: list[BaseException] = []
    reads = [0]

    def reader() -> None:
        while not stop.is_set():
            try:
                rows = read_published(spark, table).collect()
                # A whole version, never a mix or a part of one.
                assert len(rows) == 200
                assert len({r.version for r in rows}) == 1
                reads[0] += 1
            except Exception as e:  # every failure is the test's result, not only the first
                failures.append(e)

    threads = [threading.Thread(target=reader, name=f"reader-{i}") for i in range(2)]
    for t in threads:
        t.start()
    try:
        for v in range(1, 7):
            publish_table(version(v), table, str(v))
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert failures == []
    assert reads[0] > 0
    assert {r.version for r in read_published(spark, table).collect()} == {6}
    # Superseded versions are deleted once they have been superseded for long enough; the newest stay.
    publish_table(version(7), table, "7", now_s=time.time() + RETAIN_SUPERSEDED_S + 60)
    assert len([p for p in table.iterdir() if p.name.startswith("v-")]) == 2
