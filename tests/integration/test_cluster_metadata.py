"""Cluster metadata against a real ZooKeeper: every value round-trips, races lose with a retriable error."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable

import pytest
from kazoo.client import KazooClient

from waltz.cluster import features as ft
from waltz.cluster import store_metadata as sm
from waltz.cluster.counter import decode_counter, encode_counter
from waltz.cluster.partition_metadata import UNRESOLVED, PartitionMetadata, ReplicaState
from waltz.cluster.zk import ClusterPaths, compare_and_set
from waltz.errors import ClusterError, ClusterNotFoundError, ConcurrentUpdateError, MetadataError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

ROOT = "/waltz/c1"


@pytest.fixture
def cluster(zk: KazooClient) -> str:
    sm.create_cluster(zk, ROOT, "c1", 8, cluster_key=uuid.UUID(int=42))
    return ROOT


def test_create_writes_every_value(zk: KazooClient, cluster: str) -> None:
    assert sm.read_cluster_params(zk, cluster) == sm.ClusterParams("c1", 8)
    assert sm.read_store_params(zk, cluster) == sm.StoreParams(uuid.UUID(int=42), 8)
    assignment, stat = sm.read_partition_assignment(zk, cluster)
    assert assignment.cversion == -1
    assert assignment.servers == {}
    assert stat.cversion == 0
    assert sm.read_replica_assignments(zk, cluster).replicas == {}
    assert sm.read_group_descriptor(zk, cluster).groups == {}
    assert sm.read_connection_metadata(zk, cluster).admin_ports == {}
    for p in range(8):
        assert sm.read_partition_metadata(zk, cluster, p) == (PartitionMetadata(), 0)
    assert zk.exists(ClusterPaths(cluster).admin_lock) is not None


def test_create_twice_is_refused_and_changes_nothing(zk: KazooClient, cluster: str) -> None:
    with pytest.raises(ClusterError, match="already exists"):
        sm.create_cluster(zk, cluster, "other", 3)
    assert sm.read_cluster_params(zk, cluster).name == "c1"


def test_create_rejects_bad_arguments(zk: KazooClient) -> None:
    with pytest.raises(MetadataError):
        sm.create_cluster(zk, ROOT, "x", 0)
    with pytest.raises(MetadataError):
        sm.create_cluster(zk, ROOT, "", 1)
    with pytest.raises(ClusterError):
        sm.create_cluster(zk, "relative/root", "x", 1)
    assert zk.exists(ROOT) is None


def test_missing_cluster(zk: KazooClient) -> None:
    with pytest.raises(ClusterNotFoundError):
        sm.read_cluster_params(zk, "/nothing")
    with pytest.raises(ClusterNotFoundError):
        sm.read_store_params(zk, "/nothing")
    zk.ensure_path("/notacluster")
    with pytest.raises(ClusterNotFoundError):
        sm.read_cluster_params(zk, "/notacluster")
    with pytest.raises(ClusterNotFoundError):
        sm.delete_cluster(zk, "/nothing", "x")
    with pytest.raises(ClusterNotFoundError):
        sm.next_id(zk, "/nothing", "server")


def test_delete_checks_the_name_unless_forced(zk: KazooClient, cluster: str) -> None:
    with pytest.raises(MetadataError, match="named 'c1'"):
        sm.delete_cluster(zk, cluster, "c2")
    assert zk.exists(cluster) is not None
    sm.delete_cluster(zk, cluster, "c1")
    assert zk.exists(cluster) is None
    sm.create_cluster(zk, cluster, "c1", 2)
    sm.delete_cluster(zk, cluster, None, force=True)
    assert zk.exists(cluster) is None


def test_partition_metadata_round_trip_and_cas(zk: KazooClient, cluster: str) -> None:
    md, version = sm.read_partition_metadata(zk, cluster, 3)
    new = PartitionMetadata(
        2, 11, {"s:1": ReplicaState("s:1", 11, UNRESOLVED), "s:2": ReplicaState("s:2", 9, 40)}
    )
    v2 = sm.write_partition_metadata(zk, cluster, 3, new, version)
    assert sm.read_partition_metadata(zk, cluster, 3) == (new, v2)
    with pytest.raises(ConcurrentUpdateError) as info:
        sm.write_partition_metadata(zk, cluster, 3, md, version)
    assert info.value.retriable
    assert sm.read_partition_metadata(zk, cluster, 3)[0] == new


def test_concurrent_cas_writers_exactly_one_wins(
    zk_client_factory: Callable[..., KazooClient], cluster: str
) -> None:
    clients: list[KazooClient] = [zk_client_factory() for _ in range(4)]
    _, version = sm.read_partition_metadata(clients[0], cluster, 0)
    barrier = threading.Barrier(len(clients))
    outcomes: list[str] = []

    def writer(i: int, client: KazooClient) -> None:
        barrier.wait()
        try:
            sm.write_partition_metadata(client, cluster, 0, PartitionMetadata(i + 1, i, {}), version)
            outcomes.append(f"won:{i}")
        except ConcurrentUpdateError:
            outcomes.append("lost")

    threads = [threading.Thread(target=writer, args=(i, c)) for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    winners = [o for o in outcomes if o.startswith("won")]
    assert len(winners) == 1
    assert outcomes.count("lost") == len(clients) - 1
    winner = int(winners[0].split(":")[1])
    assert sm.read_partition_metadata(clients[0], cluster, 0)[0].generation == winner + 1


def test_compare_and_set_retries_a_lost_race(zk: KazooClient, cluster: str) -> None:
    path = ClusterPaths(cluster).client_ids
    calls = 0

    def bump(value: int) -> bytes:
        nonlocal calls
        calls += 1
        if calls == 1:
            zk.set(path, encode_counter(100))  # Someone else writes between our read and our write.
        return encode_counter(value + 1)

    assert compare_and_set(zk, path, decode_counter, bump, "counter") == 100
    assert decode_counter(zk.get(path)[0]) == 101
    assert calls == 2


def test_unique_ids_under_concurrency(zk_client_factory: Callable[..., KazooClient], cluster: str) -> None:
    clients: list[KazooClient] = [zk_client_factory() for _ in range(3)]
    ids: list[int] = []
    lock = threading.Lock()

    def take(client: KazooClient) -> None:
        for _ in range(10):
            i = sm.next_id(client, cluster, "client")
            with lock:
                ids.append(i)

    threads = [threading.Thread(target=take, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert sorted(ids) == list(range(1, 31))
    assert sm.next_id(clients[0], cluster, "server") == 1
    assert sm.next_id(clients[0], cluster, "server") == 2


def test_storage_node_editing(zk: KazooClient, cluster: str) -> None:
    sm.add_storage_node(zk, cluster, "s1:5000", 0, 5100)
    sm.add_storage_node(zk, cluster, "s2:5000", 0, 5200)
    sm.add_storage_node(zk, cluster, "s3:5000", 1, 5300)
    assert sm.read_group_descriptor(zk, cluster).groups == {"s1:5000": 0, "s2:5000": 0, "s3:5000": 1}
    assert sm.read_connection_metadata(zk, cluster).admin_ports == {
        "s1:5000": 5100,
        "s2:5000": 5200,
        "s3:5000": 5300,
    }
    with pytest.raises(MetadataError, match="already"):
        sm.add_storage_node(zk, cluster, "s1:5000", 1, 5999)

    sm.assign_partitions(zk, cluster, "s1:5000", range(8))
    sm.assign_partitions(zk, cluster, "s2:5000", [0, 1])
    assert sm.read_replica_assignments(zk, cluster).replicas["s1:5000"] == list(range(8))
    with pytest.raises(MetadataError, match="already assigned"):
        sm.assign_partitions(zk, cluster, "s2:5000", [1, 2])
    with pytest.raises(MetadataError, match="out of range"):
        sm.assign_partitions(zk, cluster, "s2:5000", [8])
    with pytest.raises(MetadataError, match="not in the cluster"):
        sm.assign_partitions(zk, cluster, "nope:1", [1])

    # Partitions 0-1 have a second copy in group 0; 2-7 do not.
    sm.unassign_partitions(zk, cluster, "s1:5000", [0, 1])
    with pytest.raises(MetadataError, match="last copy"):
        sm.unassign_partitions(zk, cluster, "s2:5000", [0])
    with pytest.raises(MetadataError, match="last copy"):
        sm.unassign_partitions(zk, cluster, "s1:5000", [2])
    with pytest.raises(MetadataError, match="not assigned"):
        sm.unassign_partitions(zk, cluster, "s1:5000", [0])
    with pytest.raises(MetadataError, match="still holds"):
        sm.remove_storage_node(zk, cluster, "s1:5000")

    assert sm.auto_assign(zk, cluster, 1) == {"s3:5000": list(range(8))}
    with pytest.raises(MetadataError, match="already has assignments"):
        sm.auto_assign(zk, cluster, 1)
    with pytest.raises(MetadataError, match="no storage nodes"):
        sm.auto_assign(zk, cluster, 7)

    sm.add_storage_node(zk, cluster, "s4:5000", 2, 5400)
    sm.remove_storage_node(zk, cluster, "s4:5000")
    with pytest.raises(MetadataError, match="not in the cluster"):
        sm.remove_storage_node(zk, cluster, "s4:5000")
    info = sm.describe_cluster(zk, cluster)
    assert info.groups.groups == {"s1:5000": 0, "s2:5000": 0, "s3:5000": 1}
    assert "s4:5000" not in info.replicas.replicas


def test_auto_assign_round_robin(zk: KazooClient, cluster: str) -> None:
    for i in range(3):
        sm.add_storage_node(zk, cluster, f"s{i}:1", 0, 2000 + i)
    assert sm.auto_assign(zk, cluster, 0) == {"s0:1": [0, 3, 6], "s1:1": [1, 4, 7], "s2:1": [2, 5]}


def test_store_edit_loses_to_a_concurrent_writer(
    zk: KazooClient, cluster: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Even a writer that bypasses the admin lock cannot be overwritten silently: the edit's transaction
    checks the versions it read."""
    real_snapshot = sm._snapshot

    def snapshot_then_interfere(client: KazooClient, paths: ClusterPaths) -> sm._StoreSnapshot:
        snap = real_snapshot(client, paths)
        client.set(paths.groups, sm.GroupDescriptor({"rogue:1": 3}).encode())
        return snap

    monkeypatch.setattr(sm, "_snapshot", snapshot_then_interfere)
    with pytest.raises(ConcurrentUpdateError):
        sm.add_storage_node(zk, cluster, "s1:5000", 0, 5100)
    monkeypatch.undo()
    assert sm.read_group_descriptor(zk, cluster).groups == {"rogue:1": 3}
    assert sm.read_connection_metadata(zk, cluster).admin_ports == {}


