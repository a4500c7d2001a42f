"""The last release and this checkout in one cluster (bench/faults/upgrade.py in CI size).

The release ``CHANGELOG.md`` names (found by its commit id, not its tag) is installed once into its own
virtual environment (``bench/faults/releases.py``; cached under ``$WALTZ_RELEASE_CACHE``, default
``~/.cache/waltz/releases``: the first run builds it in about half a minute with pip). A cluster of the
release
(3 storage nodes, 2 servers, 2 partitions) takes load from two application processes of the release; then,
one at a time, every storage node, every server and every application moves to this checkout, one storage
node and one server roll back to the release and up again, and ``raise-features`` (refused before the
upgrade) succeeds. Nothing acknowledged may be lost, every replica must match, and no step may leave the
applications without an acknowledgement for more than 1 s (``WALTZ_UPGRADE_MAX_STALL_S`` to loosen it on an
overloaded machine). The stall of every step is printed.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from bench.faults.releases import last_release, release_env
from bench.faults.upgrade import UpgradeOptions, run_upgrade_async

from waltz.cluster.features import SUPPORTED_FEATURES

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]


def test_rolling_upgrade_from_the_last_release_under_load_then_raise(tmp_path: Path) -> None:
    version, commit = last_release()
    old = release_env(version, commit)
    opts = UpgradeOptions(
        partitions=2,
        apps=2,
        max_stall_s=float(os.environ.get("WALTZ_UPGRADE_MAX_STALL_S", "1.0")),
        after_raise_s=3.0,
        run_bound_s=600.0,
    )
    result = asyncio.run(run_upgrade_async(opts, tmp_path / "run", old=old))
    for step in result.steps:
        print(step.line())
    assert result.problems == []
    assert result.ok
    assert "server" in result.refused_before
    assert f"Waltz {version}, features 1: admin codec V0 only" in result.refused_before
    assert result.raised == (1, SUPPORTED_FEATURES.hi)
    names = [s.name for s in result.steps]
    assert names[:3] == ["storage 0 -> new", "storage 1 -> new", "storage 2 -> new"]
    assert f"rollback: storage 0 -> {version}" in names
    assert f"rollback: server 0 -> {version}" in names
    assert names[-1] == "raise-features"
    assert result.acked > 0
    assert sum(result.log_records.values()) >= result.acked
    assert all(s.acks > 0 for s in result.steps), [s.line() for s in result.steps]
