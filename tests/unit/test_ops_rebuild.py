"""The plans of ``waltz cluster rebuild-metadata`` and ``accept-loss`` (pure parts): what they record and
what they refuse."""

from __future__ import annotations

import dataclasses
import uuid

import pytest

from waltz.cluster.partition_metadata import UNRESOLVED, PartitionMetadata, ReplicaState
from waltz.errors import ConfigError
from waltz.ops.accept_loss import LossPlan, ReplicaHeld, _refuse_if_recoverable, choose_source
from waltz.ops.rebuild import PHANTOM_SERVER_ID, NodeSeen, ReplicaSeen, parse_storage_arg, plan_rebuild
from waltz.server.store.recovery import ReplicaClass

KEY = uuid.UUID(int=7)


def replica(storage: str, session: int, lwm: int, max_id: int, generation: int = 3, **kw: int) -> ReplicaSeen:
    return ReplicaSeen(
        storage,
        session,
        kw.get("fencing", session),
        lwm,
        lwm,
        max_id,
        generation if max_id >= 0 else -1,
        kw.get("client", 5),
    )


def node(i: int, replicas: dict[int, ReplicaSeen], key: uuid.UUID = KEY, n: int = 2) -> NodeSeen:
    return NodeSeen(f"h{i}:9{i}", f"h{i}:8{i}", 0, key, n, replicas)


def three(p0: tuple[tuple[int, int, int], ...]) -> list[NodeSeen]:
    return [node(i, {0: replica(f"h{i}:8{i}", *p0[i])}) for i in range(3)]


def test_replicas_of_one_session_all_vote_and_generations_and_sessions_go_above_everything_stored() -> None:
    nodes = three(((4, 10, 50), (4, 10, 50), (4, 10, 48)))
    nodes[2].replicas[0] = replica("h2:82", 4, 10, 48, generation=7, fencing=9, client=12)
    plan = plan_rebuild("/c", "name", nodes)
    p0 = plan.partitions[0]
    assert p0.predicted == 50
    assert set(p0.classes.values()) == {ReplicaClass.VOTING}
    assert p0.metadata.session_id == 9  # the highest session any node has seen, fencing included
    assert {r.session_id for r in p0.metadata.replicas.values()} == {4}
    assert {r.closing_high_water_mark for r in p0.metadata.replicas.values()} == {UNRESOLVED}
    tree = plan.tree()
    assert tree.assignment is not None
    assert tree.assignment.servers == {PHANTOM_SERVER_ID: {0: 7}}
    assert tree.last_client_id == 12
    assert p0.metadata.generation == 7
    # Partition 1 has no replica anywhere: fresh metadata, unassigned.
    assert plan.partitions[1].metadata.replicas == {}
    assert tree.replicas.replicas == {"h0:80": [0], "h1:81": [0], "h2:82": [0]}
    assert tree.connections.admin_ports == {"h0:80": 90, "h1:81": 91, "h2:82": 92}


def test_a_replica_of_an_older_session_is_unknown_in_the_vote_never_a_vote_against() -> None:
    # h2 missed session 5; its tail above 10 may be a dirty one of session 4.
    plan = plan_rebuild("/c", "name", three(((5, 20, 60), (5, 20, 40), (4, 10, 55))))
    p0 = plan.partitions[0]
    assert p0.classes["h2:82"] is ReplicaClass.RESTORED
    assert p0.predicted is None  # 60 may be on h2 too: undecidable, not settled at 40
    assert any("recover-partition --partition 0 --source h0:80" in line for line in p0.describe())


def test_nodes_of_different_clusters_or_sizes_are_refused() -> None:
    with pytest.raises(ConfigError, match="disagree"):
        plan_rebuild("/c", "n", [node(0, {}), node(1, {}, key=uuid.UUID(int=8))])
    with pytest.raises(ConfigError, match="disagree"):
        plan_rebuild("/c", "n", [node(0, {}), node(1, {}, n=3)])


def test_records_without_any_session_are_refused() -> None:
    with pytest.raises(ConfigError, match="no replica has a store session"):
        plan_rebuild("/c", "n", three(((-1, -1, 3), (-1, -1, -1), (-1, -1, -1))))


def test_storage_arguments() -> None:
    assert parse_storage_arg("h:1") == ("h:1", 0)
    assert parse_storage_arg("h:1=2") == ("h:1", 2)
    for bad in ("h", "h:x", "h:1=x", "h:1=-1"):
        with pytest.raises(ConfigError):
            parse_storage_arg(bad)


# -- accept-loss (pure parts) --------------------------------------------------------------------------


