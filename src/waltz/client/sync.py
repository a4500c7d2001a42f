"""``WaltzClient``: the thread-safe, blocking facade over :class:`~waltz.client.core.AsyncWaltzClient`.

The facade owns a private event loop running on its own daemon thread ("waltz-client-loop"); each
method submits a coroutine to it with :func:`asyncio.run_coroutine_threadsafe` and waits for the result.
Any number of application threads may call it concurrently. Application callbacks run on the client's
callback threads, as described in :mod:`waltz.client.core`.

Do not call the blocking methods from inside a callback of the same client (``apply_transaction``, a context
hook): the partition's feed waits for the callback, so such a call can only end in its timeout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine, Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from waltz.client.api import ClientCallbacks
from waltz.client.config import ClientConfig
from waltz.client.context import TransactionContext
from waltz.client.core import AsyncWaltzClient
from waltz.client.driver import ClientDriver
from waltz.errors import ClientClosedError, ClientError, ClientTimeoutError
from waltz.runtime import new_event_loop

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from waltz.cluster.trim_points import TrimOutcome

__all__ = ["WaltzClient"]

T = TypeVar("T")

SUBMIT_BATCH_MAX = 256
"""Contexts :meth:`WaltzClient.submit_many` hands to the loop in one call."""
START_TIMEOUT_S = 60.0
"""How long the constructor waits for the driver to open (ZooKeeper discovery)."""


class WaltzClient:
    """A Waltz client for threaded applications; thread-safe. Use as a context manager, or call :meth:`close`.

    The constructor connects (through the network driver, or ``driver`` / ``config.mock_driver``) and starts
    mounting partitions in the background. ``metrics_registry``: as :class:`AsyncWaltzClient`'s.
    """

    def __init__(
        self,
        callbacks: ClientCallbacks,
        config: ClientConfig,
        *,
        driver: ClientDriver | None = None,
        metrics_registry: CollectorRegistry | None = None,
    ) -> None:
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="waltz-client-loop", daemon=True)
        self._thread.start()
        self._closed = False
        self._close_lock = threading.Lock()
        self._client = AsyncWaltzClient(callbacks, config, driver=driver, metrics_registry=metrics_registry)
        self._submit_timeout_s = config.submit_timeout_ms / 1000
        try:
            self._call(self._client.start(), timeout=START_TIMEOUT_S)
        except BaseException:
            self._call(self._client.close(), timeout=START_TIMEOUT_S)
            self._stop_loop()
            raise

    # -- bridging ----------------------------------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        try:
            self._refuse_on_own_loop()
        except ClientError:
            coro.close()
            raise
        if not self._thread.is_alive():
            coro.close()
            raise ClientClosedError("the client is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise ClientTimeoutError(f"the client did not answer within {timeout} s") from None

    def _refuse_on_own_loop(self) -> None:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            return
        if running is self._loop:
            raise ClientError(
                "a blocking WaltzClient method was called on the client's own event loop (an inline "
                "callback?): it waits for that loop, which could never run it; call it from another thread"
            )

    def _refuse_on_callback_thread(self, method: str, waits_for: str) -> None:
        """Raise ClientError on one of this client's callback threads, for a call that waits for
        ``waits_for``: that can need the very thread the call blocks (without a timeout it would hang)."""
        if self._client.on_callback_thread():
            raise ClientError(
                f"WaltzClient.{method} was called on one of the client's own callback threads: it waits for "
                f"{waits_for}, which can need this very thread (the partition's feed waits for a callback to "
                "return), so it might never return; call it from another thread"
            )

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    # -- API ---------------------------------------------------------------------------------------------

    def set_exception_handler(
        self, handler: Callable[[asyncio.AbstractEventLoop, dict[str, Any]], object] | None
    ) -> None:
        """Where exceptions raised by context hooks go: ``handler(loop, context)`` on the client's loop
        thread, as ``loop.set_exception_handler`` (see docs/client.md, "When a hook raises"). None restores
        the default, which logs them."""
        self._loop.call_soon_threadsafe(self._loop.set_exception_handler, handler)

    def submit(self, context: TransactionContext) -> None:
        """Execute and append ``context``; blocks while the partition is at
        ``client.maxConcurrentTransactions`` (up to ``client.submitTimeout``, then
        :class:`~waltz.errors.ClientTimeoutError`). See :meth:`AsyncWaltzClient.submit`.

        On a mounted partition, ``execute`` runs on the calling thread (after waiting here for a free slot,
        if there is none) and the append is handed to the client's loop without waiting for it (no round
        trip through the loop per submit); otherwise (the partition not mounted yet) this waits on the loop
        as described."""
        try:
            on_own_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_own_loop = False
        # On the client's own loop _call refuses (a blocking call there could never finish).
        if (
            not on_own_loop
            and self._thread.is_alive()
            and self._client.submit_from_thread((context,), self._submit_timeout_s)
        ):
            return
        self._call(self._client.submit(context))

    def submit_many(self, contexts: Iterable[TransactionContext]) -> None:
        """Submit ``contexts`` in order: the bulk form of :meth:`submit` for loaders (a Spark task, an
        import). Same guarantees as calling :meth:`submit` for each in turn (the appends of one partition
        are sent in this order; back pressure blocks as there), but while slots are free the contexts are
        executed on this thread and handed to the client's loop up to :data:`SUBMIT_BATCH_MAX` at a time
        with one wake-up; without a free slot this thread waits for one, as :meth:`submit` does. An
        exception of a first attempt is raised at once (like :meth:`submit`, after
        ``on_exception``); the contexts before it were submitted, those after it were not.
        """
        pending = list(contexts)
        i = 0
        while i < len(pending):
            try:
                on_own_loop = asyncio.get_running_loop() is self._loop
            except RuntimeError:
                on_own_loop = False
            taken = 0
            if not on_own_loop and self._thread.is_alive():
                # Waits on this thread for room if the first has none (then executes here).
                batch = pending[i : i + SUBMIT_BATCH_MAX]
                taken = self._client.submit_from_thread(batch, self._submit_timeout_s)
            i += taken
            if taken == 0:
                self._call(self._client.submit(pending[i]))  # Waits on the loop (the partition not ready).
                i += 1

    def flush_transactions(self, timeout: float | None = None) -> None:
        """Block until every context submitted before the call has ended and been applied (seconds). Not on
        a callback thread of this client: that raises :class:`~waltz.errors.ClientError` (see
        :meth:`wait_applied`)."""
        self._refuse_on_callback_thread("flush_transactions", "contexts to be applied and their hooks to run")
        self._call(self._client.flush_transactions(timeout))

    def has_pending_transactions(self) -> bool:
        """True while a submitted context has not ended, or its transaction has not been applied yet."""
        return self._call(_value(self._client.has_pending_transactions))

    def applied_high_water_mark(self, partition_id: int) -> int:
        """The last transaction of ``partition_id`` this client knows the application applied (-1 before
        the mount): what the next ``execute`` gets. Read without a hop to the loop (one value that only
        grows). See :meth:`AsyncWaltzClient.applied_high_water_mark`."""
        return self._client.applied_high_water_mark(partition_id)

    def wait_applied(self, partition_id: int, transaction_id: int, timeout: float | None = None) -> None:
        """Block until :meth:`applied_high_water_mark` of ``partition_id`` reaches ``transaction_id``
        (``timeout`` in seconds, then :class:`~waltz.errors.ClientTimeoutError`). See
        :meth:`AsyncWaltzClient.wait_applied`. Not from inside a callback of this client: the feed waits for
        that callback to return (see the module docstring), so the wait could end only in its timeout; on a
        callback thread (or, inline, on the client's loop) it raises :class:`~waltz.errors.ClientError`."""
        self._refuse_on_callback_thread("wait_applied", "transactions to be applied")
        self._call(self._client.wait_applied(partition_id, transaction_id, timeout))

    def high_water_mark(self, partition_id: int) -> int:
        """The partition's high-water mark on the server (an RPC)."""
        return self._call(self._client.high_water_mark(partition_id))

    def trim(
        self,
        partition_id: int,
        transaction_id: int,
        *,
        min_kept_transactions: int | None = None,
    ) -> TrimOutcome:
        """Raise the partition's trim point to ``transaction_id`` (see :meth:`AsyncWaltzClient.trim`)."""
        return self._call(
            self._client.trim(partition_id, transaction_id, min_kept_transactions=min_kept_transactions)
        )

    def set_partitions(self, partition_ids: Iterable[int]) -> None:
        """Mount exactly these partitions (needs ``client.autoMount: false``)."""
        self._call(self._client.set_partitions(list(partition_ids)))

    @property
    def partitions(self) -> frozenset[int]:
        return self._call(_value(lambda: self._client.partitions))

    @property
    def num_partitions(self) -> int:
        return self._client.num_partitions  # Constant after start: no need to hop.

    @property
    def client_id(self) -> int:
        return self._client.client_id

    @property
    def cluster_name(self) -> str:
        return self._client.cluster_name

    @property
    def config(self) -> ClientConfig:
        return self._client.config

    def close(self) -> None:
        """Close the client (idempotent, thread-safe); contexts in flight end with ``ClientClosedError``. Not
        on a callback thread of this client: closing waits for those threads to end (ClientError)."""
        self._refuse_on_callback_thread("close", "the client's callback threads to end")
        self._refuse_on_own_loop()  # Before anything: it would leave the client half closed.
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._call(self._client.close())
            finally:
                self._stop_loop()

    def __enter__(self) -> WaltzClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


async def _value(fn: Callable[[], T]) -> T:
    """Read loop-owned state on the loop."""
    return fn()
