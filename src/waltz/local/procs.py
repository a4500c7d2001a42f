"""Detached local processes, identified by pid *and* start time, and loopback port checks.

``waltz local up`` must leave its processes running after it exits, and ``waltz local down`` (a different
process, maybe much later) must stop exactly those processes. So every process is started in its own session
(``start_new_session``: a Ctrl-C in the terminal that ran ``up`` does not reach it) and recorded by pid and by
its start time in clock ticks since boot (``/proc/<pid>/stat`` field 22). A pid whose start time differs is a
recycled pid, and is never signalled.

Processes started by *this* Python process keep their :class:`subprocess.Popen` object in a module registry:
that is how they are reaped (no zombie left behind by a test that calls the library directly) and it keeps
``Popen.__del__`` from warning about a child that is still running, which is the whole point.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from waltz.errors import ClusterError

LOOPBACK = "127.0.0.1"
STOP_GRACE_S = 10.0
"""How long a SIGTERM'd process may take to exit cleanly before it gets SIGKILL."""
POLL_INTERVAL_S = 0.05

_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}
"""Processes started by this Python process, by pid (see the module docstring)."""


class ProcessStartError(ClusterError):
    """A process exited, or did not report ready, while it was being started."""


@dataclass(frozen=True)
class ProcessId:
    """A process as recorded in cluster.json: pid plus start time (None where /proc is unavailable)."""

    pid: int
    start_ticks: int | None


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None if there is no such (live) process.

    Zombies count as gone: a killed child nobody has reaped yet is not running.
    """
    try:
        raw = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = raw[raw.rfind(")") + 2 :].split()
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def identify(pid: int) -> ProcessId:
    return ProcessId(pid, start_ticks(pid))


def is_alive(proc: ProcessId | None) -> bool:
    """True if the recorded process is still the one running under its pid."""
    if proc is None:
        return False
    child = _CHILDREN.get(proc.pid)
    if child is not None and child.poll() is not None:
        _CHILDREN.pop(proc.pid, None)
        return False
    if Path("/proc/self/stat").exists():
        ticks = start_ticks(proc.pid)
        return ticks is not None and (proc.start_ticks is None or ticks == proc.start_ticks)
    try:  # Not Linux: no start time to compare, only existence.
        os.kill(proc.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _reap(pid: int) -> None:
    child = _CHILDREN.pop(pid, None)
    if child is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=STOP_GRACE_S)


def wait_gone(proc: ProcessId, timeout_s: float) -> bool:
    """Whether the recorded process is gone (exited, a zombie, or its pid reused) within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not is_alive(proc):
            return True
        time.sleep(POLL_INTERVAL_S)
    return not is_alive(proc)


def stop(proc: ProcessId | None, grace_s: float = STOP_GRACE_S) -> bool:
    """SIGTERM, then SIGKILL after ``grace_s``; returns True if the process was running. Never signals a
    recycled pid. Idempotent."""
    if proc is None or not is_alive(proc):
        if proc is not None:
            _reap(proc.pid)
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGTERM)
    if not wait_gone(proc, grace_s):
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        wait_gone(proc, grace_s)
    _reap(proc.pid)
    return True


def kill(proc: ProcessId | None) -> bool:
    """SIGKILL, as in a crash; returns True if the process was running."""
    if proc is None or not is_alive(proc):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGKILL)
    wait_gone(proc, STOP_GRACE_S)
    _reap(proc.pid)
    return True


def spawn_detached(cmd: Sequence[str], *, stdout: Path, stderr: Path, cwd: Path | None = None) -> ProcessId:
    """Start ``cmd`` in its own session with stdout (truncated) and stderr (appended) going to files."""
    stdout.parent.mkdir(parents=True, exist_ok=True)
    with stdout.open("wb") as out, stderr.open("ab") as err:
        child = subprocess.Popen(
            list(cmd),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            cwd=cwd,
            start_new_session=True,
        )
    _CHILDREN[child.pid] = child
    return identify(child.pid)


def adopt(child: subprocess.Popen[bytes]) -> ProcessId:
    """Register a child started elsewhere (the ZooKeeper launcher) so it is reaped like ours."""
    _CHILDREN[child.pid] = child
    return identify(child.pid)


def wait_ready_line(
    proc: ProcessId, stdout: Path, stderr: Path, what: str, timeout_s: float
) -> dict[str, Any]:
    """Wait for the JSON line a ``waltz storage|server run`` prints once it serves, and return it parsed.

    Raises ProcessStartError (with the tail of the process's log) if the process exits first or stays
    silent for ``timeout_s``; a silent process is killed first, so nothing is left running.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError):
            for line in stdout.read_text(encoding="utf-8", errors="replace").splitlines():
                if line.startswith("{"):
                    try:
                        value = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(value, dict):
                        return value
        if not is_alive(proc):
            _reap(proc.pid)
            raise ProcessStartError(f"{what} exited during start; {stderr}:\n{log_tail(stderr)}")
        if time.monotonic() > deadline:
            kill(proc)
            raise ProcessStartError(
                f"{what} did not report ready within {timeout_s:g} s; {stderr}:\n{log_tail(stderr)}"
            )
        time.sleep(POLL_INTERVAL_S)


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "  (no log)"
    tail = text.splitlines()[-lines:]
    return "\n".join(f"  {line}" for line in tail) if tail else "  (empty log)"


# ------------------------------------------------------------------------------------------------------ ports


def port_in_use(port: int, host: str = LOOPBACK) -> bool:
    """True if ``host:port`` cannot be bound right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def free_ports(count: int, host: str = LOOPBACK, exclude: frozenset[int] = frozenset()) -> list[int]:
    """``count`` distinct ports the OS reports free now (all sockets held open until all are chosen, so the
    OS cannot hand the same port out twice)."""
    sockets: list[socket.socket] = []
    try:
        ports: list[int] = []
        while len(ports) < count:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(s)
            s.bind((host, 0))
            port = int(s.getsockname()[1])
            if port not in exclude:
                ports.append(port)
        return ports
    finally:
        for s in sockets:
            s.close()
