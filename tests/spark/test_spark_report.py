"""The bank report's logic (demo/report.py) on an in-memory log shaped like the ``waltz`` source's."""

from __future__ import annotations

import json
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from demo.report import balances, operations, operations_by_id_range, rejected_withdrawals, write_chart
from demo.report_stream import RETAIN_SUPERSEDED_S, publish_table, read_published

pytestmark = [pytest.mark.spark, pytest.mark.timeout(240)]


def test_report_balances_match_a_replay_of_the_log(spark: Any) -> None:
    rng = random.Random(7)
    rows, expected, rejected = [], {}, {}
    active: dict[int, bool] = {}
    for txn in range(300):
        account = rng.randrange(8)
        op = rng.choice(["deposit", "deposit", "withdraw", "withdraw", "deactivate"])
        amount = rng.randrange(1, 50) if op != "deactivate" else 0
        # The bank's apply step (demo/bank/model.py), replayed in log order.
        if op == "withdraw" and (
            account not in expected or not active[account] or expected[account] < amount
        ):
            rejected[account] = rejected.get(account, 0) + 1
        if op == "deposit":
            expected[account] = expected.get(account, 0) + amount
            active.setdefault(account, True)
        elif op == "withdraw":
            expected[account] = expected.get(account, 0) - amount
            active.setdefault(account, True)
        else:
            expected.setdefault(account, 0)
            active[account] = False
        data = {"op": op, "account": account} | ({"amount": amount} if op != "deactivate" else {})
        rows.append((0, txn, 0, bytearray(16), bytearray(json.dumps(data).encode())))
    log = spark.createDataFrame(
        rows, "partition INT, transactionId BIGINT, header INT, reqId BINARY, data BINARY"
    )
    ops = operations(log)
    got = {r.account: r.balance for r in balances(ops).collect()}
    assert got == expected
    flagged = {r.account: r.rejected_withdrawals for r in rejected_withdrawals(ops).collect()}
    assert flagged == rejected


def test_report_chart_shows_balances_and_operations_per_partition(spark: Any, tmp_path: Path) -> None:
    rows = [
        (
            p,
            txn,
            0,
            bytearray(16),
            bytearray(json.dumps({"op": "deposit", "account": p * 10 + txn % 3, "amount": 5}).encode()),
        )
        for p in range(2)
        for txn in range(40 if p == 0 else 20)
    ]
    ops = operations(
        spark.createDataFrame(
            rows, "partition INT, transactionId BIGINT, header INT, reqId BINARY, data BINARY"
        )
    )
    labels, series = operations_by_id_range(ops, ranges=4)
    assert labels == ["0-9", "10-19", "20-29", "30-39"]
    assert series == {"partition 0": [10, 10, 10, 10], "partition 1": [10, 10, 0, 0]}
    result = {r.account: r.balance for r in balances(ops).collect()}
    page = write_chart(ops, result, 0, tmp_path / "report" / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>")
    assert page.count("<svg") == 2
    assert "Balance distribution" in page
    assert "partition 1, 20-23: 0" in page  # every point carries its value (10 ranges of 4 ids)
    assert "60 operations in the log" in page


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
