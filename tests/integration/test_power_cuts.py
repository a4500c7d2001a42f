"""Power cuts in the black-box fault suite (bench/faults/power.py), CI size: nothing acknowledged is lost.

Every storage node's directory and ZooKeeper's data directory are on powerfs (bench/faults/powerfs.py: a
file's data is durable only once the file is fsynced, a directory entry only once its parent directory is;
everything else is dropped at a cut). While three apps append, one storage node loses power twice and the
whole cluster (servers, storage nodes, ZooKeeper) once; then the suite's checks: every acknowledged
transaction in the log exactly once, ids dense, replicas identical, appends resumed on every partition.

The negative control runs the same with fsync a no-op on the storage nodes: the whole-cluster cut must then
be reported as acknowledged transactions lost, which shows the layer and the checks can fail. More cuts:
``make faults FAULT_ARGS="--kinds power-storage,power-cluster"`` (docs/faults.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from bench.faults.suite import Options, run_seed, schedule

pytestmark = [pytest.mark.integration, pytest.mark.fault, pytest.mark.slow]

SEED = 1
OPTS = Options(
    partitions=3,
    apps=3,
    kinds=("power-storage", "power-cluster", "power-storage"),
    each_kind_once=True,
    max_fault_s=3.0,
    gap_s=(2.0, 3.0),
    stuck_bound_s=40.0,
    catch_up_bound_s=30.0,
    run_bound_s=280.0,
)


def _run(opts: Options, directory: Path) -> tuple[bool, str, int]:
    lines: list[str] = []
    result = run_seed(SEED, opts, directory, report=lines.append)
    return result.ok, result.summary() + "\n" + "\n".join(lines), result.acked


@pytest.mark.timeout(300)
def test_no_acknowledged_transaction_is_lost_when_a_node_or_the_whole_cluster_loses_power(
    tmp_path: Path,
) -> None:
    kinds = sorted(f.kind for f in schedule(SEED, OPTS))
    assert kinds == ["power-cluster", "power-storage", "power-storage"]
    ok, summary, acked = _run(OPTS, tmp_path / "cluster")
    assert ok, summary
    assert acked > 100, summary


@pytest.mark.timeout(300)
def test_the_negative_control_with_fsync_a_no_op_loses_acknowledged_transactions(tmp_path: Path) -> None:
    opts = Options(
        partitions=3,
        apps=3,
        kinds=("power-cluster",),
        each_kind_once=True,
        max_fault_s=2.0,
        stuck_bound_s=20.0,
        catch_up_bound_s=5.0,
        apps_grace_s=30.0,
        run_bound_s=280.0,
        fsync_noop=True,
    )
    ok, summary, _ = _run(opts, tmp_path / "cluster")
    assert not ok, summary
    assert "acknowledged but not in the log" in summary, summary
