"""A real storage node process refuses to destroy or forget what it knows: a truncate below the persisted
low-water mark is refused unless an operator's repair asks for it, every truncation is one INFO line, and a
replica whose files were wiped (as a power cut that dropped its directory entry would) is reported damaged,
does not pass for an empty replica, and is repaired by catching up to a low-water mark set after the damage.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from waltz.errors import StorageError
from waltz.local.probe import http_get
from waltz.protocol.records import Record, ReqId
from waltz.server.storage_client import AdminClient, StorageClient

from .storage_process import DEFAULT_KEY, StorageProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

NUM_PARTITIONS = 2


def records(first: int, n: int) -> list[Record]:
    return [Record.build(i, ReqId(7, i), 0, f"r{i}".encode()) for i in range(first, first + n)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def health(node: StorageProcess) -> tuple[int, dict[str, Any]]:
    status, body = http_get(node.http_port, "/health")
    value: dict[str, Any] = json.loads(body)
    return status, value


@pytest.fixture
def node(tmp_path: Path) -> Iterator[StorageProcess]:
    proc = StorageProcess(tmp_path, num_partitions=NUM_PARTITIONS, config={"storage.http.port": _free_port()})
    try:
        proc.start()
        yield proc
    finally:
        proc.stop()


async def connect(node: StorageProcess) -> tuple[StorageClient, AdminClient]:
    admin = await AdminClient.connect("127.0.0.1", node.admin_port, DEFAULT_KEY, NUM_PARTITIONS)
    client = await StorageClient.connect("127.0.0.1", node.port, DEFAULT_KEY, NUM_PARTITIONS)
    return client, admin


def test_a_truncate_below_the_low_water_mark_is_refused_unless_an_operator_repairs(
    node: StorageProcess,
) -> None:
    async def go() -> None:
        client, admin = await connect(node)
        async with client, admin:
            await admin.set_assigned([0], True)
            await client.last_session_info(5, 0)
            await client.append(5, 0, records(0, 10))
            await client.set_low_water_mark(5, 0, 9)  # 0..9 committed
            await client.append(5, 0, records(10, 5))
            # Above the mark: allowed, and logged.
            assert await client.truncate(5, 0, 12) == 12
            # Below it: refused with a clear error, nothing cut (this is what truncated whole clusters to
            # empty after their ZooKeeper data was lost).
            with pytest.raises(StorageError, match="below its low-water mark 9"):
                await client.truncate(5, 0, 4)
            assert await client.max_transaction_id(5, 0) == 12
            info = await client.last_session_info(5, 0)
            assert (info.low_water_mark, info.local_low_water_mark) == (9, 9)
            # An operator's repair may, and the marks follow the log down.
            got = await client.truncate(5, 0, 4, operator_repair=True, reason="accept-loss by the operator")
            assert got == 4
            info = await client.last_session_info(5, 0)
            assert (info.low_water_mark, info.local_low_water_mark, info.damaged) == (4, 4, False)
        text = node.log_text()
        assert "partition 0 truncated from 14 to 12 (no reason given), asked by store session 5 from " in text
        assert "refusing to truncate partition 0 from 12 to 4: below its low-water mark 9" in text
        assert "(asked by store session 5 from 127.0.0.1:" in text
        assert "partition 0 truncated from 12 to 4 (accept-loss by the operator), asked by store" in text
        assert "an operator's repair below the low-water mark 9" in text

    asyncio.run(go())


def test_a_wiped_partition_directory_is_reported_kept_damaged_and_repaired(node: StorageProcess) -> None:
    async def fill() -> None:
        client, admin = await connect(node)
        async with client, admin:
            await admin.set_assigned([0, 1], True)
            # Partition 0 held 0..19, all of it under its low-water mark; partition 1 held 0..4 above a mark
            # of -1 (a new partition's first session): only its missing directory tells.
            await client.last_session_info(5, 0)
            await client.append(5, 0, records(0, 20))
            await client.set_low_water_mark(5, 0, 19)
            await client.last_session_info(5, 1)
            await client.set_low_water_mark(5, 1, -1)
            await client.append(5, 1, records(0, 5))

    asyncio.run(fill())
    assert health(node)[0] == 200
    node.terminate()
    # What a power cut that dropped the partition directories' entries leaves.
    shutil.rmtree(node.directory / "0")
    shutil.rmtree(node.directory / "1")
    node.restart()

    text = node.log_text()
    assert f"partition 0: this replica is damaged: its directory {node.directory / '0'} is missing" in text
    assert f"partition 1: this replica is damaged: its directory {node.directory / '1'} is missing" in text
    status, body = health(node)
    assert status == 503
    assert body["partitions"]["0"].startswith("replica damaged: its directory")
    # A restart does not forget it: the damage is in the control file, not in the missing directory.
    node.terminate()
    node.restart()
    assert "partition 0: this replica is damaged: it was found damaged before" in node.log_text()
    assert health(node)[0] == 503

    async def repair() -> None:
        client, admin = await connect(node)
        async with client, admin:
            info = await client.last_session_info(6, 0)
            assert info.damaged  # recovery does not count it in a vote
            # The admin port says so too: the operator tools refuse it as a copy source.
            assert (await admin.last_session_info(0)).damaged
            assert (info.session_id, info.low_water_mark, info.local_low_water_mark) == (5, 19, 19)
            assert json.loads(await admin.metrics_json())["partitions"]["0"]["replicaDamaged"]
            assert await client.max_transaction_id(6, 0) == -1
            # What a server's recovery does with it once the vote is resolved without it: set the low-water
            # mark, then copy the committed records. Only once it holds them is it repaired.
            await client.set_low_water_mark(6, 0, 19)
            assert (await client.last_session_info(6, 0)).damaged
            await client.append(6, 0, records(0, 20))
            info = await client.last_session_info(6, 0)
            assert not info.damaged
            assert not (await admin.last_session_info(0)).damaged
            assert (info.session_id, info.low_water_mark) == (6, 19)
            assert await client.read_records(6, 0, 0, 100) == records(0, 20)
            assert (await client.last_session_info(6, 1)).damaged
            await client.set_low_water_mark(6, 1, 4)
            await client.append(6, 1, records(0, 5))
            assert not (await client.last_session_info(6, 1)).damaged

    asyncio.run(repair())
    assert "partition 0: the damaged replica is repaired: it holds 0..19, at least its low-water mark 19" in (
        node.log_text()
    )
    assert health(node)[0] == 200
    node.terminate()
    node.restart()
    assert health(node)[0] == 200
