"""``ClientCallbacks``: how the client talks to the application."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Awaitable

    from waltz.client.transaction import Transaction


class ApplyAction(enum.Enum):
    """What :meth:`ClientCallbacks.uncaught_exception` may return about a transaction that failed to apply."""

    RETRY = "retry"
    """Deliver the same transaction again after a backoff (the default; returning None means this too)."""
    SKIP = "skip"
    """Give up on this transaction: the client counts it as applied, moves its high-water mark past it and
    delivers the next one. At the application's risk: the transaction's effect is lost, contexts waiting for
    it get ``on_application`` as if it had been applied, and an application that keeps its own high-water
    mark (``client_high_water_mark``) must record the skip itself or it will see the transaction again after
    a restart."""


class ClientCallbacks(ABC):
    """The application side of a Waltz client.

    Guarantees:

    * For each partition, :meth:`apply_transaction` is called for every committed transaction after the
      application's high-water mark, one at a time, in transaction-id order, with no gaps.
    * If :meth:`apply_transaction` raises, :meth:`uncaught_exception` is called with that exception and the
      **same** transaction is delivered again (after a growing backoff); the client's high-water mark does
      not advance past a transaction until :meth:`apply_transaction` returned normally, unless
      :meth:`uncaught_exception` returns :attr:`ApplyAction.SKIP`. The client logs the first traceback of a
      failing transaction, then a one-line reminder every 30 s.
    * A callback defined with ``async def`` runs on the client's event loop and is awaited there (fetch data
      with ``await transaction.fetch_transaction_data()``); a plain function runs on the client's callback
      threads (``client.numConsumerThreads``), never on the event loop, so a slow or blocking callback does
      not stall networking. Different partitions may be applied concurrently on different threads: plain
      callbacks must be thread-safe across partitions. (``client.callbackMode: inline`` runs plain functions
      on the loop too; see docs/client.md, "Where callbacks run".)
    * Do not wait on the client (``submit``, ``flush_transactions``, ``wait_applied``, ``close``) from
      inside a callback: the partition's feed waits for the callback, so the wait could not finish before
      its timeout. ``WaltzClient`` refuses ``flush_transactions``, ``wait_applied`` and ``close`` there with a
      ClientError (see docs/client.md, "Threads").
    """

    @abstractmethod
    def client_high_water_mark(self, partition_id: int) -> int:
        """The id of the last transaction of ``partition_id`` the application applied (-1 for none).

        Called when the partition is mounted; the client tracks the value itself afterwards.
        """

    @abstractmethod
    def apply_transaction(self, transaction: Transaction) -> Awaitable[None] | None:
        """Apply a committed transaction to the application's state (idempotently, or exactly once as
        :class:`waltz.client.sql.SqlClientCallbacks` does)."""

    @abstractmethod
    def uncaught_exception(
        self, partition_id: int, transaction_id: int, exception: BaseException
    ) -> ApplyAction | None:
        """``apply_transaction`` raised (or ``client_high_water_mark``: then ``transaction_id`` is -1).

        Return None (or :attr:`ApplyAction.RETRY`) to have the transaction delivered again after a backoff,
        or :attr:`ApplyAction.SKIP` to skip it (see there: at the application's risk). While one transaction
        keeps failing, ``submit`` to its partition fails with :class:`~waltz.errors.PartitionStuckError`,
        which names the transaction and the error.
        """
