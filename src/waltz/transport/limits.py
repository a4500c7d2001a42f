"""The transport's bounds: default limits of every connection and listener, the byte budget of a handler's
responses, and the rate limit on WARNINGs about misbehaving peers."""

from __future__ import annotations

import asyncio
import collections
import logging
import re
import time
from collections.abc import Callable
from typing import Final

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT_MS",
    "DEFAULT_HANDSHAKE_TIMEOUT_MS",
    "DEFAULT_IDLE_TIMEOUT_S",
    "DEFAULT_KEEP_ALIVE_INTERVAL_S",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_MAX_CONNECTIONS_PER_SOURCE",
    "DEFAULT_MAX_IN_FLIGHT",
    "DEFAULT_WRITE_BUFFER_HIGH_BYTES",
    "PEER_WARNING_INTERVAL_S",
    "ByteBudget",
    "RateLimitedLog",
    "reason_kind",
]

log = logging.getLogger("waltz.transport")
"""The one logger of the whole transport package (operators filter on ``waltz.transport``)."""

DEFAULT_WRITE_BUFFER_HIGH_BYTES: Final = 4 * 1024 * 1024
"""``drain()`` waits while more than this is queued for the socket (asyncio's default of 64 KiB is below one
replication batch and would stall every append)."""
DEFAULT_KEEP_ALIVE_INTERVAL_S: Final = 60.0
DEFAULT_CONNECT_TIMEOUT_MS: Final = 10_000
DEFAULT_HANDSHAKE_TIMEOUT_MS: Final = 10_000
DEFAULT_MAX_CONNECTIONS: Final = 1024
DEFAULT_MAX_CONNECTIONS_PER_SOURCE: Final = 256
"""Connections one source address may hold on a listener, so one host cannot take every slot."""
DEFAULT_IDLE_TIMEOUT_S: Final = 3 * DEFAULT_KEEP_ALIVE_INTERVAL_S
"""A served connection silent this long is closed: three keep-alive intervals of a healthy connecting side."""
DEFAULT_MAX_IN_FLIGHT: Final = 1024
COALESCE_MAX_BYTES: Final = 1024 * 1024
"""Frames sent in one loop iteration are written together, up to this many bytes per write."""
HEADER_CACHE_SIZE: Final = 256
"""Payload sizes whose frame header a connection remembers (7 bytes each)."""
CLOSE_TIMEOUT_S: Final = 1.0

PEER_WARNING_INTERVAL_S: Final = 10.0
"""One WARNING per peer address and reason per this many seconds; the next one counts those left out."""


class RateLimitedLog:
    """WARNINGs about peers, at most one per ``(source, kind)`` per ``interval_s``.

    A peer that repeats a fault (reconnecting with garbage, flooding connections) would otherwise write a line
    per attempt, as fast as it can reconnect. The first occurrence is logged at once; repeats within
    the interval are counted and the next line logged for that key says how many were left out. At most
    ``max_keys`` keys are remembered (the oldest are forgotten), so the bookkeeping is bounded too.
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = PEER_WARNING_INTERVAL_S,
        *,
        max_keys: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._max_keys = max_keys
        self._clock = clock
        self._seen: collections.OrderedDict[tuple[str, str], list[float]] = collections.OrderedDict()
        """``(source, kind) -> [time of the last line logged, repeats left out since]``."""

    def warning(self, source: str, kind: str, msg: str, *args: object) -> bool:
        """Log ``msg % args`` unless ``(source, kind)`` was logged within the interval; True if logged."""
        key = (source, kind)
        now = self._clock()
        seen = self._seen.get(key)
        if seen is not None and now - seen[0] < self._interval_s:
            seen[1] += 1
            return False
        left_out = int(seen[1]) if seen is not None else 0
        self._seen[key] = [now, 0]
        self._seen.move_to_end(key)
        while len(self._seen) > self._max_keys:
            self._seen.popitem(last=False)
        if left_out:
            msg += " (%d more like this from %s in the last %g s not logged)"
            args = (*args, left_out, source, self._interval_s)
        self._logger.warning(msg, *args)
        return True


peer_warnings = RateLimitedLog(log)
"""The WARNINGs of connections that belong to no listener (those of open_connection)."""
_DIGITS = re.compile(r"\d+")


def reason_kind(prefix: str, error: BaseException) -> str:
    """A rate-limiting kind for ``error``: its type and message with numbers blanked (so "type 98" and
    "type 99" are one reason, while "unknown type" and "truncated" stay two), at most 100 characters."""
    return f"{prefix}:{type(error).__name__}:{_DIGITS.sub('#', str(error))[:100]}"


class ByteBudget:
    """The bytes of responses one connection's handler may hold at once (being read, or unsent).

    :meth:`acquire` waits while the reservations already granted plus the new one exceed ``capacity_bytes``;
    a reservation larger than the whole budget is granted once nothing else is reserved, so one oversized
    response still goes, alone. Waiting here is back pressure: the handler that waits reads no more requests.
    Single event loop; no locking.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._used = 0
        self._freed = asyncio.Event()

    @property
    def reserved_bytes(self) -> int:
        return self._used

    def try_acquire(self, n: int) -> bool:
        """:meth:`acquire` if it would not wait (True), else nothing (False)."""
        if self._used and self._used + n > self.capacity_bytes:
            return False
        self._used += n
        return True

    async def acquire(self, n: int) -> None:
        while self._used and self._used + n > self.capacity_bytes:
            self._freed.clear()
            await self._freed.wait()
        self._used += n

    def release(self, n: int) -> None:
        self._used -= n
        self._freed.set()
