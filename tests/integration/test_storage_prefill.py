"""A real storage node with zero-filled segments (``storage.segment.preallocateBytes``): its newest segment
ends in zeros while it runs, the tools read it as they read any segment, a kill -9 in mid-stream loses
nothing acknowledged, and the restarted node serves every record, older segments cut to their last record."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.integration.storage_process import DEFAULT_KEY, StorageProcess, append_until_killed
from waltz.cli.disk import dump_segment, offline_max_transaction_id, verify_segment
from waltz.protocol.records import Record, ReqId
from waltz.server.storage_client import AdminClient, StorageClient
from waltz.storage.segment import data_file_name, parse_segment_name

NUM_PARTITIONS = 2
PREALLOCATE_BYTES = 64 * 1024
THRESHOLD_BYTES = 300_000  # several roll-overs in a few seconds of appends


def records(first: int, n: int, size: int = 200) -> list[Record]:
    return [
        Record.build(i, ReqId(9 << 32, i & 0xFFFFFFFF), i % 7, (f"{i}:".encode() * size)[:size])
        for i in range(first, first + n)
    ]


def segment_files(node: StorageProcess, partition: int) -> list[Path]:
    pdir = node.directory / str(partition)
    firsts = sorted(
        p[0] for p in map(parse_segment_name, (f.name for f in pdir.iterdir())) if p and p[1] == ".seg"
    )
    return [pdir / data_file_name(first) for first in firsts]


def logical_bytes(path: Path) -> int:
    meta = dump_segment(str(path), metadata=True)
    return int(next(line for line in meta if line.startswith("data bytes: ")).split(": ")[1])


@pytest.mark.timeout(90)
def test_zero_filled_segments_survive_kill_9_and_restart(tmp_path: Path) -> None:
    node = StorageProcess(
        tmp_path,
        num_partitions=NUM_PARTITIONS,
        config={
            "storage.segment.preallocateBytes": PREALLOCATE_BYTES,
            "storage.segment.size.threshold": THRESHOLD_BYTES,
        },
    )
    acked: set[int] = set()
    try:
        node.start()

        async def stream() -> None:
            admin = await AdminClient.connect("127.0.0.1", node.admin_port, DEFAULT_KEY, NUM_PARTITIONS)
            client = await StorageClient.connect("127.0.0.1", node.port, DEFAULT_KEY, NUM_PARTITIONS)
            async with admin:
                await admin.set_assigned([0], True)
            try:
                # First, appends one at a time: after each, the newest segment ends in zeros past its records.
                next_id = 0
                for _ in range(40):
                    await client.append(7, 0, records(next_id, 5))
                    acked.update(range(next_id, next_id + 5))
                    next_id += 5
                newest = segment_files(node, 0)[-1]
                assert newest.stat().st_size > logical_bytes(newest)  # zeros after the records
                assert newest.read_bytes()[logical_bytes(newest) :].strip(b"\0") == b""
                assert verify_segment(str(newest)) == []
                assert offline_max_transaction_id(node.directory, 0) == next_id - 1
                # Then a stream with 32 appends in flight, killed in mid-stream.
                # (SIGKILL with appends in flight and zeros being written.)
                await append_until_killed(
                    client, node, next_id, records, in_flight=32, max_batch=9, kill_after_s=2.0, acked=acked
                )
            finally:
                await client.aclose()

        asyncio.run(stream())
        files = segment_files(node, 0)
        assert len(files) >= 3, "no roll-over happened before the kill"
        for path in files[:-1]:  # rolled over: cut to their last record, as without preallocation
            assert path.stat().st_size == logical_bytes(path)
            assert verify_segment(str(path)) == []
        assert offline_max_transaction_id(node.directory, 0) >= max(acked)

        node.restart()

        async def check() -> None:
            client = await StorageClient.connect("127.0.0.1", node.port, DEFAULT_KEY, NUM_PARTITIONS)
            async with client:
                max_id = await client.max_transaction_id(8, 0)
                assert max_id >= max(acked)
                got: list[Record] = []
                while len(got) <= max_id:
                    got += await client.read_records(8, 0, len(got), 1000)
                assert got == records(0, max_id + 1)  # dense, every record verified and the same
                # The log goes on, into freshly zero-filled space.
                await client.append(8, 0, records(max_id + 1, 3))
                await client.append(8, 0, records(max_id + 4, 3))
                assert await client.read_records(8, 0, max_id + 1, 10) == records(max_id + 1, 6)

        asyncio.run(check())
        newest = segment_files(node, 0)[-1]
        assert newest.stat().st_size > logical_bytes(newest)
        assert node.terminate() == 0
        # A clean stop closes the writable segment: cut to its last record.
        assert newest.stat().st_size == logical_bytes(newest)
        assert verify_segment(str(newest)) == []
    finally:
        node.stop()
