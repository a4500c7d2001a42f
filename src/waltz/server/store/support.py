"""Small pieces the store layer shares: its configuration, bounded retry backoff, rate-limited retry
logging."""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field

from waltz.errors import InvariantViolation

__all__ = [
    "RETRY_LOG_INTERVAL_S",
    "Backoff",
    "InvariantViolation",
    "RepairStatistics",
    "RetryLog",
    "StoreConfig",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreConfig:
    """Limits and intervals of the store layer (defaults are the original's ``storage.*`` settings)."""

    max_batch_size: int = 100
    """Appends per write round (``storage.maxBatchSize``)."""
    max_batch_bytes: int = 4 * 1024 * 1024
    """Data bytes per write round (``storage.maxBatchBytes``); one larger append is a round of its own."""
    max_queued_appends: int = 200
    """Appends waiting for a write round; producers wait beyond this (2 x max_batch_size, as the original)."""
    checkpoint_interval: int = 250_000
    """Transactions after which a new session is forced, advancing the storage clean points."""
    initial_retry_interval_ms: int = 100
    max_retry_interval_ms: int = 20_000
    catch_up_batch_size: int = 20
    """Records per read when a replica copies from another."""
    max_inflight_batches: int = 4
    """Batches a session may have sent and not yet committed (``storage.maxInflightBatches``); they commit
    in order. With 1, each batch waits for the previous one's quorum."""
    max_pending_batches: int = 8
    """Committed batches a replica may still owe its acknowledgement for; one more means it cannot keep up and
    the session ends."""
    join_max_lag: int = 200
    """How far (in transactions) a late replica may be behind the writer when it joins the writes."""
    rpc_timeout_ms: int = 30_000
    """Safety net: a storage call taking longer counts as a broken connection."""
    idle_probe_interval_ms: int = 1_000
    """An idle participant's liveness bound: a node that has not answered anything on its shared link for
    this long is probed (a lost link is noticed at once, without a probe); also the first per-partition
    check after the last write."""
    idle_probe_max_interval_ms: int = 30_000
    """The per-partition check of an idle replica (its max id against what it acknowledged: a lost or an
    extra record) backs off from ``idle_probe_interval_ms``, doubling while it agrees, to this."""
    max_metadata_attempts: int = 10
    """Version-checked metadata writes attempted before giving up on one session (each re-reads)."""
    max_read_attempts: int = 5
    stale_report_ms: int = 30_000
    """A partition refused by a newer generation in its metadata, with no newer assignment reaching this
    server within this time, is reported as holding metadata no assignment explains (forged or corrupt)."""
    damage_poll_interval_ms: int = 10_000
    """An open session asks each participant this often which stored records it found damaged (its background
    scrub finds damage nobody read) and repairs them from another participant; 0 turns this off."""

    def __post_init__(self) -> None:
        for name in (
            "max_batch_size",
            "max_batch_bytes",
            "max_queued_appends",
            "checkpoint_interval",
            "initial_retry_interval_ms",
            "max_retry_interval_ms",
            "catch_up_batch_size",
            "max_inflight_batches",
            "max_pending_batches",
            "rpc_timeout_ms",
            "idle_probe_interval_ms",
            "idle_probe_max_interval_ms",
            "max_metadata_attempts",
            "max_read_attempts",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.damage_poll_interval_ms < 0:
            raise ValueError("damage_poll_interval_ms must not be negative")
        if self.join_max_lag < self.max_batch_size:
            raise ValueError("join_max_lag must be at least max_batch_size, or a late replica may never join")


@dataclass
class RepairStatistics:
    """Repairs of damaged records that storage nodes reported on their own (found by their scrub, not by a
    read), since the partition was opened here. Plain numbers: the server reads them when scraped."""

    started: int = 0
    finished: int = 0
    """Repairs that ended with every reported record rewritten from a good copy."""
    failed: int = 0
    records: int = 0
    """Records rewritten by those repairs."""
    in_progress: dict[str, str] = field(default_factory=dict)
    """Repairs running now: storage node -> the ids being rewritten."""
    failing: dict[str, str] = field(default_factory=dict)
    """Storage nodes whose last repair failed (it is tried again later) -> the ids and why; cleared by the
    node's next repair that rewrites everything it reported."""

    def health(self) -> dict[str, object]:
        """What ``/health`` shows of them (the counters are in /metrics too)."""
        return {
            "started": self.started,
            "finished": self.finished,
            "failed": self.failed,
            "records": self.records,
            "inProgress": dict(self.in_progress),
            "failing": dict(self.failing),
        }


class Backoff:
    """Exponential backoff with jitter: ``initial``, doubling up to ``maximum`` (milliseconds).

    Each delay is drawn uniformly from ``[d/2, d]`` with the injected random source, so two servers retrying
    at once drift apart, and a simulation replays exactly. It sleeps on the running loop's clock, the one
    time source of the store layer (virtual under :class:`waltz.testing.VirtualTimeLoop`).
    """

    def __init__(self, rng: random.Random, initial_ms: int, maximum_ms: int) -> None:
        self._rng = rng
        self._initial_ms = initial_ms
        self._maximum_ms = maximum_ms
        self._next_ms = initial_ms

    def next_delay_ms(self) -> int:
        ceiling = self._next_ms
        self._next_ms = min(self._next_ms * 2, self._maximum_ms)
        return self._rng.randint(ceiling // 2, ceiling)

    async def sleep(self) -> None:
        await asyncio.sleep(self.next_delay_ms() / 1000)

    def reset(self) -> None:
        self._next_ms = self._initial_ms


RETRY_LOG_INTERVAL_S = 10.0
"""A retry loop logs at most one line per this many seconds (the others go to DEBUG, and are counted)."""


class RetryLog:
    """The log lines of one retry loop, at most one per ``interval_s`` (on the running loop's clock, so
    virtual in the simulator). A refusal that a loop retries every 100 ms must not write thousands of lines a
    minute: the first line is logged at once; lines within the interval go to DEBUG and are counted, and the
    next line logged says how many were left out."""

    def __init__(self, logger: logging.Logger, interval_s: float = RETRY_LOG_INTERVAL_S) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._last_s: float | None = None
        self._left_out = 0

    def log(self, level: int, msg: str, *args: object) -> bool:
        """Log ``msg % args`` at ``level`` unless this loop logged within the interval; True if logged."""
        now = asyncio.get_running_loop().time()
        if self._last_s is not None and now - self._last_s < self._interval_s:
            self._left_out += 1
            self._logger.debug(msg, *args)
            return False
        if self._left_out:
            msg += " (%d more line(s) of this retry loop in the last %g s not logged)"
            args = (*args, self._left_out, self._interval_s)
        self._last_s = now
        self._left_out = 0
        self._logger.log(level, msg, *args)
        return True
