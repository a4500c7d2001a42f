"""The bank report on Spark: the bank demo's state rebuilt from its Waltz log alone.

First it reads the lineage (:func:`read_lineage`): the cluster's name and key (the log's identity) and the
committed high-water mark of every partition, with the time it read them. The Spark read of the ``waltz``
data source then ends at those marks (``endingOffsets``), so the report covers exactly transactions
``0..hwm`` of each partition, whatever is appended while it runs. From that log it computes

* the balance per account (deposits minus withdrawals; deactivations do not move money), which must equal
  the balances the bank instances' databases hold (they are materialised views of the same log);
* per partition, operations by type and the money deposited, withdrawn and held;
* over the log, per partition: the money held after each range of transactions and the money deposited and
  withdrawn in it (there is no commit time in the log: positions are transaction ids);
* a check: withdrawals in the log that the bank's apply step would record as anomalies (from an unknown or
  deactivated account, or larger than the balance at that point of the log). A correct cluster has none
  (withdrawals the bank declined never reach the log), so the page shows how many withdrawals were checked
  and turns red only when one fails.

Each transaction's data is the bank's JSON ``{"op": "deposit"|"withdraw"|"deactivate", "account": id,
"amount": n}`` (demo/bank/model.py); other records are left out and counted. Under ``out_dir`` it writes
the Parquet tables ``balances``, ``operations`` (per partition and type) and ``rejected`` (the check's
failures), ``lineage.json`` (``cluster``, ``clusterKey``, ``readAt``, ``highWaterMarks``) and
``report.html``: the lineage and a per-partition table, then charts (demo/chart.py) of operations by type,
money over the log and the balance distribution.

``run_report(client_yaml_or_options, out_dir) -> {account: balance}`` is what ``make demo`` calls.
Usage: ``.venv/bin/python -m demo.report --client-config D/client.yaml --out report/``
"""

from __future__ import annotations

import argparse
import asyncio
import html
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from demo.bank.model import DEACTIVATE, DEPOSIT, WITHDRAW
from waltz.client.reader import LogReader
from waltz.config import flatten, read_yaml
from waltz.spark.options import parse_options
from waltz.spark.writer import MARKER_HEADER

OP_SCHEMA = "op STRING, account BIGINT, amount BIGINT"


