"""What the cluster benches set up before their clusters: a temporary directory deleted at the end, and a real
ZooKeeper in it with a connected client (``catchup.py``, ``trim_p99.py``).
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kazoo.client import KazooClient

from waltz.cluster import zk as zkutil
from waltz.cluster.zkserver import ZooKeeperServer

__all__ = ["SESSION_TIMEOUT_MS", "run_in_temp_dir", "zookeeper"]

SESSION_TIMEOUT_MS = 10_000

BenchMain = Callable[[Path], Coroutine[Any, Any, None]]


def run_in_temp_dir(
    prefix: str, parent: str | None, main: Callable[[Path], Coroutine[Any, Any, None]]
) -> None:
    """``asyncio.run(main(base))`` with ``base`` a new directory under ``parent`` (None: the system's
    temporary directory) named ``prefix...``, deleted with everything in it when ``main`` ends, however."""
    base = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        asyncio.run(main(base))
    finally:
        shutil.rmtree(base, ignore_errors=True)


@contextmanager
def zookeeper(base: Path) -> Iterator[tuple[ZooKeeperServer, KazooClient]]:
    """A ZooKeeper server in ``base / "zk"`` and a client connected to it; both stopped at the end."""
    zks = ZooKeeperServer(base / "zk")
    zks.start()
    try:
        zk = zkutil.connect(zks.connect_string, session_timeout_ms=SESSION_TIMEOUT_MS)
        try:
            yield zks, zk
        finally:
            zkutil.close(zk)
    finally:
        zks.stop()
