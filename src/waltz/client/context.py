"""``TransactionContext``: the application code that builds one transaction, possibly several times."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Awaitable

    from waltz.client.builder import TransactionBuilder


class TransactionContext(ABC):
    """Packages the logic that produces one transaction.

    The client calls :meth:`execute` to build the transaction and appends it. If the append fails (a lock
    conflict, a lost request, a server change) the client calls :meth:`execute` **again**, with a fresh
    builder carrying the application's newer high-water mark, until the transaction is appended, ``execute``
    returns ``False`` (the context gives up), it raises, or the context expires (``client.transactionTimeout``
    or ``client.maxTransactionAttempts``). ``execute`` must therefore read the state it depends on every time
    it runs and must not have side effects of its own.

    Exactly one of these ends a context: ``on_completion(True)`` (appended), ``on_completion(False)`` (gave
    up), or ``on_exception(e)`` (``execute`` raised, the context expired, the partition was released, or the
    client closed). After ``on_completion(True)``, ``on_application()`` follows once this client has applied
    the transaction through ``ClientCallbacks.apply_transaction`` (unless the client is closed first).

    Threading: a method defined with ``async def`` (``execute`` and the hooks may be coroutine functions)
    runs on the client's event loop and is awaited there; a plain method runs on one of the client's
    callback threads (where it may block), or, with ``WaltzClient.submit``, ``partition_id`` and a plain
    ``execute`` on the submitting thread (docs/client.md, "Where callbacks run"). ``partition_id`` runs
    where ``execute`` does. Methods of one context run one at a time, in the order above.
    """

    def __init__(self) -> None:
        self.creation_time: float = time.time()
        """Wall-clock creation time (seconds since the epoch); ``client.transactionTimeout`` starts here."""

    @abstractmethod
    def partition_id(self, num_partitions: int) -> int:
        """The partition to append to, in ``range(num_partitions)``. Called once per ``submit``."""

    @abstractmethod
    def execute(self, builder: TransactionBuilder) -> bool | Awaitable[bool]:
        """Fill ``builder`` (header, data, locks). Return ``True`` to append, ``False`` to give up."""

    def on_completion(self, result: bool) -> Awaitable[None] | None:  # noqa: B027 - optional hook
        """The context ended without an exception: ``True`` if appended, ``False`` if ``execute`` gave up."""

    def on_application(self) -> Awaitable[None] | None:  # noqa: B027 - optional hook
        """The appended transaction has been applied by this client (after ``on_completion(True)``)."""

    def on_exception(self, exception: BaseException) -> Awaitable[None] | None:  # noqa: B027 - optional hook
        """The context ended with ``exception``; it will not be retried."""

    def on_lock_failure(self) -> Awaitable[None] | None:  # noqa: B027 - optional hook
        """An attempt was rejected by an optimistic-lock conflict; the context will be executed again once
        this client has applied the conflicting transaction."""
