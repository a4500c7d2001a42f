"""The owning server's retention keeper on virtual time: a pending trim point reaches the partition only when
its grace ends; the policy sets a pending trim point that keeps the last N transactions, never above the
high-water mark, never replacing a pending one, and waits out the grace like any other. ZooKeeper is an
in-memory fake that applies the rules of ``raise_trim_point`` (``next_entry``)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from waltz.cluster.retention import Limits, RetentionConfig
from waltz.cluster.trim_points import TrimOutcome, TrimPoints, TrimSource, next_entry
from waltz.errors import ZooKeeperUnavailableError
from waltz.server.retention import RetentionKeeper
from waltz.testing.simloop import run_virtual

T0_MS = 1_700_000_000_000
GRACE_MS = 3_600_000
CHECK_MS = 60_000


class FakePartition:
    def __init__(self, high_water_mark: int) -> None:
        self.high_water_mark = high_water_mark
        self.is_healthy = True
        self.trim_point = 0

    def set_trim_point(self, trim_point: int) -> None:
        self.trim_point = max(self.trim_point, trim_point)

    async def segment_sizes(self, max_segments: int) -> list[tuple[int, int]]:
        # A segment of 1000 bytes for each 1000 ids up to the high-water mark.
        return [(first, 1000) for first in range(0, self.high_water_mark + 1, 1000)][-max_segments:]


class Harness:
    """The keeper, one partition, and a fake ZooKeeper that tells the keeper of every write (as the watch
    does)."""

    def __init__(self, high_water_mark: int, config: RetentionConfig) -> None:
        self.part = FakePartition(high_water_mark)
        self.points = TrimPoints()
        self.writes: list[tuple[int, int]] = []
        self.fail_writes = False
        self.keeper = RetentionKeeper(
            lambda: {0: self.part}, self.write, check_interval_ms=CHECK_MS, clock_ms=self.now_ms
        )
        self.keeper.update(config=config)

    @staticmethod
    def now_ms() -> int:
        return T0_MS + round(asyncio.get_running_loop().time() * 1000)

    async def write(self, pid: int, target: int, hwm: int, grace_ms: int) -> TrimOutcome:
        if self.fail_writes:
            raise ZooKeeperUnavailableError("connection lost")
        assert target <= hwm + 1
        entry = self.points.entry(pid).settled(self.now_ms())
        new = next_entry(entry, target, self.now_ms(), grace_ms, TrimSource.POLICY, replace_pending=False)
        if new is not None:
            self.writes.append((target, self.now_ms()))
            self.points = self.points.with_entry(pid, new)
            self.keeper.update(trim_points=self.points)
        return TrimOutcome(entry.requested, target, "")

    def operator_trim(self, target: int, grace_ms: int) -> None:
        entry = self.points.entry(0).settled(self.now_ms())
        new = next_entry(entry, target, self.now_ms(), grace_ms, TrimSource.OPERATOR)
        assert new is not None
        self.points = self.points.with_entry(0, new)
        self.keeper.update(trim_points=self.points)


def test_a_pending_trim_point_takes_effect_only_when_its_grace_ends(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "waltz.server.retention")

    async def main() -> None:
        h = Harness(10_000, RetentionConfig(grace_ms=GRACE_MS))
        task = asyncio.create_task(h.keeper.run())
        await asyncio.sleep(1)
        h.operator_trim(5_000, GRACE_MS)
        await asyncio.sleep(GRACE_MS / 1000 - 0.001)
        assert h.part.trim_point == 0  # still in its grace: nothing deleted, reads work
        await asyncio.sleep(0.01)
        assert h.part.trim_point == 5_000  # the keeper woke for it (not at its next check)
        assert h.writes == []  # no policy: nothing else is trimmed
        task.cancel()

    run_virtual(main())
    assert [r.getMessage() for r in caplog.records] == [
        "partition 0: trim point 5000 (set by an operator at 2023-11-14T22:13:21Z) is in force now that its "
        "grace ended"
    ]


def test_the_policy_keeps_the_last_n_after_the_grace() -> None:
    async def main() -> None:
        h = Harness(10_000, RetentionConfig(GRACE_MS, Limits(keep_transactions=1_000)))
        task = asyncio.create_task(h.keeper.run())
        await asyncio.sleep(0)
        assert h.writes == [(9_001, T0_MS)]  # hwm 10000 + 1 - 1000, pending
        assert h.part.trim_point == 0
        h.part.high_water_mark = 20_000  # more writes: the pending one is not replaced
        await asyncio.sleep(GRACE_MS / 1000 - 1)
        assert (h.writes, h.part.trim_point) == ([(9_001, T0_MS)], 0)
        await asyncio.sleep(1.01)
        assert h.part.trim_point == 9_001
        # Once it took effect, the policy sets the next one, which waits a grace of its own.
        await asyncio.sleep(CHECK_MS / 1000)
        assert h.writes[1] == (19_001, T0_MS + GRACE_MS)
        assert h.part.trim_point == 9_001
        await asyncio.sleep(GRACE_MS / 1000)
        assert h.part.trim_point == 19_001
        task.cancel()

    run_virtual(main())


def test_the_policy_waits_for_a_serving_partition_and_survives_zookeeper_errors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        h = Harness(500, RetentionConfig(0, Limits(keep_transactions=1_000)))
        h.part.is_healthy = False
        task = asyncio.create_task(h.keeper.run())
        await asyncio.sleep(0)
        h.part.high_water_mark = 3_000
        await asyncio.sleep(CHECK_MS / 1000)
        assert h.writes == []  # not serving: its high-water mark is not known to be committed
        h.part.is_healthy = True
        h.fail_writes = True
        for _ in range(5):
            await asyncio.sleep(CHECK_MS / 1000)
        h.fail_writes = False
        await asyncio.sleep(CHECK_MS / 1000)
        assert h.writes[-1][0] == 2_001
        assert h.part.trim_point == 2_001  # grace 0: at once
        task.cancel()

    run_virtual(main())
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) >= 1
    assert "could not set trim point 2001" in warnings[0].getMessage()


def test_a_partition_override_of_keep_all_wins_over_the_default() -> None:
    async def main() -> None:
        h = Harness(10_000, RetentionConfig(0, Limits(10, 10), {0: Limits()}))
        task = asyncio.create_task(h.keeper.run())
        await asyncio.sleep(CHECK_MS / 1000 * 3)
        assert (h.writes, h.part.trim_point) == ([], 0)
        task.cancel()

    run_virtual(main())


def test_a_limit_in_bytes_trims_whole_segments() -> None:
    async def main() -> None:
        h = Harness(10_499, RetentionConfig(0, Limits(keep_bytes=3_000)))
        task = asyncio.create_task(h.keeper.run())
        await asyncio.sleep(0)
        assert h.writes == [(8_000, T0_MS)]  # segments 8000, 9000 and 10000 hold 3000 bytes
        assert h.part.trim_point == 8_000
        task.cancel()

    run_virtual(main())
