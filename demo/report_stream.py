"""A per-account summary table kept current from the bank's Waltz log while the demo runs (Spark streaming).

The query reads the log with ``spark.readStream.format("waltz")`` from the earliest transaction, keeps a
stateful aggregation per account (balance, operations, deactivated) in its checkpoint, and after every
micro-batch overwrites ``<out>/summary`` (Parquet) with the complete table, so readers always see a whole,
current table. Restarted on the same checkpoint it resumes where it stopped: every transaction is counted
exactly once (see docs/spark.md, "Streaming").

Usage: ``.venv/bin/python -m demo.report_stream --client-config D/client.yaml --out report/ [--once]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from demo.report import balances, operations, source_options, spark_session


def start_summary(spark: Any, options: dict[str, str], out_dir: Path, once: bool = False) -> Any:
    """Start the streaming summary query; returns the StreamingQuery."""
    stream = (
        spark.readStream.format("waltz")
        .options(**options)
        .option("startingOffsets", "earliest")
        .option("maxOffsetsPerTrigger", "50000")
        .load()
    )

    def publish(batch: Any, batch_id: int) -> None:
        batch.write.mode("overwrite").parquet(str(out_dir / "summary"))

    writer = (
        balances(operations(stream))
        .writeStream.outputMode("complete")
        .foreachBatch(publish)
        .option("checkpointLocation", str(out_dir / "summary-checkpoint"))
    )
    writer = writer.trigger(availableNow=True) if once else writer.trigger(processingTime="2 seconds")
    return writer.start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Keep a per-account summary current (Spark streaming)")
    parser.add_argument("--client-config", required=True)
    parser.add_argument("--out", default="report")
    parser.add_argument("--once", action="store_true", help="catch up with the log, then stop")
    args = parser.parse_args(argv)
    spark = spark_session("waltz-bank-summary")
    query = start_summary(spark, source_options(args.client_config), Path(args.out), once=args.once)
    try:
        query.awaitTermination()
    except KeyboardInterrupt:
        query.stop()
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
