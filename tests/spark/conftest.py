"""One SparkSession and one Waltz cluster for every Spark test (PYSPARK.md §4.7).

``spark``          session-scoped ``local[2]`` SparkSession on loopback, two shuffle partitions, the ``waltz``
                   format registered. PySpark is a required test dependency (``make test`` installs the
                   ``spark`` extra): there is deliberately no skip when it is missing.
``waltz_cluster``  session-scoped local cluster (``waltz local``: ZooKeeper, one storage node, one server,
                   three partitions, 32 KiB segments) on loopback; ``options`` are the data source options
                   that reach it.
``log``            helpers on that cluster: ``append(rows)`` through the client, ``read_all()`` through the
                   plain LogReader (the reference the Spark reads are compared with).
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from waltz.client.config import ClientConfig
from waltz.client.reader import LogReader
from waltz.local import UpOptions, down, up
from waltz.protocol.records import Record
from waltz.spark.cluster import close_all
from waltz.spark.options import parse_options
from waltz.spark.writer import RowWriter, close_idle_sessions

NUM_PARTITIONS = 3
SEGMENT_SIZE_BYTES = 32 * 1024


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    os.environ["PYSPARK_PYTHON"] = sys.executable  # P3: workers must run this venv's interpreter.
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    from pyspark.sql import SparkSession

    import waltz.spark

    session = (
        SparkSession.builder.master("local[2]")
        .appName("waltz-tests")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    waltz.spark.register(session)
    yield session
    session.stop()


@dataclass
class WaltzTestCluster:
    directory: Path
    options: dict[str, str]

    @property
    def client_config(self) -> ClientConfig:
        return parse_options(self.options).client_config

    def append(self, rows: Sequence[dict[str, Any]]) -> None:
        """Append ``rows`` (``data`` and optional ``partition``/``header``) through the client, in order."""
        RowWriter(parse_options(self.options)).append_rows(rows)

    def read_all(self, partition: int) -> list[Record]:
        """The partition's whole committed log, through the plain LogReader."""

        async def read() -> list[Record]:
            async with LogReader(self.client_config) as reader:
                end = await reader.high_water_mark(partition)
                return [r async for r in reader.read(partition, 0, end)]

        return asyncio.run(read())

    def hwms(self) -> dict[int, int]:
        async def read() -> dict[int, int]:
            async with LogReader(self.client_config) as reader:
                return {p: await reader.high_water_mark(p) for p in range(NUM_PARTITIONS)}

        return asyncio.run(read())


@pytest.fixture(scope="session")
def waltz_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WaltzTestCluster]:
    directory = tmp_path_factory.mktemp("waltz-local")
    # Small segments: range reads stop at segment ends, so the readers' short-read path runs too.
    cluster = up(
        UpOptions(
            directory=directory,
            storages=1,
            servers=1,
            partitions=NUM_PARTITIONS,
            segment_size_bytes=SEGMENT_SIZE_BYTES,
        )
    )
    try:
        yield WaltzTestCluster(
            directory,
            {
                "waltz.zookeeper.connectString": cluster.zk_connect,
                "waltz.cluster.root": cluster.cluster_root,
                "waltz.zookeeper.sessionTimeout": "10000",
            },
        )
    finally:
        close_all()  # this process's reader connections, before their servers go
        close_idle_sessions()  # and the write sessions kept for the next append
        down(directory)
