"""Waltz: a distributed, replicated write-ahead log with optimistic locking."""

from waltz.errors import WaltzError

__version__ = "0.1.0"

__all__ = ["WaltzError", "__version__"]
