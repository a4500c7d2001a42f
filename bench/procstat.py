"""What the benches read of a process from Linux's ``/proc``: its CPU time, its resident memory, its name.

CPU time is user + system of every thread of the process (fields 14 and 15 of ``/proc/<pid>/stat``, in
clock ticks; the fields after the command name, which may itself hold spaces and brackets, are counted
from its closing bracket). On a shared machine CPU per operation is a steadier figure than a wall-clock
rate, which is why the benches read it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

__all__ = ["ProcStat", "comm", "cpu_s", "rss_bytes", "stat", "total_cpu_s"]

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


class ProcStat(NamedTuple):
    """One reading of ``/proc/<pid>/stat``: the parent and the CPU seconds spent so far."""

    ppid: int
    user_s: float
    system_s: float

    @property
    def cpu_s(self) -> float:
        """User + system."""
        return self.user_s + self.system_s


def _path(pid: int | str, task: int | str | None, name: str) -> Path:
    return Path(f"/proc/{pid}/{name}" if task is None else f"/proc/{pid}/task/{task}/{name}")


def stat(pid: int | str, task: int | str | None = None) -> ProcStat:
    """Parent pid and CPU seconds of process ``pid`` (all its threads), or of its thread ``task``.

    Raises OSError when it has gone."""
    fields = _path(pid, task, "stat").read_text(encoding="ascii", errors="replace").rsplit(")", 1)[1].split()
    return ProcStat(int(fields[1]), int(fields[11]) / TICKS_PER_S, int(fields[12]) / TICKS_PER_S)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far. Raises OSError when it has gone."""
    return stat(pid).cpu_s


def total_cpu_s(pids: Iterable[int]) -> float:
    """User + system CPU seconds of ``pids`` together; a process that has gone counts nothing."""
    total = 0.0
    for pid in pids:
        try:
            total += cpu_s(pid)
        except OSError:
            continue
    return total


def rss_bytes(pid: int | None) -> int:
    """The resident set size of ``pid`` (``VmRSS`` of ``/proc/<pid>/status``); 0 for None or once it has
    gone."""
    if pid is None:
        return 0
    try:
        for line in _path(pid, None, "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def comm(pid: int | str, task: int | str | None = None) -> str:
    """The command name of ``pid`` (or of its thread ``task``), as /proc shows it: at most 15 characters."""
    return _path(pid, task, "comm").read_text().strip()
