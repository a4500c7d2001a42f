"""The PySpark ``waltz`` data source (optional extra: ``pip install waltz-log[spark]``).

Usage::

    import waltz.spark
    waltz.spark.register(spark)
    df = (spark.read.format("waltz")
          .option("waltz.zookeeper.connectString", "zk:2181")
          .option("waltz.cluster.root", "/waltz/bank")
          .load())

See docs/spark.md for every option and the delivery guarantees. The pure modules (:mod:`.options`,
:mod:`.plan`, :mod:`.source`) import without PySpark; :class:`WaltzDataSource` and :func:`register` need it
and are imported lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from waltz.spark.datasource import WaltzDataSource

__all__ = ["WaltzDataSource", "register"]


def register(spark: Any) -> None:
    """Register the ``waltz`` format with a SparkSession (``spark.read.format("waltz")`` then works)."""
    from waltz.spark.datasource import WaltzDataSource

    spark.dataSource.register(WaltzDataSource)


def __getattr__(name: str) -> Any:
    if name == "WaltzDataSource":
        from waltz.spark.datasource import WaltzDataSource

        return WaltzDataSource
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
