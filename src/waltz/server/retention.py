"""The owning server's side of retention: trim points in force, and the retention policy applied.

A server watches ``<root>/store/trim`` (trim points, :mod:`waltz.cluster.trim_points`) and
``<root>/store/retention`` (the policy and the grace, :mod:`waltz.cluster.retention`). One task,
:meth:`RetentionKeeper.run`, owned by the server, then keeps each owned partition's trim point in force:

* it gives each partition the trim point in force now (:meth:`TrimPoints.in_force`), which the partition
  passes to its replicas; a pending trim point is applied when its grace ends (the task wakes for it), with
  one INFO line;
* every ``server.retention.checkInterval`` ms it applies the policy to each owned partition that is serving
  and has nothing pending (:func:`waltz.cluster.retention.policy_trim_point`): with ``keepTransactions`` K and
  committed high-water mark H, the target is ``H + 1 - K``; with ``keepBytes`` B, the first id of the oldest
  of the newest segments that hold B bytes on a replica of the open session (storage message 26); the
  higher of the two, never above H. When it is above the trim point requested it is set as a pending trim
  point (``source`` policy), which takes effect after the grace like any other. So the policy never goes
  above the high-water mark, never skips the grace, and keeps between K and K + (the writes of about one
  grace) transactions.

Bounded work: one pass looks at each owned partition once and writes ZooKeeper at most once per partition;
a failed write is logged (WARNING, at most once per 10 s) and tried again at the next pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from kazoo.client import KazooClient

from waltz.cluster.retention import RetentionConfig, decode_or_default, policy_trim_point
from waltz.cluster.trim_points import TrimOutcome, TrimPoints, format_time_ms, wall_clock_ms
from waltz.cluster.zk import ClusterPaths
from waltz.errors import WaltzError

log = logging.getLogger(__name__)

WARNING_INTERVAL_S = 10.0
"""A failing policy write is logged at most once per this many seconds."""


class RetainedPartition(Protocol):
    """What the keeper uses of a partition's store (:class:`waltz.server.store.StorePartition`)."""

    @property
    def high_water_mark(self) -> int: ...

    @property
    def is_healthy(self) -> bool: ...

    def set_trim_point(self, trim_point: int) -> None: ...

    async def segment_sizes(self, max_segments: int) -> list[tuple[int, int]]: ...


MAX_SEGMENTS_ASKED = 4096
"""For a limit in bytes, the newest segments asked of a replica (4 TiB of segments of the default 1 GB)."""


PolicyWriter = Callable[[int, int, int, int], Awaitable[TrimOutcome]]
"""``write(partition_id, target, high_water_mark, grace_ms)``: set a policy trim point (see
:func:`waltz.cluster.trim_points.raise_trim_point`, ``replace_pending=False``)."""


