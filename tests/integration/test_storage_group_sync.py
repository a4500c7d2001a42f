"""Group fsyncs across partitions on a real storage node (real files and fdatasync, loopback sockets): appends
to many partitions that reach the node together are made durable in a few hand-offs to threads, not one
each, and a failed fsync of one partition's file in such a hand-off fails that partition's group alone."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from tests.integration.group_sync_node import (
    NUM_PARTITIONS,
    SESSION,
    append_round,
    connected,
    record,
    start_node,
)
from waltz.errors import StorageError
from waltz.storage.node import StorageNode
from waltz.testing.faultfs import FaultyFileSystem

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def _counts(node: StorageNode) -> tuple[int, int, int, int]:
    """(group fsyncs, of them in a thread, hand-offs, fsyncs handed off) of the whole node."""
    parts = node.partitions
    group = node.group_sync
    return (
        sum(p.fsync_count for p in parts),
        sum(p.threaded_fsync_count for p in parts),
        group.handoffs,
        group.handed_off,
    )


def _since(node: StorageNode, before: tuple[int, int, int, int]) -> tuple[int, ...]:
    return tuple(a - b for a, b in zip(_counts(node), before, strict=True))


def test_appends_to_many_partitions_read_together_are_fsynced_in_a_few_hand_offs(tmp_path: Path) -> None:
    async def main() -> None:
        node = await start_node(tmp_path, FaultyFileSystem())
        try:
            admin, client = await connected(node)
            async with admin, client:
                before = _counts(node)
                for round_ in range(1, 4):
                    # Sent in one loop pass: the frames leave in one write and reach the node together.
                    await asyncio.gather(
                        *(client.append(SESSION, p, [record(p, round_)]) for p in range(NUM_PARTITIONS))
                    )
                fsyncs, threaded, handoffs, handed_off = _since(node, before)
                assert fsyncs == 3 * NUM_PARTITIONS  # every partition's file, once per group
                assert handed_off == threaded
                assert threaded >= 2 * NUM_PARTITIONS  # at most a few alone on the loop
                assert handoffs <= handed_off // 2  # a few per round (in up to 4 threads at once), not 16
                for p in range(NUM_PARTITIONS):
                    assert await client.max_transaction_id(SESSION, p) == 3
                    assert node.partitions[p].durable_max == 3
        finally:
            await node.aclose()

    asyncio.run(main())


def test_appends_to_many_idle_partitions_read_together_are_written_without_their_workers(
    tmp_path: Path,
) -> None:
    """Each idle partition's append of a read that brings many is written where it is read and answered from
    its fsync's callback (``commit_soon``): no worker wake-up per partition; still Success only after the
    fsync, durable across a restart; the first goes to its worker (which groups what follows it)."""

    async def main() -> None:
        node = await start_node(tmp_path, FaultyFileSystem())
        try:
            admin, client = await connected(node)
            worker_groups = [0]
            for part in node.partitions:
                original = part._group_commit

                async def counted(first: object, original: object = original) -> None:
                    worker_groups[0] += 1
                    await original(first)  # type: ignore[operator]

                part._group_commit = counted  # type: ignore[method-assign,assignment]
            async with admin, client:
                before = _counts(node)
                for round_ in range(1, 4):
                    await asyncio.gather(
                        *(client.append(SESSION, p, [record(p, round_)]) for p in range(NUM_PARTITIONS))
                    )
                fsyncs, _threaded, _handoffs, _handed_off = _since(node, before)
                assert fsyncs == 3 * NUM_PARTITIONS
                assert worker_groups[0] <= 3 * 2  # about one per read, not one per partition
                for p in range(NUM_PARTITIONS):
                    assert node.partitions[p].durable_max == 3
                    assert not node.partitions[p].busy
        finally:
            await node.aclose()

    asyncio.run(main())


def test_a_failed_fsync_in_a_shared_hand_off_fails_only_its_partitions_group(tmp_path: Path) -> None:
    """The fsyncs after the failed one in the same job still run and count; the failed partition is
    fail-stopped (as a failed fsync always makes it), the others serve on."""

    async def main() -> None:
        fs = FaultyFileSystem()
        node = await start_node(tmp_path, fs)
        try:
            admin, client = await connected(node)
            async with admin, client:
                before = _counts(node)
                fs.fail_next_fsyncs(1, path_part=str(tmp_path / "storage" / "5") + os.sep)
                outcomes = await append_round(client, 1)
                _fsyncs, _threaded, handoffs, handed_off = _since(node, before)
                assert handed_off >= NUM_PARTITIONS - 1  # the failed one went with the others
                assert handoffs <= handed_off // 2
                assert fs.failed_fsyncs == 1
                for p, outcome in enumerate(outcomes):
                    if p == 5:
                        assert isinstance(outcome, StorageError)
                        assert "injected" in str(outcome)
                    else:
                        assert outcome is None, (p, outcome)
                        assert node.partitions[p].durable_max == 1
                        assert node.partitions[p].broken is None
                broken = node.partitions[5].broken
                assert broken is not None
                assert broken.startswith("fsync failed")
                assert node.partitions[5].durable_max == 0  # the failed group is not counted durable
                await client.append(SESSION, 4, [record(4, 2)])  # the others take appends on
                with pytest.raises(StorageError, match="fail-stopped"):
                    await client.append(SESSION, 5, [record(5, 1)])
        finally:
            await node.aclose()

    asyncio.run(main())
