"""Where the client runs a piece of application code: on its event loop or on a callback thread.

``client.callbackMode`` (docs/client.md, "Where callbacks run"):

* ``auto`` (the default): decided per callback. A coroutine function (``async def execute``, ``async def
  apply_transaction``, an ``async def`` hook) runs on the client's event loop and is awaited there, with no
  thread hop; a plain function runs on the callback threads, where it may block without stalling the
  client's networking. The hooks :class:`~waltz.client.context.TransactionContext` itself defines (which do
  nothing) run on the loop: skipping a no-op costs no hop. ``partition_id`` runs where ``execute`` does.
* ``threads``: accepted for compatibility, the same as ``auto`` (plain functions were always run on the
  callback threads; coroutine functions are now awaited on the loop instead of being called on a thread).
* ``inline``: every callback on the loop, plain functions included (they must not block).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Final

from waltz.client.context import TransactionContext

__all__ = ["AUTO", "INLINE", "MODES", "THREADS", "Dispatch", "runs_on_loop"]

AUTO: Final = "auto"
THREADS: Final = "threads"
INLINE: Final = "inline"
MODES: Final = (AUTO, THREADS, INLINE)

# The hooks a context inherits without overriding them: no-ops, run where they cost nothing.
_NO_OPS: Final = frozenset(
    {
        TransactionContext.on_completion,
        TransactionContext.on_application,
        TransactionContext.on_exception,
        TransactionContext.on_lock_failure,
    }
)


@functools.lru_cache(maxsize=4096)
def _function_on_loop(function: Callable[..., Any]) -> bool:
    return function in _NO_OPS or inspect.iscoroutinefunction(function)


def runs_on_loop(fn: Callable[..., Any]) -> bool:
    """In ``auto`` mode: True if ``fn`` (a function or bound method) runs on the event loop (a coroutine
    function, or an inherited no-op hook), False if on a callback thread. Cached per function."""
    function = getattr(fn, "__func__", fn)
    try:
        return _function_on_loop(function)
    except TypeError:  # Not hashable (a callable object): ask each time.
        return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None)  # noqa: B004 - an object with an async __call__
        )


class Dispatch:
    """The client's rule for one ``client.callbackMode``: :meth:`on_loop` says where a callback runs."""

    __slots__ = ("all_inline", "mode")

    def __init__(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"client.callbackMode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self.all_inline = mode == INLINE
        """Every callback runs on the loop (``inline``): no thread is ever used for application code."""

    def on_loop(self, fn: Callable[..., Any]) -> bool:
        return self.all_inline or runs_on_loop(fn)
