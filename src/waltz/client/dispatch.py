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

__all__ = ["ALL_ON_LOOP", "AUTO", "INLINE", "MODES", "THREADS", "Dispatch", "Where", "runs_on_loop"]

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


Where = tuple[bool, bool, bool]
"""Where a context's callbacks run, decided once per context: ``(execute, on_completion, on_application)``,
each True for the event loop, False for a callback thread (``partition_id`` runs where ``execute`` does)."""
ALL_ON_LOOP: Final[Where] = (True, True, True)

_CONTEXTS_KEPT: Final = 4096
"""Context classes whose :data:`Where` a :class:`Dispatch` keeps (past that, it is decided per context)."""


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
    """The client's rule for one ``client.callbackMode``: :meth:`on_loop` says where a callback runs,
    :meth:`where` where a context's run on the hot path (decided once per context class)."""

    __slots__ = ("_by_class", "all_inline", "mode")

    def __init__(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"client.callbackMode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self.all_inline = mode == INLINE
        """Every callback runs on the loop (``inline``): no thread is ever used for application code."""
        self._by_class: dict[type[TransactionContext], Where] = {}

    def on_loop(self, fn: Callable[..., Any]) -> bool:
        return self.all_inline or runs_on_loop(fn)

    def where(self, context: TransactionContext) -> Where:
        """Where ``context``'s ``execute``, ``on_completion`` and ``on_application`` run: decided once per
        context class (one dict lookup per submit instead of a test per call), unless the context itself
        holds one of them (an instance attribute), which is decided for that context alone."""
        if self.all_inline:
            return ALL_ON_LOOP
        try:
            own = context.__dict__
        except AttributeError:  # A class with __slots__ and no __dict__: its methods decide.
            own = None
        if own and ("execute" in own or "on_completion" in own or "on_application" in own):
            return _decide(context)
        where = self._by_class.get(type(context))
        if where is None:
            where = _decide(context)
            if len(self._by_class) < _CONTEXTS_KEPT:
                self._by_class[type(context)] = where
        return where


def _decide(context: TransactionContext) -> Where:
    return (
        runs_on_loop(context.execute),
        runs_on_loop(context.on_completion),
        runs_on_loop(context.on_application),
    )
