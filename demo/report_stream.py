"""A per-account summary table kept current from the bank's Waltz log while the demo runs (Spark streaming).

The query reads the log with ``spark.readStream.format("waltz")`` from the earliest transaction, keeps a
stateful aggregation per account (balance, operations, deactivated) in its checkpoint, and after every
micro-batch publishes the complete table under ``<out>/summary``. Restarted on the same checkpoint it
resumes where it stopped: every transaction is counted exactly once (see docs/spark.md, "Streaming").

Publishing is atomic, so readers that run while the table changes never fail and never see half a table.
Overwriting one Parquet directory in place does not give that (Spark deletes the old files, then writes the
new ones: a reader that listed the old files fails to open them, one that lists in between sees nothing),
and a directory cannot be renamed over a non-empty one. So every publication is a new, immutable version
directory ``summary/v-<batch>-<random>/``, written whole first; then the text file ``summary/CURRENT``,
which names the current version, is replaced with ``os.replace`` (an atomic rename). Readers read
``CURRENT``, then that version (:func:`read_published`). Superseded versions are deleted only after
:data:`RETAIN_SUPERSEDED_S`, so a reader that read ``CURRENT`` just before a publication still finds its
version: a read must take less than that.

Usage: ``.venv/bin/python -m demo.report_stream --client-config D/client.yaml --out report/ [--once]``
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from demo.report import balances, operations, source_options, spark_session

CURRENT = "CURRENT"
"""In a published table's directory: the name of the current version (replaced atomically)."""
RETAIN_SUPERSEDED_S = 300.0
"""How long a superseded version stays readable after the publication that replaced it."""
MIN_VERSIONS_KEPT = 2


def publish_table(df: Any, table_dir: Path, label: str, now_s: float | None = None) -> Path:
    """Write ``df`` as a new version of the table in ``table_dir`` and make it current atomically (module
    docstring). Returns the version directory. Not safe for two concurrent publishers of one table."""
    table_dir.mkdir(parents=True, exist_ok=True)
    version = table_dir / f"v-{label}-{uuid.uuid4().hex[:8]}"
    df.write.parquet(str(version))  # a new directory: nobody reads it before CURRENT names it
    pointer = table_dir / f".{CURRENT}.{uuid.uuid4().hex[:8]}.tmp"
    pointer.write_text(version.name + "\n")
    os.replace(pointer, table_dir / CURRENT)
    _expire(table_dir, version.name, time.time() if now_s is None else now_s)
    return version


def _expire(table_dir: Path, current: str, now_s: float) -> None:
    # A version is superseded when the next one is published; its successor's modification time says when.
    versions = sorted((p for p in table_dir.glob("v-*") if p.is_dir()), key=lambda p: p.stat().st_mtime)
    for older, newer in itertools.pairwise(versions[: len(versions) - MIN_VERSIONS_KEPT + 1]):
        if older.name != current and now_s - newer.stat().st_mtime > RETAIN_SUPERSEDED_S:
            shutil.rmtree(older, ignore_errors=True)


def current_version(table_dir: Path) -> Path:
    """The directory of the table's current version (FileNotFoundError before the first publication)."""
    return table_dir / (table_dir / CURRENT).read_text().strip()


def read_published(spark: Any, table_dir: Path) -> Any:
    """The current version of a table published by :func:`publish_table`, as a DataFrame. The version is
    immutable, so the DataFrame stays readable while newer versions are published (for
    :data:`RETAIN_SUPERSEDED_S`)."""
    return spark.read.parquet(str(current_version(table_dir)))


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
        publish_table(batch, out_dir / "summary", str(batch_id))

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
