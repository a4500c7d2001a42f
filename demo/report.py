"""The bank report on Spark: the bank demo's state rebuilt from its Waltz log alone.

Reads the whole committed log with the ``waltz`` data source and computes

* the balance per account (deposits minus withdrawals; deactivations do not move money), which must equal
  the balances the bank instances' databases hold (they are materialised views of the same log);
* totals and counts per operation type; the top accounts by balance;
* rejected withdrawals: withdrawals in the log that the bank's apply step records as anomalies (from an
  unknown or deactivated account, or larger than the balance at that point of the log). A correct cluster
  has none; withdrawals the bank declined before appending never reach the log.

Each transaction's data is the bank's JSON ``{"op": "deposit"|"withdraw"|"deactivate", "account": id,
"amount": n}`` (demo/bank/model.py). Results are written as Parquet under ``out_dir`` and printed, and
``out_dir/report.html`` shows two charts (demo/chart.py): the distribution of balances, and operations per
partition over transaction-id ranges (how evenly the load spread, and when).

``run_report(client_yaml_or_options, out_dir) -> {account: balance}`` is what ``make demo`` calls.
Usage: ``.venv/bin/python -m demo.report --client-config D/client.yaml --out report/``
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from waltz.config import flatten, read_yaml
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
    return parsed.select(
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


ID_RANGES = 10
"""Transaction-id ranges of the per-partition chart."""


def operations_by_id_range(ops: Any, ranges: int = ID_RANGES) -> tuple[list[str], dict[str, list[int]]]:
    """``(range labels, {"partition p": operations per range})``: ids cut into ``ranges`` equal ranges."""
    from pyspark.sql import functions as sf

    top = ops.agg(sf.max("transactionId")).collect()[0][0]
    if top is None:
        return [], {}
    width = max(1, -(-(int(top) + 1) // ranges))
    counts = ops.groupBy("partition", sf.floor(sf.col("transactionId") / width).alias("r")).count().collect()
    partitions = sorted({int(row.partition) for row in counts})
    series = {f"partition {p}": [0] * ranges for p in partitions}
    for row in counts:
        series[f"partition {row.partition}"][min(int(row.r), ranges - 1)] += int(row["count"])
    labels = [f"{i * width}-{(i + 1) * width - 1}" for i in range(ranges)]
    return labels, series


def write_chart(ops: Any, balances_by_account: Mapping[int, int], rejected: int, path: Path) -> Path:
    """Write the report's HTML page of charts (demo/chart.py) to ``path``; returns it."""
    from demo.chart import balance_histogram, histogram_svg, lines_svg, report_html

    labels, series = operations_by_id_range(ops)
    values = list(balances_by_account.values())
    page = report_html(
        "Waltz bank report",
        [
            f"{len(values)} accounts, total balance {sum(values)}",
            f"{sum(sum(v) for v in series.values())} operations in the log",
            f"rejected withdrawals in the log: {rejected}",
        ],
        [
            histogram_svg(balance_histogram(values), "Balance distribution", "balance"),
            lines_svg(series, labels, "Operations per partition over transaction ids", "transaction ids"),
        ],
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(page)
    tmp.replace(path)  # a browser reloading the page never sees half of it
    return path


def run_report(
    client_yaml_or_options: str | Path | Mapping[str, str], out_dir: str | Path, spark: Any = None
) -> dict[int, int]:
    """Compute the report, write it as Parquet under ``out_dir``, print it; return ``{account: balance}``."""
    from pyspark.sql import functions as sf

    own = spark is None
    spark = spark_session() if own else spark
    try:
        log = spark.read.format("waltz").options(**source_options(client_yaml_or_options)).load()
        ops = operations(log).cache()
        out = Path(out_dir)
        per_account = balances(ops)
        per_op = ops.groupBy("op").agg(sf.count("*").alias("count"), sf.sum("amount").alias("total"))
        rejected = rejected_withdrawals(ops)
        top = per_account.orderBy(sf.desc("balance"), "account").limit(10)
        for name, df in (("balances", per_account), ("operations", per_op), ("rejected", rejected)):
            df.write.mode("overwrite").parquet(str(out / name))
        print(f"transactions read: {ops.count()}")
        print("per operation:")
        per_op.orderBy("op").show(truncate=False)
        print("top accounts:")
        top.show(truncate=False)
        rejected_total = rejected.agg(sf.sum("rejected_withdrawals")).collect()[0][0] or 0
        print(f"rejected withdrawals in the log: {rejected_total}")
        result = {int(r.account): int(r.balance) for r in per_account.collect()}
        chart = write_chart(ops, result, int(rejected_total), out / "report.html")
        print(f"report chart: {chart.resolve()}")
        ops.unpersist()
        return result
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
