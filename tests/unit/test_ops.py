"""The pure decisions of the repair tools (``waltz.ops``): how far a source replica may be copied, and how a
problem line reads. The tools themselves run against real processes in tests/integration/test_ops_tools.py."""

from __future__ import annotations

import pytest

from waltz.cluster.partition_metadata import UNRESOLVED, PartitionMetadata, ReplicaState
from waltz.cluster.trim_points import PendingTrim, TrimEntry, TrimPoints, TrimSource
from waltz.errors import ConfigError
from waltz.ops.checks import Problem, pending_trims
from waltz.ops.recover import copy_target
from waltz.protocol.storage import SessionInfo
from waltz.server.store.recovery import ReplicaClass

A, B = "h:1", "h:2"


def meta(**states: ReplicaState) -> PartitionMetadata:
    return PartitionMetadata(3, 7, {s.storage: s for s in states.values()})


def test_a_voting_source_is_copied_whole() -> None:
    m = meta(a=ReplicaState(A, 7, UNRESOLVED), b=ReplicaState(B, 7, UNRESOLVED))
    # Its records above its low-water mark are the last session's writes: copy them too.
    assert copy_target(m, A, SessionInfo(7, 100, 100), 250) == (250, ReplicaClass.VOTING)


def test_a_closed_source_is_copied_up_to_its_closing_mark() -> None:
    m = meta(a=ReplicaState(A, 6, 180), b=ReplicaState(B, 7, UNRESOLVED))
    assert copy_target(m, A, SessionInfo(6, 100, 100), 250) == (180, ReplicaClass.CLOSED)


def test_an_untrusted_source_is_copied_up_to_its_clean_point() -> None:
    m = meta(a=ReplicaState(A, -1, 120), b=ReplicaState(B, 7, UNRESOLVED))
    assert copy_target(m, A, SessionInfo(5, 90, 90), 250) == (90, ReplicaClass.UNTRUSTED)


@pytest.mark.parametrize(
    ("source", "info", "why"),
    [
        (A, SessionInfo(-1, -1, -1), "restored"),  # wiped: its session is older than ZooKeeper's record
        ("h:9", SessionInfo(7, 100, 100), "new"),  # not a replica ZooKeeper knows
    ],
)
def test_a_source_that_lost_data_is_refused_without_untrusted_source(
    source: str, info: SessionInfo, why: str
) -> None:
    m = meta(a=ReplicaState(A, 7, UNRESOLVED), b=ReplicaState(B, 7, UNRESOLVED))
    with pytest.raises(ConfigError, match=f"classifies it {why}"):
        copy_target(m, source, info, 300)
    assert copy_target(m, source, info, 300, untrusted_source=True)[0] == 300


def test_without_replica_states_the_whole_source_is_copied() -> None:
    assert copy_target(None, A, SessionInfo(-1, -1, -1), 40) == (40, None)
    assert copy_target(PartitionMetadata(), A, SessionInfo(-1, -1, -1), 40) == (40, None)


def test_problem_lines_name_their_partition() -> None:
    assert str(Problem(3, "no quorum")) == "partition 3: no quorum"
    assert str(Problem(None, "storage h:1: unreachable")) == "storage h:1: unreachable"
    assert sorted([Problem(2, "b"), Problem(1, "a")]) == [Problem(1, "a"), Problem(2, "b")]


def test_verify_names_each_pending_trim_until_its_time_comes() -> None:
    hour_ms = 3_600_000
    set_at = 1_800_000_000_000
    points = TrimPoints(
        {
            0: TrimEntry(0, 0, PendingTrim(300, set_at, set_at + hour_ms, TrimSource.OPERATOR)),
            1: TrimEntry(50, set_at),  # in force, nothing pending
            2: TrimEntry(10, 1, PendingTrim(40, set_at, set_at + 60_000, TrimSource.POLICY)),
        }
    )
    lines = pending_trims(points, range(4), set_at + 30_000)
    assert lines == [
        "pending trim: partition 0: trim point 0, pending 300 (set by an operator at 2027-01-15T08:00:00Z, "
        "takes effect at 2027-01-15T09:00:00Z, in 3570 s)",
        "pending trim: partition 2: trim point 10, pending 40 (set by the retention policy at "
        "2027-01-15T08:00:00Z, takes effect at 2027-01-15T08:01:00Z, in 30 s)",
    ]
    assert pending_trims(points, [1, 2], set_at + 30_000) == lines[1:]  # only the partitions asked about
    # Once its time has come a pending trim point is in force: nothing is pending any more.
    assert pending_trims(points, range(4), set_at + hour_ms) == []


def test_a_damaged_source_is_refused_whatever_the_flags() -> None:
    """A replica its node found damaged (it lost records it held) is what needs the repair, never a source:
    refused with or without ZooKeeper's record, and with --untrusted-source too."""
    m = meta(a=ReplicaState(A, 7, UNRESOLVED))
    damaged = SessionInfo(7, 100, 100, damaged=True)
    for metadata in (m, None, PartitionMetadata()):
        for untrusted in (False, True):
            with pytest.raises(ConfigError, match=f"source {A} holds a damaged replica"):
                copy_target(metadata, A, damaged, 250, untrusted_source=untrusted)
