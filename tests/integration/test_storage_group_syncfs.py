"""Group fsyncs made durable by one ``syncfs`` on a real storage node (real files on the test machine's ext4,
the kernel's syncfs, loopback sockets): appends to many partitions that reach the node together cost a
syncfs each round, not an fdatasync per partition, and survive a restart; an injected syncfs failure falls
back to each file's fdatasync, which fails only the bad file's partition; ``storage.fsync.syncfsMinFiles: 0``
turns it off. The start-up INFO line says which mode the node uses."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import pytest

from tests.integration.group_sync_node import NUM_PARTITIONS, SESSION, append_round, connected, start_node
from waltz.errors import StorageError
from waltz.storage.fileio import OS_FS
from waltz.testing.faultfs import FaultyFileSystem

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def test_appends_to_many_partitions_together_take_one_syncfs_and_survive_a_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    handle, why = OS_FS.open_fs_sync(str(tmp_path))
    assert handle is not None, f"this test needs a file system syncfs is trusted on: {why}"
    handle.close()

    async def main() -> None:
        fs = FaultyFileSystem()
        with caplog.at_level(logging.INFO, logger="waltz.storage.node"):
            node = await start_node(tmp_path, fs)
        assert "group commits: syncfs(2) on ext4, Linux " in caplog.text
        assert "for batches of >= 4 files" in caplog.text
        try:
            admin, client = await connected(node)
            async with admin, client:
                calls, fsyncs = node.group_sync.syncfs_calls, sum(p.fsync_count for p in node.partitions)
                for i in range(1, 4):
                    assert await append_round(client, i) == [None] * NUM_PARTITIONS
                assert sum(p.fsync_count for p in node.partitions) - fsyncs == 3 * NUM_PARTITIONS
                assert 1 <= node.group_sync.syncfs_calls - calls <= 6  # one or two per round, not 16
                assert node.group_sync.syncfs_failures == 0
                assert all(p.durable_max == 3 for p in node.partitions)
        finally:
            await node.aclose()
        node = await start_node(tmp_path, FaultyFileSystem())
        try:
            admin, client = await connected(node, first_appends=False)
            async with admin, client:
                for p in range(NUM_PARTITIONS):
                    assert await client.max_transaction_id(SESSION, p) == 3
        finally:
            await node.aclose()

    asyncio.run(main())


def test_a_failed_syncfs_falls_back_and_fails_only_the_bad_files_partition(tmp_path: Path) -> None:
    async def main() -> None:
        fs = FaultyFileSystem()
        node = await start_node(tmp_path, fs)
        try:
            admin, client = await connected(node)
            async with admin, client:
                fs.fail_next_syncfs(1)  # a writeback error of some other file: every file's own is clean
                assert await append_round(client, 1) == [None] * NUM_PARTITIONS
                assert fs.failed_syncfs == 1
                assert node.group_sync.syncfs_failures == 1
                fs.fail_next_fsyncs(1, path_part=str(tmp_path / "storage" / "5") + os.sep)
                outcomes = await append_round(client, 2)
                assert fs.failed_syncfs >= 2
                assert fs.failed_fsyncs == 1
                for p, outcome in enumerate(outcomes):
                    if p == 5:
                        assert isinstance(outcome, StorageError)
                        assert "injected" in str(outcome)
                    else:
                        assert outcome is None, (p, outcome)
                        assert node.partitions[p].durable_max == 2
                broken = node.partitions[5].broken
                assert broken is not None
                assert broken.startswith("fsync failed")
                assert node.partitions[5].durable_max == 1
                calls = node.group_sync.syncfs_calls
                outcomes = await append_round(client, 3)  # syncfs again, the failed partition fail-stopped
                assert node.group_sync.syncfs_calls > calls
                assert isinstance(outcomes[5], StorageError)
                assert "fail-stopped" in str(outcomes[5])
                assert [o for p, o in enumerate(outcomes) if p != 5] == [None] * (NUM_PARTITIONS - 1)
        finally:
            await node.aclose()

    asyncio.run(main())


def test_syncfs_min_files_0_fdatasyncs_every_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        fs = FaultyFileSystem()
        with caplog.at_level(logging.INFO, logger="waltz.storage.node"):
            node = await start_node(tmp_path, fs, **{"storage.fsync.syncfsMinFiles": 0})
        assert "group commits: fdatasync per file: storage.fsync.syncfsMinFiles is 0" in caplog.text
        try:
            admin, client = await connected(node)
            async with admin, client:
                assert await append_round(client, 1) == [None] * NUM_PARTITIONS
                assert node.group_sync.syncfs_calls == 0
                assert fs.syncfs_calls == 0
        finally:
            await node.aclose()

    asyncio.run(main())
