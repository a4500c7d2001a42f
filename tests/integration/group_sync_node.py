"""A storage node in this process on an injected file layer, with many partitions, for the group-sync tests
(``test_storage_group_sync.py``, ``test_storage_group_syncfs.py``): start it, connect to it, append one record
to every partition in one loop pass."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from tests.integration.storage_process import DEFAULT_KEY
from waltz.protocol.records import Record, ReqId
from waltz.server.storage_client import AdminClient, StorageClient
from waltz.storage.config import StorageConfig
from waltz.storage.node import StorageNode
from waltz.testing.faultfs import FaultyFileSystem

NUM_PARTITIONS = 16
SESSION = 1


async def start_node(tmp_path: Path, fs: FaultyFileSystem, **config: Any) -> StorageNode:
    """A node of ``NUM_PARTITIONS`` partitions in ``tmp_path / "storage"``; ``config``: more config keys."""
    values = {
        "storage.port": 0,
        "storage.admin.port": 0,
        "storage.directory": str(tmp_path / "storage"),
        "storage.cluster.key": str(DEFAULT_KEY),
        "storage.cluster.numPartitions": NUM_PARTITIONS,
        **config,
    }
    return await StorageNode.start(StorageConfig.from_mapping(values), DEFAULT_KEY, NUM_PARTITIONS, fs=fs)


def record(partition: int, i: int) -> Record:
    return Record.build(i, ReqId(1 << 32, partition << 32 | i), 0, os.urandom(100))


async def connected(node: StorageNode, *, first_appends: bool = True) -> tuple[AdminClient, StorageClient]:
    """Admin and data clients, every partition assigned; ``first_appends``: record 0 appended to each (its
    segment opened, zeros written ahead), so that later rounds measure appends alone."""
    admin = await AdminClient.connect("127.0.0.1", node.admin_port, DEFAULT_KEY, NUM_PARTITIONS)
    client = await StorageClient.connect(
        "127.0.0.1", node.port, DEFAULT_KEY, NUM_PARTITIONS, max_in_flight=4 * NUM_PARTITIONS
    )
    await admin.set_assigned(list(range(NUM_PARTITIONS)), True)
    if first_appends:
        for p in range(NUM_PARTITIONS):
            await client.append(SESSION, p, [record(p, 0)])
    return admin, client


async def append_round(client: StorageClient, i: int) -> list[BaseException | None]:
    """Record ``i`` to every partition, sent in one loop pass (the frames reach the node together); each
    partition's outcome, an exception or None."""
    return await asyncio.gather(
        *(client.append(SESSION, p, [record(p, i)]) for p in range(NUM_PARTITIONS)), return_exceptions=True
    )
