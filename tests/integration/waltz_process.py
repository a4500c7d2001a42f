"""A ``waltz ... run`` command in a subprocess for integration tests: what storage nodes and servers share.

The command is started with a YAML config, and the test waits for the one JSON line it prints on stdout once
it serves (its ports). stderr goes to ``<base>/<name>.log`` (:meth:`WaltzProcess.log_text`). The process can
be killed (SIGKILL, a crash), terminated (SIGTERM, a clean stop), paused (SIGSTOP) and resumed (SIGCONT), and
restarted with the same config; subclasses say which command runs and how a restart keeps its ports.

Always stop it: use it as a context manager or call :meth:`WaltzProcess.stop` in a ``finally``.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import TracebackType
from typing import IO, Any, ClassVar, Self

import yaml

READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


class WaltzProcessError(RuntimeError):
    """The process did not start, or died, in a way the test did not ask for."""


class WaltzProcess:
    """One ``python -m waltz.cli.main <COMMAND> run --config ...`` process on loopback."""

    COMMAND: ClassVar[str]
    ERROR: ClassVar[type[WaltzProcessError]] = WaltzProcessError

    def __init__(self, base: Path, name: str, config: dict[str, Any], *, verbose: bool = False) -> None:
        self.base = Path(base)
        self.base.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.config_path = self.base / f"{name}.yaml"
        self.log_path = self.base / f"{name}.log"
        self.config = config
        self.verbose = verbose
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._paused = False
        self.extra_args: list[str] = []
        """Arguments after ``run --config FILE`` (such as ``--log-format json``)."""

    # -- what subclasses decide ---------------------------------------------------------------------

    def _config_for_start(self) -> dict[str, Any]:
        """The config to start with (a restart overrides port 0 with the ports the first start got)."""
        return dict(self.config)

    def _command(self) -> list[str]:
        """The command line up to ``--config`` (a subclass may start another entry point)."""
        return [
            sys.executable,
            "-m",
            "waltz.cli.main",
            *(["-v"] if self.verbose else []),
            self.COMMAND,
            "run",
        ]

    def _on_ready(self, ready: dict[str, Any]) -> None:
        """Take the ports from the ready line; raise KeyError/ValueError/TypeError if it is malformed."""

    # -- life cycle ---------------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise self.ERROR("not started")
        return self._proc.pid

    @property
    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> Self:
        """Start and wait until it serves; raises ERROR with its log otherwise."""
        if self.is_running:
            raise self.ERROR("already running")
        self.config_path.write_text(yaml.safe_dump(self._config_for_start()), encoding="utf-8")
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in _reap()
        cmd = [*self._command(), "--config", str(self.config_path), *self.extra_args]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log, stdin=subprocess.DEVNULL)
        line = self._read_ready_line(timeout_s)
        try:
            self._on_ready(json.loads(line))
        except (ValueError, KeyError, TypeError):
            self.kill()
            raise self.ERROR(f"unexpected ready line {line!r}; log:\n{self.log_text()}") from None
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
            if result:  # stdout closed: the process is exiting; let it finish before judging
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(10)
            alive = self._proc.poll() is None
            self.kill()
            what = f"did not report ready within {timeout_s} s" if alive else "exited before serving"
            raise self.ERROR(f"{self.name} {what}; log:\n{self.log_text()}")
        return result[0].decode().strip()

    def pause(self) -> None:
        """SIGSTOP: the process keeps its sockets but does nothing (its ZooKeeper session expires)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGSTOP)
            self._paused = True

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)
        self._paused = False

    def kill(self) -> None:
        """SIGKILL (no cleanup on its side: the crash durability tests need) and reap it."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
        self._reap()

    def terminate(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM (after SIGCONT if paused) and wait for a clean exit, SIGKILL after ``timeout_s``;
        returns the exit status."""
        if self._proc is None:
            return None
        if self._proc.poll() is None:
            if self._paused:
                self.resume()
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        code = self._proc.wait()
        self._reap()
        return code

    def restart(self, timeout_s: float = READY_TIMEOUT_S) -> Self:
        """Stop (cleanly, if still running) and start again with the same config and ports."""
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

    def _state(self) -> str:
        return f"pid {self._proc.pid}" if self._proc is not None else "stopped"

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
