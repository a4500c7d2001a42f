"""An asyncio event loop on virtual time, for deterministic simulation.

The loop is asyncio's own ``BaseEventLoop`` (so tasks, futures, ``asyncio.sleep``, ``asyncio.timeout`` and
``call_at`` behave exactly as in production) with two changes: :meth:`time` returns a virtual clock, and the
"selector" never waits: when no callback is ready, it jumps the virtual clock to the next timer. A run is
therefore as fast as the CPU allows and, given the same seed, identical every time (no I/O, no real time).

If nothing is ready and no timer is pending, every task waits for something that can never happen:
:class:`SimulationDeadlock` is raised out of ``run_until_complete``.

``after_step`` (optional) is called after every iteration of the loop (every batch of ready callbacks, so
after every step any task took): the fault simulator checks its invariants there, so a violation is caught at
the step that caused it, not at the next periodic check. An exception it raises ends the run.

This is the only clock of the replication core: the store layer sleeps and times out with ``asyncio`` on
the running loop, so under this loop all of its time is virtual.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["SimulationDeadlock", "VirtualTimeLoop", "run_virtual"]

T = TypeVar("T")


class SimulationDeadlock(RuntimeError):
    """Every task is blocked and no timer is pending."""


class _FastForward:
    """Stands in for the selector: 'waiting' for ``timeout`` seconds just moves virtual time."""

    def __init__(self, loop: VirtualTimeLoop) -> None:
        self._loop = loop

    def select(self, timeout: float | None) -> list[Any]:
        if timeout is None:
            raise SimulationDeadlock(f"all tasks blocked at t={self._loop.time():.3f}s with no timer pending")
        if timeout > 0:
            self._loop.advance(timeout)
        return []

    def close(self) -> None:
        pass


class VirtualTimeLoop(asyncio.BaseEventLoop):
    """asyncio on virtual time (see the module docstring)."""

    def __init__(self, after_step: Callable[[], None] | None = None) -> None:
        super().__init__()
        self._now = 0.0
        self._after_step = after_step
        self._selector = _FastForward(self)
        # Virtual time is exact: a timer is due precisely when the clock reaches it.
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += seconds

    def _run_once(self) -> None:
        super()._run_once()  # type: ignore[misc]
        if self._after_step is not None:
            self._after_step()

    def _process_events(self, event_list: list[Any]) -> None:
        pass

    def _write_to_self(self) -> None:
        pass


def run_virtual(coro: Coroutine[Any, Any, T], after_step: Callable[[], None] | None = None) -> T:
    """Run ``coro`` to completion on a fresh :class:`VirtualTimeLoop` (calling ``after_step`` after every
    step)."""
    with asyncio.Runner(loop_factory=lambda: VirtualTimeLoop(after_step)) as runner:
        return runner.run(coro)
