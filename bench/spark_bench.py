"""What ``spark_read.py`` and ``spark_write.py`` share: the cluster they start and the SparkSession they use.

Both benches run against a ``waltz local`` cluster (ZooKeeper, one storage node, one server, ``PARTITIONS``
partitions) in a temporary directory that is stopped and deleted at the end, and against a ``local[2]``
SparkSession on loopback with the ``waltz`` format registered. Keeping that set-up here means the two benches
measure the same cluster shape and the same Spark configuration, so their figures can be compared.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from procstat import comm
from procstat import stat as proc_stat
from waltz.local import UpOptions, down, up

__all__ = ["PARTITIONS", "BenchCluster", "cpu_seconds", "median", "spark_session", "waltz_cluster"]

PARTITIONS = 2


@dataclass(frozen=True)
class BenchCluster:
    directory: Path
    options: dict[str, str]
    """The data source options that reach the cluster (its address only: the defaults are what is timed)."""


@contextmanager
def waltz_cluster(prefix: str) -> Iterator[BenchCluster]:
    """A ``waltz local`` cluster in a new temporary directory; stopped and the directory deleted on exit."""
    directory = Path(tempfile.mkdtemp(prefix=prefix))
    cluster = up(UpOptions(directory=directory, storages=1, servers=1, partitions=PARTITIONS))
    try:
        yield BenchCluster(
            directory,
            {
                "waltz.zookeeper.connectString": cluster.zk_connect,
                "waltz.cluster.root": cluster.cluster_root,
            },
        )
    finally:
        down(directory, purge=True)
        shutil.rmtree(directory, ignore_errors=True)  # and what the bench wrote there (Parquet copies)


@contextmanager
def spark_session(conf: dict[str, str] | None = None) -> Iterator[Any]:
    """A ``local[2]`` SparkSession on loopback with the ``waltz`` format registered; stopped on exit.

    ``conf`` adds Spark settings (e.g. ``{"spark.python.worker.reuse": "false"}`` for an A/B run)."""
    os.environ["PYSPARK_PYTHON"] = sys.executable  # workers must run this venv's interpreter
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    from pyspark.sql import SparkSession

    import waltz.spark

    builder = (
        SparkSession.builder.master("local[2]")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.sql.shuffle.partitions", "2")
    )
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    waltz.spark.register(spark)
    try:
        yield spark
    finally:
        spark.stop()


def median(values: list[float]) -> float:
    """The middle value (the upper one of an even count, so it is always a measured figure)."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


# JVM thread names (as /proc shows them: 15 characters) -> the group they are counted in.
_JVM_THREAD_GROUPS = (
    ("Executor task", "jvm_tasks"),
    ("C2 CompilerThre", "jvm_jit"),
    ("C1 CompilerThre", "jvm_jit"),
)


def _jvm_threads(pid: str, out: dict[str, float]) -> None:
    """Add a JVM's executor task threads (they read the Python workers' Arrow streams, make rows, aggregate)
    and its JIT compiler threads to ``out``. Threads that ended between two readings take their CPU with
    them (JDK 17 starts and stops compiler threads on demand), so these are lower bounds."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for task in tasks:
        try:
            name = comm(pid, task)
            cpu = proc_stat(pid, task).cpu_s
        except (OSError, ValueError, IndexError):
            continue  # ended meanwhile
        for prefix, group in _JVM_THREAD_GROUPS:
            if name.startswith(prefix):
                out[group] += cpu
                break


def cpu_seconds(cluster: BenchCluster) -> dict[str, float]:
    """CPU seconds used so far by each side of a bench, from /proc (the machine is shared, so CPU per row is
    a steadier figure than a rate): ``cluster`` (the storage node and the server), ``spark`` (every process
    this one started: the JVM, its Python workers), split into ``jvm`` and ``workers`` (the Python worker
    processes: executors, planners), with the JVM's ``jvm_tasks`` and ``jvm_jit`` threads (see
    :func:`_jvm_threads`), and ``bench`` (this process)."""
    record = json.loads((cluster.directory / "cluster.json").read_text())
    cluster_pids = {str(p["pid"]) for p in (*record["storages"], *record["servers"]) if p.get("pid")}
    stats: dict[str, tuple[int, float]] = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                one = proc_stat(pid)
                stats[pid] = (one.ppid, one.cpu_s)
            except (OSError, ValueError, IndexError):
                pass  # exited meanwhile
    me = os.getpid()
    out = {
        "cluster": 0.0,
        "spark": 0.0,
        "jvm": 0.0,
        "workers": 0.0,
        "jvm_tasks": 0.0,
        "jvm_jit": 0.0,
        "bench": sum(os.times()[:2]),
    }
    for pid, (_, cpu) in stats.items():
        if pid in cluster_pids:
            out["cluster"] += cpu
            continue
        parent, depth = pid, 0
        while parent in stats and int(parent) != me and depth < 16:
            parent, depth = str(stats[parent][0]), depth + 1
        if int(parent) == me and int(pid) != me:
            out["spark"] += cpu
            try:
                java = comm(pid) == "java"
            except OSError:
                java = False
            if java:
                out["jvm"] += cpu
                _jvm_threads(pid, out)
            else:
                out["workers"] += cpu
    return out
