"""The bank report's logic (demo/report.py) on an in-memory log shaped like the ``waltz`` source's."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from demo.report import balances, operations, rejected_withdrawals

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
