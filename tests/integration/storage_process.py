"""A real storage node in a subprocess, for integration tests (storage now, servers and clusters later).

``StorageProcess`` writes a YAML config, starts ``python -m waltz.cli.main storage run --config ...`` and
waits for the JSON line ``{"port", "admin_port", "http_port"}`` the command prints once it serves. Ports 0
pick free ports; :meth:`restart` (after :meth:`kill` or :meth:`terminate`) reuses the ports it got the first
time and the same directory, as an operator restarting a crashed node would. The node's stderr goes to
``<base>/storage-<n>.log`` so tests can look for logged reasons; :meth:`log_text` reads it.

Always stop it: use it as a context manager or call :meth:`stop` in a ``finally``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

import yaml

DEFAULT_KEY = uuid.UUID("6f1f0f7e-1d2c-4b3a-9e8d-7c6b5a493827")
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


class StorageProcessError(RuntimeError):
    """The storage process did not start, or died, in a way the test did not ask for."""


class StorageProcess:
    """One storage node process on loopback; see the module docstring."""

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
    ) -> None:
        self.base = Path(base)
        self.base.mkdir(parents=True, exist_ok=True)
        self.directory = self.base / f"{name}-data"
        self.config_path = self.base / f"{name}.yaml"
        self.log_path = self.base / f"{name}.log"
        self.cluster_key = cluster_key
        self.num_partitions = num_partitions
        self.name = name
        self.verbose = verbose
        values: dict[str, Any] = {
            "storage.port": 0,
            "storage.admin.port": 0,
            "storage.directory": str(self.directory),
        }
        if use_cluster_identity:
            values["storage.cluster.key"] = str(cluster_key)
            values["storage.cluster.numPartitions"] = num_partitions
        values.update(config or {})
        self.config = values
        self.port = 0
        self.admin_port = 0
        self.http_port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    # ------------------------------------------------------------------------------------ lifecycle

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise StorageProcessError("not started")
        return self._proc.pid

    @property
    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> Self:
        """Start the node and wait until it serves; raises StorageProcessError with its log otherwise."""
        if self.is_running:
            raise StorageProcessError("already running")
        values = dict(self.config)
        if self.port:  # a restart: keep the ports the first start got
            values["storage.port"] = self.port
            values["storage.admin.port"] = self.admin_port
            if self.http_port:
                values["storage.http.port"] = self.http_port
        self.config_path.write_text(yaml.safe_dump(values), encoding="utf-8")
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in _reap()
        cmd = [sys.executable, "-m", "waltz.cli.main"]
        if self.verbose:
            cmd.append("-v")
        cmd += ["storage", "run", "--config", str(self.config_path)]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log, stdin=subprocess.DEVNULL)
        line = self._read_ready_line(timeout_s)
        try:
            ready = json.loads(line)
            self.port, self.admin_port, self.http_port = (
                int(ready["port"]),
                int(ready["admin_port"]),
                int(ready["http_port"]),
            )
        except (ValueError, KeyError, TypeError):
            self.kill()
            raise StorageProcessError(f"unexpected ready line {line!r}; log:\n{self.log_text()}") from None
        return self

    def _read_ready_line(self, timeout_s: float) -> str:
        assert self._proc is not None
        assert self._proc.stdout is not None
        stdout = self._proc.stdout
        result: list[bytes] = []
        reader = threading.Thread(target=lambda: result.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not result or not result[0]:
            alive = self._proc.poll() is None
            self.kill()
            what = f"did not report ready within {timeout_s} s" if alive else "exited before serving"
            raise StorageProcessError(f"{self.name} {what}; log:\n{self.log_text()}")
        return result[0].decode().strip()

    def kill(self) -> None:
        """SIGKILL the node (no cleanup on its side: the crash the durability tests need) and reap it."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
        self._reap()

    def terminate(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM and wait for a clean exit (SIGKILL after ``timeout_s``); returns the exit status."""
        if self._proc is None:
            return None
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        code = self._proc.wait()
        self._reap()
        return code

    def restart(self, timeout_s: float = READY_TIMEOUT_S) -> Self:
        """Stop (cleanly, if still running) and start again on the same ports and directory."""
        if self.is_running:
            self.terminate()
        return self.start(timeout_s)

    def stop(self) -> None:
        """Terminate if running; safe to call at any time, repeatedly."""
        if self.is_running:
            self.terminate()
        self._reap()

    def _reap(self) -> None:
        if self._proc is not None:
            self._proc.wait()
            if self._proc.stdout is not None:
                self._proc.stdout.close()
            self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid {self._proc.pid}" if self._proc is not None else "stopped"
        return f"StorageProcess({self.name}, {state}, port {self.port}, admin {self.admin_port})"
