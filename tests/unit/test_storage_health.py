"""A storage partition's health state: SERVING, FAIL_STOPPED (a failed write or fsync; it heals itself) and
FAILED (a bug in its worker; final until the node restarts), each with its reason, as /health reports it."""

from __future__ import annotations

import uuid
from pathlib import Path

from waltz.storage.config import StorageConfig
from waltz.storage.controlfile import ControlFile
from waltz.storage.node import StorageNode
from waltz.storage.worker import Health


def _node(tmp_path: Path) -> StorageNode:
    key = uuid.uuid4()
    config = StorageConfig.from_mapping(
        {
            "storage.directory": str(tmp_path),
            "storage.port": 1,
            "storage.admin.port": 2,
            "storage.cluster.key": str(key),
            "storage.cluster.numPartitions": 2,
        }
    )
    return StorageNode(config, ControlFile.open_or_create(str(tmp_path), key, 2))


def test_a_fail_stopped_partition_heals_but_a_failed_one_stays_failed(tmp_path: Path) -> None:
    node = _node(tmp_path)
    part = node.partitions[0]
    part.open_log()
    assert (part.health, part.problem, node.health()[0]) == (Health.SERVING, None, True)

    part._break("fsync failed: injected")
    assert part.health is Health.FAIL_STOPPED
    assert (part.broken, part.failed) == ("fsync failed: injected", None)
    part._break("write failed: a second one")  # the first reason stays
    assert part.problem == "fail-stopped: fsync failed: injected"
    healthy, body = node.health()
    assert not healthy
    assert body["partitions"] == {"0": "fail-stopped: fsync failed: injected"}

    part._next_heal_s = 0.0  # the heal interval has passed
    assert part._heal()
    assert (part.health, part.health_reason, node.health()[0]) == (Health.SERVING, None, True)

    part.fail("AppendRequest: RuntimeError('bug')")
    assert part.health is Health.FAILED
    part._break("fsync failed: later")  # a failed partition is not fail-stopped on top
    assert part._become(Health.SERVING, None) is False  # nor does it ever serve again
    assert (part.failed, part.broken) == ("AppendRequest: RuntimeError('bug')", None)
    assert node.health()[1]["partitions"] == {"0": "failed: AppendRequest: RuntimeError('bug')"}
    part.close_log()