def spark_session(app: str = "waltz-bank-report") -> Any:
    """A small local session on loopback with the ``waltz`` format registered."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    import waltz.spark

    spark = (
        SparkSession.builder.master("local[2]")
        .appName(app)
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.host", "127.0.0.1")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    waltz.spark.register(spark)
    return spark


def source_options(client_yaml_or_options: str | Path | Mapping[str, str]) -> dict[str, str]:
    """Data source options from a client YAML file (keys prefixed ``waltz.``) or given directly."""
    if isinstance(client_yaml_or_options, Mapping):
        return {str(k): str(v) for k, v in client_yaml_or_options.items()}
    flat = flatten(read_yaml(client_yaml_or_options))
    return {f"waltz.{k}": str(v) for k, v in flat.items()}


def operations(log: Any) -> Any:
    """The bank operations of a ``waltz`` DataFrame: partition, transactionId, op, account, amount."""
    from pyspark.sql import functions as sf

    parsed = log.where(sf.col("header") != MARKER_HEADER).select(
        "partition", "transactionId", sf.from_json(sf.col("data").cast("string"), OP_SCHEMA).alias("o")
    )
    # Records that are not bank operations (not JSON, or no "op") are left out; the page counts them.
    return parsed.where(sf.col("o.op").isNotNull()).select(
        "partition",
        "transactionId",
        "o.op",
        "o.account",
        sf.coalesce(sf.col("o.amount"), sf.lit(0)).alias("amount"),
    )


def balances(ops: Any) -> Any:
    from pyspark.sql import functions as sf

    signed = (
        sf.when(sf.col("op") == "deposit", sf.col("amount"))
        .when(sf.col("op") == "withdraw", -sf.col("amount"))
        .otherwise(0)
    )
    return ops.groupBy("account").agg(
        sf.sum(signed).alias("balance"),
        sf.max(sf.when(sf.col("op") == "deactivate", 1).otherwise(0)).alias("deactivated"),
        sf.count("*").alias("operations"),
    )


def rejected_withdrawals(ops: Any) -> Any:
    """Withdrawals the bank's apply step flags: every account lives in one partition, so the log order of an
    account is its transaction-id order."""
    from pyspark.sql import Window
    from pyspark.sql import functions as sf

    before = Window.partitionBy("account").orderBy("transactionId").rowsBetween(Window.unboundedPreceding, -1)
    signed = (
        sf.when(sf.col("op") == "deposit", sf.col("amount"))
        .when(sf.col("op") == "withdraw", -sf.col("amount"))
        .otherwise(0)
    )
    history = ops.select(
        "*",
        sf.coalesce(sf.sum(signed).over(before), sf.lit(0)).alias("balance_before"),
        sf.coalesce(sf.max((sf.col("op") == "deactivate").cast("int")).over(before), sf.lit(0)).alias(
            "inactive"
        ),
        sf.count("*").over(before).alias("known"),  # any earlier operation created the account row
    )
    flagged = history.where(
        (sf.col("op") == "withdraw")
        & ((sf.col("known") == 0) | (sf.col("inactive") == 1) | (sf.col("balance_before") < sf.col("amount")))
    )
    return flagged.groupBy("account").agg(sf.count("*").alias("rejected_withdrawals"))


LOG_BUCKETS = 24
"""Transaction-id ranges of the charts over the log (one width for every partition)."""


@dataclass(frozen=True)
class Lineage:
    """What a report read: the cluster (its name and key, the log's identity) and, per partition, the
    high-water mark read at ``read_at`` (UTC). The Spark read ends there, so the report covers exactly
    transactions ``0..hwm`` of each partition, whatever was appended while it ran."""

    cluster: str
    cluster_key: str
    read_at: datetime
    high_water_marks: Mapping[int, int]

    def ending_offsets(self) -> str:
        """The data source's ``endingOffsets`` (exclusive) that stop the read at these marks."""
        return json.dumps({str(p): hwm + 1 for p, hwm in sorted(self.high_water_marks.items())})

    def to_json(self) -> dict[str, Any]:
        return {
            "cluster": self.cluster,
            "clusterKey": self.cluster_key,
            "readAt": self.read_at.isoformat(timespec="seconds"),
            "highWaterMarks": {str(p): hwm for p, hwm in sorted(self.high_water_marks.items())},
        }


def read_lineage(options: Mapping[str, str]) -> Lineage:
    """Read the cluster key and the committed high-water mark of every partition the read covers."""
    parsed = parse_options(options)

    async def read() -> Lineage:
        async with LogReader(parsed.client_config) as reader:
            key = await reader.cluster_key()
            partitions = parsed.partitions or range(reader.num_partitions)
            hwms = {p: await reader.high_water_mark(p) for p in partitions}
            # Every transaction up to these marks was committed by now.
            return Lineage(reader.cluster_name, str(key), datetime.now(UTC), hwms)

    return asyncio.run(read())


def operations_by_partition(ops: Any) -> dict[int, dict[str, tuple[int, int]]]:
    """``{partition: {op: (count, amount)}}`` for every partition with operations."""
    from pyspark.sql import functions as sf

    rows = ops.groupBy("partition", "op").agg(sf.count("*").alias("n"), sf.sum("amount").alias("a")).collect()
    result: dict[int, dict[str, tuple[int, int]]] = {}
    for row in rows:
        result.setdefault(int(row.partition), {})[str(row.op)] = (int(row.n), int(row.a or 0))
    return result


@dataclass(frozen=True)
class LogBucket:
    """Transactions ``first_id..last_id`` of one partition: the money deposited and withdrawn in them,
    how many bank operations they hold, and the money held by the partition's accounts after them."""

    first_id: int
    last_id: int
    deposited: int
    withdrawn: int
    operations: int
    money_after: int


def amounts_over_log(
    ops: Any, high_water_marks: Mapping[int, int], buckets: int = LOG_BUCKETS
) -> tuple[int, dict[int, list[LogBucket]]]:
    """``(width, {partition: ranges})``: each partition's log ``0..hwm`` cut into ranges of one round
    ``width`` (at most ``buckets`` ranges for the longest partition), so positions line up across
    partitions. A partial tail joins the last full range (which then holds up to ``2 * width - 1``
    transactions): a range of a few transactions would read as a spike or a dip."""
    from pyspark.sql import functions as sf

    from demo.chart import nice_step

    top = max(high_water_marks.values(), default=-1)
    width = max(1, math.ceil(nice_step(top + 1, buckets)))
    amount = sf.col("amount")
    rows = (
        ops.groupBy("partition", sf.floor(sf.col("transactionId") / width).alias("b"))
        .agg(
            sf.sum(sf.when(sf.col("op") == DEPOSIT, amount).otherwise(0)).alias("dep"),
            sf.sum(sf.when(sf.col("op") == WITHDRAW, amount).otherwise(0)).alias("wd"),
            sf.count("*").alias("n"),
        )
        .collect()
    )
    result: dict[int, list[LogBucket]] = {}
    for p, hwm in sorted(high_water_marks.items()):
        count = max(1, (hwm + 1) // width) if hwm >= 0 else 0
        sums = [[0, 0, 0] for _ in range(count)]
        for r in rows:
            if int(r.partition) == p:
                into = sums[min(int(r.b), count - 1)]
                into[0], into[1], into[2] = into[0] + int(r.dep), into[1] + int(r.wd), into[2] + int(r.n)
        money, series = 0, []
        for b, (dep, wd, n) in enumerate(sums):
            money += dep - wd
            last = hwm if b == count - 1 else (b + 1) * width - 1
            series.append(LogBucket(b * width, last, dep, wd, n, money))
        result[p] = series
    return width, result


@dataclass(frozen=True)
class ReportFigures:
    """Everything the page shows, computed from the log."""

    lineage: Lineage
    transactions: int
    """Transactions read (every record, bank operation or not)."""
    by_partition: Mapping[int, Mapping[str, tuple[int, int]]]
    range_width: int
    """Transactions per range of :attr:`over_log` (the last range of a partition may hold more)."""
    over_log: Mapping[int, Sequence[LogBucket]]
    balances: Mapping[int, int]
    deactivated: int
    withdrawals_flagged: int
    """Withdrawals the bank's apply step would record as anomalies (:func:`rejected_withdrawals`)."""


OP_COLORS = {DEPOSIT: "#2ca02c", WITHDRAW: "#d62728", DEACTIVATE: "#7f7f7f"}
OP_NAMES = {DEPOSIT: "deposits", WITHDRAW: "withdrawals", DEACTIVATE: "deactivations"}


def _partition_table(fig: ReportFigures) -> str:
    """Per partition: the high-water mark read (the lineage), operations by type, money moved and held."""
    from demo.chart import table_html

    figures: list[list[int]] = []
    for p in sorted(fig.lineage.high_water_marks):
        ops = fig.by_partition.get(p, {})
        dep, wd = ops.get(DEPOSIT, (0, 0))[1], ops.get(WITHDRAW, (0, 0))[1]
        figures.append([*(ops.get(op, (0, 0))[0] for op in OP_NAMES), dep, wd, dep - wd])
    rows: list[list[object]] = [
        [f"partition {p}", fig.lineage.high_water_marks[p], *f]
        for p, f in zip(sorted(fig.lineage.high_water_marks), figures, strict=True)
    ]
    if figures:
        rows.append(["total", "", *(sum(column) for column in zip(*figures, strict=True))])
    header = ["", "high-water mark read", *OP_NAMES.values(), "deposited", "withdrawn", "money held"]
    return table_html(header, rows)


def _checks_html(fig: ReportFigures) -> str:
    withdrawals = sum(ops.get(WITHDRAW, (0, 0))[0] for ops in fig.by_partition.values())
    if fig.withdrawals_flagged:
        return (
            f'<p class="check bad">&#10007; {fig.withdrawals_flagged:,} of {withdrawals:,} withdrawals '
            "in the log "
            "overdraw their account or hit an unknown or deactivated one (table <code>rejected</code>)</p>"
        )
    return (
        f'<p class="check ok">&#10003; all {withdrawals:,} withdrawals in the log are covered by their '
        "account's "
        "balance at that point of the log (replayed per account in log order)</p>"
    )


def _charts(fig: ReportFigures) -> list[str]:
    from demo.chart import COLORS, balance_histogram, bars_svg, histogram_svg, lines_svg

    part = {p: f"partition {p}" for p in sorted(fig.lineage.high_water_marks)}
    colors = {name: COLORS[i % len(COLORS)] for i, name in enumerate(part.values())}
    op_colors = {OP_NAMES[op]: color for op, color in OP_COLORS.items()}
    groups = {
        part[p]: {OP_NAMES[op]: fig.by_partition.get(p, {}).get(op, (0, 0))[0] for op in OP_COLORS}
        for p in part
    }
    money = {part[p]: [(0, 0)] + [(b.last_id, b.money_after) for b in bs] for p, bs in fig.over_log.items()}
    bars = bars_svg(groups, op_colors, "Bank operations in the log", "operations")
    held = lines_svg(money, colors, "Money held by each partition's accounts", "transaction id", "money held")
    balance_bins = balance_histogram(list(fig.balances.values()))
    return [
        "<h2>Operations by type, per partition</h2>",
        f"<figure>{bars}</figure>",
        "<h2>Money over the log</h2>",
        f"<figure>{held}</figure>",
        *_flow_panels(fig, part),
        "<h2>Balances</h2>",
        f"<figure>{histogram_svg(balance_bins, 'Accounts by balance', 'balance')}</figure>",
    ]


def _flow_panels(fig: ReportFigures, part: Mapping[int, str]) -> list[str]:
    """Deposited and withdrawn per range of transactions, one small chart per partition on one scale. A
    longer last range (see :func:`amounts_over_log`) is scaled to the width, so it shows a rate and not a
    spike."""
    from demo.chart import Frame, lines_svg

    buckets = [b for bs in fig.over_log.values() for b in bs]
    if not buckets:
        return []
    width = fig.range_width

    def rate(amount: int, b: LogBucket) -> int:
        return round(amount * width / (b.last_id + 1 - b.first_id))

    flows = {
        p: {
            "deposited": [(b.first_id, rate(b.deposited, b)) for b in bs],
            "withdrawn": [(b.first_id, rate(b.withdrawn, b)) for b in bs],
        }
        for p, bs in fig.over_log.items()
    }
    colors = {"deposited": OP_COLORS[DEPOSIT], "withdrawn": OP_COLORS[WITHDRAW]}
    x_top = max(b.first_id for b in buckets)
    y_top = max(y for f in flows.values() for points in f.values() for _, y in points)
    small = Frame(width=440, height=220, left=56, top=44)
    panels = [
        lines_svg(f, colors, part[p], "transaction id (start of the range)", "amount", small, (x_top, y_top))
        for p, f in flows.items()
    ]
    return [
        f"<h3>Deposited and withdrawn per {width:,} transactions</h3>",
        '<div class="grid">' + "".join(f"<figure>{svg}</figure>" for svg in panels) + "</div>",
    ]


def report_page(fig: ReportFigures) -> str:
    """The report's HTML page (demo/chart.py): the lineage and totals first, then the charts."""
    from demo.chart import report_html

    lin = fig.lineage
    money = sum(fig.balances.values())
    ops = sum(n for p in fig.by_partition.values() for n, _ in p.values())
    not_bank = fig.transactions - ops
    source = (
        f'<p class="lineage">Read from Waltz cluster <code>{html.escape(lin.cluster)}</code>, cluster key '
        f"<code>{html.escape(lin.cluster_key)}</code>, at {lin.read_at:%Y-%m-%d %H:%M:%S} UTC: "
        "every partition "
        f"from transaction 0 up to the high-water mark read then ({fig.transactions:,} transactions"
        + (f", {not_bank:,} of them not bank operations" if not_bank else "")
        + ").</p>"
    )
    headline = (
        f"<p><b>{len(fig.balances):,}</b> accounts ({fig.deactivated:,} deactivated), money supply "
        f"<b>{money:,}</b> (deposited minus withdrawn), <b>{ops:,}</b> bank operations.</p>"
    )
    return report_html(
        "Waltz bank report", [source, headline, _partition_table(fig), _checks_html(fig), *_charts(fig)]
    )


def write_page(fig: ReportFigures, path: Path) -> Path:
    """Write :func:`report_page` to ``path`` atomically (a reloading browser never sees half); returns it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(report_page(fig))
    tmp.replace(path)
    return path


def read_log(spark: Any, options: Mapping[str, str], lineage: Lineage) -> Any:
    """The ``waltz`` DataFrame of the log up to the lineage's high-water marks."""
    return (
        spark.read.format("waltz").options(**options).option("endingOffsets", lineage.ending_offsets()).load()
    )


def compute_figures(log: Any, lineage: Lineage, out_dir: Path | None = None) -> ReportFigures:
    """Every figure of the report from ``log`` (read up to ``lineage``); with ``out_dir``, also write the
    tables as Parquet there and print them."""
    from pyspark.sql import functions as sf

    ops = operations(log).cache()
    try:
        per_account = balances(ops)
        rejected = rejected_withdrawals(ops)
        if out_dir is not None:
            per_op = ops.groupBy("partition", "op").agg(
                sf.count("*").alias("count"), sf.sum("amount").alias("total")
            )
            for name, df in (("balances", per_account), ("operations", per_op), ("rejected", rejected)):
                df.write.mode("overwrite").parquet(str(out_dir / name))
            print("top accounts:")
            per_account.orderBy(sf.desc("balance"), "account").limit(10).show(truncate=False)
        accounts = per_account.collect()
        width, over_log = amounts_over_log(ops, lineage.high_water_marks)
        return ReportFigures(
            lineage=lineage,
            transactions=log.count(),
            by_partition=operations_by_partition(ops),
            range_width=width,
            over_log=over_log,
            balances={int(r.account): int(r.balance) for r in accounts},
            deactivated=sum(int(r.deactivated) for r in accounts),
            withdrawals_flagged=int(rejected.agg(sf.sum("rejected_withdrawals")).collect()[0][0] or 0),
        )
    finally:
        ops.unpersist()


def run_report(
    client_yaml_or_options: str | Path | Mapping[str, str], out_dir: str | Path, spark: Any = None
) -> dict[int, int]:
    """Compute the report, write it under ``out_dir`` (Parquet tables, ``lineage.json``, ``report.html``),
    print it; return ``{account: balance}``."""
    own = spark is None
    spark = spark_session() if own else spark
    try:
        options = source_options(client_yaml_or_options)
        lineage = read_lineage(options)
        out = Path(out_dir)
        fig = compute_figures(read_log(spark, options, lineage), lineage, out)
        (out / "lineage.json").write_text(json.dumps(lineage.to_json(), indent=2) + "\n")
        print(
            f"read at {lineage.read_at:%Y-%m-%d %H:%M:%S} UTC from cluster {lineage.cluster} "
            f"(key {lineage.cluster_key})"
        )
        for p, hwm in sorted(lineage.high_water_marks.items()):
            counts = ", ".join(f"{n} {op}" for op, (n, _) in sorted(fig.by_partition.get(p, {}).items()))
            print(f"  partition {p}: high-water mark {hwm}: {counts or 'no bank operations'}")
        withdrawals = sum(ops.get(WITHDRAW, (0, 0))[0] for ops in fig.by_partition.values())
        if fig.withdrawals_flagged:
            print(
                f"CHECK FAILED: {fig.withdrawals_flagged} of {withdrawals} withdrawals overdraw "
                "(see the table rejected)"
            )
        else:
            print(f"check: all {withdrawals} withdrawals are covered by their account's balance in log order")
        print(f"report page: {write_page(fig, out / 'report.html').resolve()}")
        return dict(fig.balances)
    finally:
        from waltz.spark.cluster import close_all

        close_all()
        if own:
            spark.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Bank report from the Waltz log (Spark)")
    parser.add_argument("--client-config", required=True, help="the cluster's client.yaml")
    parser.add_argument("--out", default="report", help="output directory (Parquet)")
    args = parser.parse_args(argv)
    balances_by_account = run_report(args.client_config, args.out)
    print(f"{len(balances_by_account)} accounts, total balance {sum(balances_by_account.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
