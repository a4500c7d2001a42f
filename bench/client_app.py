"""The application the client benches run (``client_peer.py`` against a real cluster, ``client_cpu.py``
against a fake server, ``peer.py`` and ``clients.py`` through ``client_peer``): callbacks that keep only the
high-water mark, and one append context, with plain functions and with coroutine functions.

A plain context's hooks run where the client's ``client.callbackMode`` puts them: on the callback threads
(``inline`` False: ``done`` hops onto the loop with ``call_soon_threadsafe``) or on the loop (``inline``
True: ``done`` is called at once). A coroutine context's hooks are awaited on the loop, so they call
``done`` at once.

Imports only the public ``waltz`` API: ``client_cpu.py`` runs it against older source trees too.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable

from waltz import ClientCallbacks, PartitionLocalLock, Transaction, TransactionBuilder, TransactionContext

__all__ = ["PAYLOAD", "RECORD_BYTES", "AsyncCallbacks", "AsyncCtx", "Callbacks", "Ctx"]

RECORD_BYTES = 512
PAYLOAD = bytes(RECORD_BYTES)


class Callbacks(ClientCallbacks):
    """Keeps only the high-water mark (the bench measures the client, not an application)."""

    def __init__(self) -> None:
        self.hwm = -1
        self.counter = 0  # hot64's shared state: how many increments were applied

    def client_high_water_mark(self, partition_id: int) -> int:
        return self.hwm

    def apply_transaction(self, transaction: Transaction) -> None:
        self.hwm = transaction.transaction_id
        if transaction.header == 1:
            self.counter += 1

    def uncaught_exception(self, partition_id: int, transaction_id: int, exception: BaseException) -> None:
        print(f"apply failed: {exception!r}", file=sys.stderr)


class AsyncCallbacks(Callbacks):
    async def apply_transaction(self, transaction: Transaction) -> None:  # type: ignore[override]
        self.hwm = transaction.transaction_id
        if transaction.header == 1:
            self.counter += 1


class Ctx(TransactionContext):
    """One append; ``done`` is called (on the loop) on completion or application, as asked."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        inline: bool,
        done: Callable[[bool], None],
        lock: int | None = None,
        wait_apply: bool = False,
        header: int = 0,
        partition: int = 0,
    ) -> None:
        super().__init__()
        self._partition = partition
        self._loop = loop
        self._inline = inline
        self._done = done
        self._lock = PartitionLocalLock("k", lock) if lock is not None else None
        self._wait_apply = wait_apply
        self._header = header

    def partition_id(self, num_partitions: int) -> int:
        return self._partition

    def execute(self, builder: TransactionBuilder) -> bool:
        builder.set_header(self._header)
        builder.set_transaction_data(PAYLOAD)
        if self._lock is not None:
            builder.set_write_locks([self._lock])
        return True

    def _signal(self, ok: bool) -> None:
        if self._inline:
            self._done(ok)
        else:
            self._loop.call_soon_threadsafe(self._done, ok)

    def on_completion(self, result: bool) -> None:
        if not result or not self._wait_apply:
            self._signal(result)

    def on_application(self) -> None:
        if self._wait_apply:
            self._signal(True)

    def on_exception(self, exception: BaseException) -> None:
        print(f"context failed: {exception!r}", file=sys.stderr)
        self._signal(False)


class AsyncCtx(Ctx):
    """``Ctx`` with a coroutine ``execute`` and hooks: the client awaits them on its loop."""

    async def execute(self, builder: TransactionBuilder) -> bool:  # type: ignore[override]
        return super().execute(builder)

    async def on_completion(self, result: bool) -> None:  # type: ignore[override]
        if not result or not self._wait_apply:
            self._done(result)

    async def on_application(self) -> None:  # type: ignore[override]
        if self._wait_apply:
            self._done(True)

    async def on_exception(self, exception: BaseException) -> None:  # type: ignore[override]
        print(f"context failed: {exception!r}", file=sys.stderr)
        self._done(False)
