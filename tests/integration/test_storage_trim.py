"""Trimming on a real storage node process: the trim point persists, reads below it fail with TrimmedError,
the segments below it are deleted and the disk space comes back (``waltz_storage_disk_bytes``)."""

from __future__ import annotations

import asyncio
import os
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from waltz.errors import StorageError, TrimmedError
from waltz.protocol.records import Record, ReqId
from waltz.storage.segment import parse_segment_name

from .server_process import free_port
from .storage_process import StorageProcess

pytestmark = pytest.mark.integration

SESSION = 5


def records(first: int, n: int, size: int = 200) -> list[Record]:
    return [
        Record.build(i, ReqId(1, i), 0, (f"{i}:".encode() * size)[:size]) for i in range(first, first + n)
    ]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[StorageProcess]:
    config = {"storage.segment.size.threshold": 4096, "storage.http.port": free_port()}
    proc = StorageProcess(tmp_path, num_partitions=2, config=config)
    try:
        proc.start()
        yield proc
    finally:
        proc.stop()


def segment_first_ids(node: StorageProcess, partition_id: int) -> list[int]:
    names = os.listdir(node.directory / str(partition_id))
    return sorted({p[0] for p in map(parse_segment_name, names) if p is not None})


def disk_bytes(node: StorageProcess) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{node.http_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    line = next(x for x in text.splitlines() if x.startswith("waltz_storage_disk_bytes "))
    return float(line.split()[1])


async def wait_for(predicate: object, what: str, timeout_s: float = 20.0) -> None:
    """Poll a condition the node's background deletion makes true (it reports to no one outside)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


@pytest.mark.timeout(120)
def test_trim_persists_fails_reads_below_and_reclaims_the_disk(node: StorageProcess) -> None:
    batch = records(0, 200)

    async def fill() -> None:
        async with await node.admin_client() as admin, await node.data_client() as client:
            await admin.set_assigned([0], True)
            await client.last_session_info(SESSION, 0)
            for i in range(0, 200, 20):
                await client.append(SESSION, 0, batch[i : i + 20])
            await client.set_low_water_mark(SESSION, 0, 199)

    asyncio.run(fill())
    firsts = segment_first_ids(node, 0)
    assert len(firsts) > 5, firsts
    before_bytes = disk_bytes(node)

    async def trim() -> None:
        async with await node.data_client() as client:
            # Bad input: above what the replica holds; nothing changes.
            with pytest.raises(StorageError, match="trim point -1 is negative"):
                await client.trim(SESSION, 0, -1)
            assert await client.trim(SESSION, 0, 100) == 100
            assert await client.trim(SESSION, 0, 50) == 100  # lower: a no-op, answered with the one in force
            with pytest.raises(TrimmedError) as e:
                await client.read_record(SESSION, 0, 99)
            assert (e.value.partition_id, e.value.transaction_id, e.value.trim_point) == (0, 99, 100)
            assert not e.value.retriable
            with pytest.raises(TrimmedError):
                await client.read_records(SESSION, 0, 0, 10)
            with pytest.raises(TrimmedError):
                await client.read_run(SESSION, 0, 60, 10, 1 << 20)
            with pytest.raises(TrimmedError):
                await client.read_header(SESSION, 0, 0)
            assert await client.read_record(SESSION, 0, 100) == batch[100]
            assert await client.read_records(SESSION, 0, 100, 200) == batch[100:]
            kept = [f for f in firsts if f <= 100]
            await wait_for(lambda: segment_first_ids(node, 0)[0] == kept[-1], "the trimmed segments to go")
            # Appends go on as before.
            await client.append(SESSION, 0, records(200, 5))
            assert await client.max_transaction_id(SESSION, 0) == 204

    asyncio.run(trim())
    assert segment_first_ids(node, 0)[0] == max(f for f in firsts if f <= 100)
    assert disk_bytes(node) < before_bytes - 100 * 200 * 0.5

    node.stop()
    node.start()

    async def after_restart() -> None:
        async with await node.data_client() as client:
            await client.last_session_info(SESSION + 1, 0)
            with pytest.raises(TrimmedError, match="partition 0: transaction 0 is below the trim point 100"):
                await client.read_record(SESSION + 1, 0, 0)
            assert await client.read_record(SESSION + 1, 0, 150) == batch[150]
            assert await client.trim(SESSION + 1, 0, 0) == 100
            # A trim point above the replica's log (a lagging replica): the log restarts empty there.
            assert await client.trim(SESSION + 1, 0, 300) == 300
            assert await client.max_transaction_id(SESSION + 1, 0) == 299
            await client.append(SESSION + 1, 0, records(300, 3))
            assert await client.read_record(SESSION + 1, 0, 301) == records(300, 3)[1]
            with pytest.raises(TrimmedError):
                await client.read_record(SESSION + 1, 0, 204)
            await wait_for(lambda: segment_first_ids(node, 0) == [300], "the old segments to go")

    asyncio.run(after_restart())
    node.stop()
    node.start()  # the restarted log opens (its first segment is not at 0)

    async def after_second_restart() -> None:
        async with await node.data_client() as client:
            await client.last_session_info(SESSION + 2, 0)
            assert await client.max_transaction_id(SESSION + 2, 0) == 302
            assert await client.read_records(SESSION + 2, 0, 300, 10) == records(300, 3)

    asyncio.run(after_second_restart())


@pytest.mark.timeout(120)
def test_a_log_truncated_below_its_trim_point_restarts_when_told_it_again(node: StorageProcess) -> None:
    """A recovery may truncate a replica below its trim point (a segment straddling the trim point keeps ids
    below it); told the same trim point again (a catch-up source answered TrimmedError), it restarts there, so
    the catch-up goes on from the trim point instead of asking for trimmed ids forever."""

    async def run() -> None:
        async with await node.admin_client() as admin, await node.data_client() as client:
            await admin.set_assigned([1], True)
            await client.last_session_info(SESSION, 1)
            for i in range(0, 60, 20):
                await client.append(SESSION, 1, records(i, 20))
            assert await client.trim(SESSION, 1, 45) == 45
            max_id = await client.truncate(SESSION, 1, 2)
            assert max_id < 44, f"the test needs a log cut below the trim point, it holds up to {max_id}"
            assert await client.trim(SESSION, 1, 45) == 45
            assert await client.max_transaction_id(SESSION, 1) == 44
            await client.append(SESSION, 1, records(45, 2))
            assert await client.read_records(SESSION, 1, 45, 10) == records(45, 2)

    asyncio.run(run())