class RetentionKeeper:
    """Keeps the owned partitions' trim points in force and applies the retention policy (see the module
    docstring). Not thread-safe: call everything on the server's event loop."""

    def __init__(
        self,
        partitions: Callable[[], Mapping[int, RetainedPartition]],
        write: PolicyWriter,
        *,
        check_interval_ms: int,
        clock_ms: Callable[[], int] = wall_clock_ms,
    ) -> None:
        self._partitions = partitions
        self._write = write
        self._check_interval_ms = check_interval_ms
        self._clock_ms = clock_ms
        self.trim_points = TrimPoints()
        """As ZooKeeper last told (``<root>/store/trim``)."""
        self.config = RetentionConfig()
        """As ZooKeeper last told (``<root>/store/retention``); the defaults until then."""
        self._applied: dict[int, int] = {}
        self._changed = asyncio.Event()
        self._warned_at = -WARNING_INTERVAL_S

    def in_force(self, partition_id: int) -> int:
        """The partition's trim point in force now."""
        return self.trim_points.in_force(partition_id, self._clock_ms())

    def update(self, trim_points: TrimPoints | None = None, config: RetentionConfig | None = None) -> None:
        """New values from ZooKeeper: apply the trim points in force at once, and wake the task."""
        if trim_points is not None:
            self.trim_points = trim_points
        if config is not None:
            self.config = config
        self.apply_in_force()
        self._changed.set()

    def apply_in_force(self) -> None:
        """Give each owned partition its trim point in force now (a partition ignores a lower one)."""
        now = self._clock_ms()
        for pid, part in self._partitions().items():
            entry = self.trim_points.entry(pid)
            point = entry.in_force(now)
            pending = entry.pending
            if pending is not None and point == pending.trim_point and self._applied.get(pid, 0) < point:
                log.info(
                    "partition %d: trim point %d (set by %s at %s) is in force now that its grace ended",
                    pid,
                    point,
                    pending.source.label,
                    format_time_ms(pending.set_at_ms),
                )
            self._applied[pid] = max(point, self._applied.get(pid, 0))
            part.set_trim_point(point)

    async def run(self) -> None:
        """Apply trim points and the policy until cancelled (the server owns this task)."""
        while True:
            self._changed.clear()
            self.apply_in_force()
            await self.apply_policy()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), self._sleep_s())

    def _sleep_s(self) -> float:
        wait_ms = self._check_interval_ms
        next_ms = self.trim_points.next_change_ms()
        now = self._clock_ms()
        if next_ms is not None and next_ms > now:
            wait_ms = min(wait_ms, next_ms - now)
        return max(wait_ms, 1) / 1000

    async def apply_policy(self) -> None:
        """One pass of the policy over the owned, serving partitions."""
        config, now = self.config, self._clock_ms()
        for pid, part in list(self._partitions().items()):
            limits = config.limits_of(pid)
            entry = self.trim_points.entry(pid).settled(now)
            if limits.keeps_everything or not part.is_healthy or entry.pending is not None:
                continue
            hwm = part.high_water_mark
            try:
                segments = await part.segment_sizes(MAX_SEGMENTS_ASKED) if limits.keep_bytes else []
                target = policy_trim_point(limits, hwm, segments)
                if target > entry.requested:
                    await self._write(pid, target, hwm, config.grace_ms)
            except WaltzError as e:
                if time.monotonic() - self._warned_at >= WARNING_INTERVAL_S:
                    self._warned_at = time.monotonic()
                    log.warning(
                        "partition %d: the retention policy could not set trim point %d: %s", pid, target, e
                    )


async def watch(zk: KazooClient, root: str, keeper: RetentionKeeper) -> None:
    """Watch the trim points and the retention policy in ZooKeeper for ``keeper`` (kazoo calls back on its
    own threads; each value hops onto the event loop)."""
    loop = asyncio.get_running_loop()
    paths = ClusterPaths(root)

    def on_trim(data: bytes | None, _stat: Any, *_: Any) -> None:
        loop.call_soon_threadsafe(_trim_data, keeper, data)

    def on_policy(data: bytes | None, _stat: Any, *_: Any) -> None:
        loop.call_soon_threadsafe(_policy_data, keeper, data)

    await asyncio.to_thread(zk.DataWatch, paths.trim_points, on_trim)
    await asyncio.to_thread(zk.DataWatch, paths.retention, on_policy)


def _trim_data(keeper: RetentionKeeper, data: bytes | None) -> None:
    try:
        points = TrimPoints.decode(data) if data else TrimPoints()
    except WaltzError as e:
        log.error("unreadable trim points in ZooKeeper (keeping the ones known): %s", e)
        return
    keeper.update(trim_points=points)


def _policy_data(keeper: RetentionKeeper, data: bytes | None) -> None:
    try:
        config = decode_or_default(data)
    except WaltzError as e:
        log.error("unreadable retention policy in ZooKeeper (keeping the one known): %s", e)
        return
    keeper.update(config=config)
