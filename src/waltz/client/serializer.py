"""Turning application objects into transaction data and back.

Waltz stores transaction data as opaque bytes. An application either hands bytes to
:meth:`TransactionBuilder.set_transaction_data` directly or passes a :class:`Serializer` for its own type,
and uses the same serializer with :meth:`Transaction.get_transaction_data` on the way back.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Serializer(ABC, Generic[T]):
    """Converts values of type ``T`` to bytes and back. Implementations must be thread-safe: the client
    calls them from its callback threads."""

    @abstractmethod
    def serialize(self, data: T) -> bytes:
        """Encode ``data``."""

    @abstractmethod
    def deserialize(self, data: bytes) -> T:
        """Decode bytes produced by :meth:`serialize`."""


# One encoder for every call: json.dumps with options builds a new JSONEncoder each time.
_JSON_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"))
_JSON_DECODER = json.JSONDecoder()


class JsonSerializer(Serializer[Any]):
    """JSON in UTF-8 with sorted keys (so equal values give equal bytes, and equal checksums)."""

    def serialize(self, data: Any) -> bytes:
        return _JSON_ENCODER.encode(data).encode("utf-8")

    def deserialize(self, data: bytes) -> Any:
        return _JSON_DECODER.decode(data.decode("utf-8"))


class Utf8Serializer(Serializer[str]):
    """Text as UTF-8."""

    def serialize(self, data: str) -> bytes:
        return data.encode("utf-8")

    def deserialize(self, data: bytes) -> str:
        return data.decode("utf-8")
