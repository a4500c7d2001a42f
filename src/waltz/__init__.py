"""Waltz: a distributed, replicated write-ahead log with optimistic locking.

The client API below is imported on first use, not with the package: a storage node or a server imports
``waltz.storage`` or ``waltz.server``, which run this file first, and must not load the client library
(``tests/unit/test_layering.py`` checks it).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from waltz.errors import WaltzError
from waltz.version import __version__

if TYPE_CHECKING:
    from waltz.client.api import ClientCallbacks
    from waltz.client.builder import TransactionBuilder
    from waltz.client.config import ClientConfig
    from waltz.client.context import TransactionContext
    from waltz.client.core import AsyncWaltzClient
    from waltz.client.locks import PartitionLocalLock
    from waltz.client.serializer import Serializer
    from waltz.client.sync import WaltzClient
    from waltz.client.transaction import Transaction

_CLIENT_API = {
    "AsyncWaltzClient": "waltz.client.core",
    "ClientCallbacks": "waltz.client.api",
    "ClientConfig": "waltz.client.config",
    "PartitionLocalLock": "waltz.client.locks",
    "Serializer": "waltz.client.serializer",
    "Transaction": "waltz.client.transaction",
    "TransactionBuilder": "waltz.client.builder",
    "TransactionContext": "waltz.client.context",
    "WaltzClient": "waltz.client.sync",
}

__all__ = [
    "AsyncWaltzClient",
    "ClientCallbacks",
    "ClientConfig",
    "PartitionLocalLock",
    "Serializer",
    "Transaction",
    "TransactionBuilder",
    "TransactionContext",
    "WaltzClient",
    "WaltzError",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _CLIENT_API.get(name)
    if module is None:
        raise AttributeError(f"module 'waltz' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: the next lookup does not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
