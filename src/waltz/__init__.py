"""Waltz: a distributed, replicated write-ahead log with optimistic locking."""

from waltz.client.api import ClientCallbacks
from waltz.client.builder import TransactionBuilder
from waltz.client.config import ClientConfig
from waltz.client.context import TransactionContext
from waltz.client.core import AsyncWaltzClient
from waltz.client.locks import PartitionLocalLock
from waltz.client.serializer import Serializer
from waltz.client.sync import WaltzClient
from waltz.client.transaction import Transaction
from waltz.errors import WaltzError

__version__ = "0.1.0"

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
