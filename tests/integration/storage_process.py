"""A real storage node in a subprocess, for integration tests (storage now, servers and clusters later).

``StorageProcess`` writes a YAML config, starts ``python -m waltz.cli.main storage run --config ...`` and
waits for the JSON line ``{"port", "admin_port", "http_port"}`` the command prints once it serves. Ports 0
pick free ports; :meth:`restart` (after :meth:`kill` or :meth:`terminate`) reuses the ports it got the first
time and the same directory, as an operator restarting a crashed node would. The node's stderr goes to
``<base>/storage-<n>.log`` so tests can look for logged reasons; :meth:`log_text` reads it.

Always stop it: use it as a context manager or call :meth:`stop` in a ``finally``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.integration.waltz_process import READY_TIMEOUT_S, STOP_TIMEOUT_S, WaltzProcess, WaltzProcessError
from waltz.protocol.records import Record
from waltz.server.storage_client import AdminClient, StorageClient

DEFAULT_KEY = uuid.UUID("6f1f0f7e-1d2c-4b3a-9e8d-7c6b5a493827")
__all__ = ["DEFAULT_KEY", "READY_TIMEOUT_S", "STOP_TIMEOUT_S", "StorageProcess", "StorageProcessError"]


class StorageProcessError(WaltzProcessError):
    """The storage process did not start, or died, in a way the test did not ask for."""


class StorageProcess(WaltzProcess):
    """One storage node process on loopback; see the module docstring."""

    COMMAND = "storage"
    ERROR = StorageProcessError

    def __init__(
        self,
        base: Path,
        *,
        cluster_key: uuid.UUID = DEFAULT_KEY,
        num_partitions: int = 4,
        config: dict[str, Any] | None = None,
        name: str = "storage",
        use_cluster_identity: bool = True,
        verbose: bool = False,
        faulty: bool = False,
    ) -> None:
        self.directory = Path(base) / f"{name}-data"
        self.cluster_key = cluster_key
        self.num_partitions = num_partitions
        values: dict[str, Any] = {
            "storage.port": 0,
            "storage.admin.port": 0,
            "storage.directory": str(self.directory),
        }
        if use_cluster_identity:
            values["storage.cluster.key"] = str(cluster_key)
            values["storage.cluster.numPartitions"] = num_partitions
        values.update(config or {})
        super().__init__(base, name, values, verbose=verbose)
        self.faulty = faulty
        """Run on the test-only failing file layer (``python -m waltz.testing.faultfs``): each
        :meth:`fail_next_fsync` fails the node's next data fsync."""
        self.port = 0
        self.admin_port = 0
        self.http_port = 0

    def _config_for_start(self) -> dict[str, Any]:
        values = dict(self.config)
        if self.port:  # a restart: keep the ports the first start got
            values["storage.port"] = self.port
            values["storage.admin.port"] = self.admin_port
            if self.http_port:
                values["storage.http.port"] = self.http_port
        return values

    def _command(self) -> list[str]:
        if not self.faulty:
            return super()._command()
        return [sys.executable, "-m", "waltz.testing.faultfs", *(["-v"] if self.verbose else [])]

    def fail_next_fsync(self) -> None:
        """Make the node's next data fsync fail with EIO (only with ``faulty=True``)."""
        if not self.faulty:
            raise self.ERROR(f"{self.name} does not run on the failing file layer (faulty=False)")
        os.kill(self.pid, signal.SIGUSR1)

    def _on_ready(self, ready: dict[str, Any]) -> None:
        self.port, self.admin_port, self.http_port = (
            int(ready["port"]),
            int(ready["admin_port"]),
            int(ready["http_port"]),
        )

    async def admin_client(self) -> AdminClient:
        """A new admin connection to this node, as the cluster's identity (close it: ``async with``)."""
        return await AdminClient.connect("127.0.0.1", self.admin_port, self.cluster_key, self.num_partitions)

    async def data_client(self) -> StorageClient:
        """A new data connection to this node, as a server would open (close it: ``async with``)."""
        return await StorageClient.connect("127.0.0.1", self.port, self.cluster_key, self.num_partitions)

    def __repr__(self) -> str:
        return f"StorageProcess({self.name}, {self._state()}, port {self.port}, admin {self.admin_port})"


async def append_until_killed(
    client: StorageClient,
    node: StorageProcess,
    next_id: int,
    make: Callable[[int, int], list[Record]],
    *,
    in_flight: int,
    max_batch: int,
    kill_after_s: float,
    acked: set[int],
) -> None:
    """Stream appends to partition 0 (session 7), ``in_flight`` at a time, batches of ``1 + id % max_batch``
    records made by ``make(first_id, count)``, from ``next_id`` on, and SIGKILL the node ``kill_after_s`` into
    the stream with appends in flight; every acknowledged id goes into ``acked``. Returns once every append
    sent has ended (the ones the kill caught fail: they were not acknowledged)."""
    sem = asyncio.Semaphore(in_flight)
    tasks: set[asyncio.Task[None]] = set()
    kill_at = time.monotonic() + kill_after_s

    async def one(batch: list[Record]) -> None:
        try:
            await client.append(7, 0, batch)
            acked.update(r.transaction_id for r in batch)
        except Exception:  # the node dies mid-stream: unacknowledged appends may fail
            pass
        finally:
            sem.release()

    while True:
        await sem.acquire()
        if not client.is_usable:
            break
        n = 1 + next_id % max_batch
        task = asyncio.create_task(one(make(next_id, n)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        next_id += n
        if time.monotonic() > kill_at and node.is_running:
            node.kill()  # SIGKILL with appends in flight
    await asyncio.gather(*tasks, return_exceptions=True)