def test_admin_lock_serialises_edits(zk_client_factory: Callable[..., KazooClient], cluster: str) -> None:
    clients: list[KazooClient] = [zk_client_factory() for _ in range(4)]
    errors: list[BaseException] = []

    def add(i: int, client: KazooClient) -> None:
        try:
            sm.add_storage_node(client, cluster, f"n{i}:1", 0, 3000 + i)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=add, args=(i, c)) for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert errors == []
    assert sorted(sm.read_group_descriptor(clients[0], cluster).groups) == [f"n{i}:1" for i in range(4)]


def test_read_store_params_for_storage_nodes(zk: KazooClient, cluster: str) -> None:
    params = sm.read_store_params(zk, cluster)
    assert (params.cluster_key, params.num_partitions) == (uuid.UUID(int=42), 8)


def test_chroot_isolates_tests(zk: KazooClient, zk_chroot: str) -> None:
    assert zk.get_children("/") == []
    assert zk_chroot.startswith("/test-")


def test_a_new_cluster_starts_at_the_newest_feature_version_unless_told(zk: KazooClient) -> None:
    sm.create_cluster(zk, "/newest", "n", 1)
    assert ft.read_feature_version(zk, "/newest")[0] == ft.SUPPORTED_FEATURES.hi
    sm.create_cluster(zk, "/oldest", "o", 1, feature_version=1)
    assert ft.read_feature_version(zk, "/oldest") == (1, -1)  # no znode, as a cluster made by Waltz 0.1.0
    with pytest.raises(MetadataError, match="feature version must be between 1 and"):
        sm.create_cluster(zk, "/beyond", "b", 1, feature_version=ft.SUPPORTED_FEATURES.hi + 1)
    assert zk.exists("/beyond") is None