def held(storage: str, session: int, lwm: int, max_id: int, *, damaged: bool = False) -> ReplicaHeld:
    return ReplicaHeld(storage, session, session, lwm, lwm, max_id, damaged)


def recorded(session: int, *storages: str, closing: int = UNRESOLVED) -> PartitionMetadata:
    return PartitionMetadata(2, session, {s: ReplicaState(s, session, closing) for s in storages})


def test_accept_loss_is_refused_while_recovery_can_settle_alone() -> None:
    meta = recorded(9, "a", "b", "c")
    # Two replicas of the recorded session: recovery decides; nothing needs to be lost.
    with pytest.raises(ConfigError, match="can recover without losing anything: recovery resolves 40"):
        _refuse_if_recoverable(0, meta, (held("a", 9, 10, 40), held("b", 9, 10, 40), held("c", 3, 5, 80)))
    with pytest.raises(ConfigError, match="records no replicas"):
        _refuse_if_recoverable(0, PartitionMetadata(), (held("a", 3, 5, 8),))
    # Every replica older than the record: the vote is never decided, so accepting a loss is the way out.
    _refuse_if_recoverable(0, meta, (held("a", 3, 5, 40), held("b", 3, 5, 38), held("c", 2, 5, 12)))


def test_accept_loss_target_records_every_replica_unresolved_at_one_session() -> None:
    meta = recorded(9, "a", "b")
    plan = LossPlan(0, 40, meta, 3, (held("a", 3, 5, 40), held("b", 3, 5, 45)), "a", 11)
    assert plan.target == PartitionMetadata(2, 11, {s: ReplicaState(s, 11, UNRESOLVED) for s in ("a", "b")})
    text = "\n".join(plan.describe())
    assert "b: session 3, low-water mark 5, holds 0..45: loses 41..45 (5 records)" in text
    assert "a: session 3, low-water mark 5, holds 0..40: loses nothing" in text


def test_a_damaged_replica_is_never_the_source_of_accept_loss() -> None:
    seen = (held("a", 3, 5, 40), held("b", 4, 5, 45, damaged=True))
    assert choose_source(0, seen, 40) == "a"  # b is of a newer session and holds more, but is damaged
    with pytest.raises(ConfigError, match=r"only damaged replicas of partition 0 hold transaction 42 \(b:"):
        choose_source(0, seen, 42)
    with pytest.raises(ConfigError, match="no replica of partition 0 holds transaction 50"):
        choose_source(0, seen, 50)
    plan = LossPlan(0, 40, recorded(9, "a", "b"), 3, seen, "a", 11)
    assert "b (damaged): session 4" in "\n".join(plan.describe())


def test_a_damaged_replica_does_not_count_in_accept_loss_or_rebuild_votes() -> None:
    meta = recorded(9, "a", "b", "c")
    # Two replicas of the recorded session would decide the vote; one of them damaged, it cannot.
    _refuse_if_recoverable(
        0, meta, (held("a", 9, 10, 40), held("b", 9, 10, 40, damaged=True), held("c", 3, 5, 8))
    )
    nodes = three(((4, 10, 50), (4, 10, 50), (4, 10, 48)))
    nodes[0].replicas[0] = dataclasses.replace(nodes[0].replicas[0], replica_damaged=True)
    p0 = plan_rebuild("/c", "name", nodes).partitions[0]
    assert p0.classes["h0:80"] is ReplicaClass.DAMAGED
    assert "h0:80: replica damaged, session 4, max transaction id 50 -> recovery classifies it damaged" in (
        "\n".join(p0.describe())
    )


def test_the_trim_point_is_the_highest_a_replica_recorded_and_goes_into_the_tree() -> None:
    nodes = three(((4, 10, 50), (4, 10, 50), (4, 10, 50)))
    for i, trim in enumerate((30, 40, 0)):  # one replica never told (0), one told later (40)
        nodes[i].replicas[0] = dataclasses.replace(nodes[i].replicas[0], trim_point=trim)
    plan = plan_rebuild("/c", "name", nodes)
    assert plan.partitions[0].trim_point == 40
    assert plan.partitions[1].trim_point == 0
    assert ", trim point 40" in plan.partitions[0].describe()[0]
    assert "trim point" not in plan.partitions[1].describe()[0]
    points = plan.tree().trim_points
    assert (points.of(0), points.of(1), set(points.entries)) == (40, 0, {0})
    untrimmed = plan_rebuild("/c", "name", three(((4, 10, 50), (4, 10, 50), (4, 10, 50))))
    assert untrimmed.tree().trim_points.entries == {}
