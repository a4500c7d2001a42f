"""Creating, reading and editing a cluster's metadata in ZooKeeper (the library under ``waltz cluster``).

All functions are blocking and take a started kazoo client and the cluster root. Guarantees:

* ``create_cluster`` writes the whole layout in one ZooKeeper transaction: either the cluster exists
  complete, or nothing was written.
* Every edit of the store metadata (storage nodes, replica assignments) holds the cluster's admin lock
  (``<root>/store/adminLock``, a kazoo lock) *and* commits as one transaction that checks the versions of
  every znode it read, so even a writer that bypasses the lock cannot be silently overwritten: the loser gets
  :class:`~waltz.errors.ConcurrentUpdateError`.
* Refused edits (unknown node, partition out of range, last copy of a group...) raise
  :class:`~waltz.errors.MetadataError` and change nothing.
* Reading a root that holds no cluster raises :class:`~waltz.errors.ClusterNotFoundError`.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import LockTimeout, NoNodeError
from kazoo.security import ACL, Permissions

from waltz.cluster.cluster_params import ClusterParams
from waltz.cluster.connection_metadata import ConnectionMetadata
from waltz.cluster.counter import decode_counter, encode_counter
from waltz.cluster.features import BASE_FEATURE_VERSION, SUPPORTED_FEATURES, encode_features
from waltz.cluster.group_descriptor import GroupDescriptor
from waltz.cluster.partition_assignment import NOT_COMPUTED, PartitionAssignment
from waltz.cluster.partition_metadata import PartitionMetadata
from waltz.cluster.replica_assignments import ReplicaAssignments
from waltz.cluster.server_descriptor import ServerDescriptor
from waltz.cluster.store_params import StoreParams
from waltz.cluster.trim_points import TrimPoints
from waltz.cluster.zk import ClusterPaths, commit, compare_and_set, read_value, zk_errors
from waltz.errors import ClusterError, ClusterNotFoundError, ConcurrentUpdateError, MetadataError

MAX_PARTITIONS = 100_000
"""Upper bound on a cluster's partition count (each partition has a znode created in one transaction)."""
ADMIN_LOCK_TIMEOUT_S = 30.0
"""How long an edit waits for another admin's edit to finish before giving up."""


# --------------------------------------------------------------------------------------------------- create


def create_cluster(
    client: KazooClient,
    root: str,
    name: str,
    num_partitions: int,
    cluster_key: uuid.UUID | None = None,
    feature_version: int | None = None,
) -> StoreParams:
    """Create a cluster at ``root`` with a random cluster key; refuses if ``root`` already exists.

    The cluster starts at ``feature_version``, by default the newest this release supports: every process of
    a new cluster runs this release or a later one, so nothing holds its formats and messages back. An older
    one is for a cluster that processes of an older release will join (docs/upgrade.md)."""
    version = SUPPORTED_FEATURES.hi if feature_version is None else feature_version
    if not SUPPORTED_FEATURES.lo <= version <= SUPPORTED_FEATURES.hi:
        raise MetadataError(
            f"feature version must be between {SUPPORTED_FEATURES.lo} and {SUPPORTED_FEATURES.hi}, "
            f"got {version}"
        )
    if not name:
        raise MetadataError("the cluster name must not be empty")
    if not 0 < num_partitions <= MAX_PARTITIONS:
        raise MetadataError(
            f"number of partitions must be between 1 and {MAX_PARTITIONS}, got {num_partitions}"
        )
    store = StoreParams(cluster_key or uuid.uuid4(), num_partitions)
    # Feature version 1 is the znode's absence, as in a cluster made by Waltz 0.1.0.
    tree = ClusterTree(ClusterParams(name, num_partitions), store, feature_version=version)
    if version == BASE_FEATURE_VERSION:
        tree = dataclasses.replace(tree, feature_version=None)
    write_cluster_tree(client, root, tree)
    return store


@dataclass(frozen=True)
class ClusterTree:
    """Every value of a new cluster's tree. The defaults are a fresh cluster's; ``waltz cluster
    rebuild-metadata`` fills them from what the storage nodes hold."""

    params: ClusterParams
    store: StoreParams
    partitions: dict[int, PartitionMetadata] = field(default_factory=dict)
    """Per partition; a partition left out gets a fresh value (generation 0, session -1, no replicas)."""
    assignment: PartitionAssignment | None = None
    """None: not computed yet (no server ever owned a partition)."""
    replicas: ReplicaAssignments = field(default_factory=ReplicaAssignments)
    groups: GroupDescriptor = field(default_factory=GroupDescriptor)
    connections: ConnectionMetadata = field(default_factory=ConnectionMetadata)
    last_client_id: int = 0
    """The client-id counter's value: the next client takes ``last_client_id + 1``."""
    trim_points: TrimPoints = field(default_factory=TrimPoints)
    """``<root>/store/trim``, written only if a partition is listed (a fresh cluster has none)."""
    feature_version: int | None = None
    """``<root>/features``; None: not written (the cluster is at feature version 1, see
    :mod:`waltz.cluster.features`)."""


def write_cluster_tree(client: KazooClient, root: str, tree: ClusterTree) -> None:
    """Create ``root`` with every value of ``tree`` in one transaction; refuses if ``root`` exists."""
    paths = ClusterPaths(root)
    n = tree.params.num_partitions
    if not 0 < n <= MAX_PARTITIONS:
        raise MetadataError(f"number of partitions must be between 1 and {MAX_PARTITIONS}, got {n}")
    with zk_errors(f"create cluster at {root}"):
        if client.exists(root) is not None:
            raise ClusterError(f"{root} already exists; delete it first or choose another root")
        parent = root.rsplit("/", 1)[0]
        if parent:
            client.ensure_path(parent)
    assignment = tree.assignment or PartitionAssignment(NOT_COMPUTED, n, {})
    t = client.transaction()
    t.create(root, tree.params.encode())
    t.create(paths.server_descriptors, assignment.encode())
    t.create(paths.ids, b"")
    t.create(paths.client_ids, encode_counter(tree.last_client_id), acl=_client_ids_acl(client))
    t.create(paths.server_ids, encode_counter(0))
    t.create(paths.store, tree.store.encode())
    t.create(paths.partitions, b"")
    for p in range(n):
        t.create(paths.partition(p), tree.partitions.get(p, PartitionMetadata()).encode(p))
    t.create(paths.replica_assignments, tree.replicas.encode())
    t.create(paths.groups, tree.groups.encode())
    t.create(paths.connections, tree.connections.encode())
    t.create(paths.admin_lock, b"")
    if tree.feature_version is not None:
        t.create(paths.features, encode_features(tree.feature_version))
    if tree.trim_points.entries:
        t.create(paths.trim_points, tree.trim_points.encode())
    try:
        commit(t, f"create cluster at {root}")
    except ConcurrentUpdateError:
        raise ClusterError(f"{root} was created concurrently by someone else") from None


def _client_ids_acl(client: KazooClient) -> list[ACL] | None:
    """The client-id counter's ACL: the creator's, with the readers (application clients) also allowed to
    write, since every client takes its id there by compare-and-set. None: the client's default."""
    default: list[ACL] | None = client.default_acl
    if not default:
        return None
    return [
        ACL(Permissions.READ | Permissions.WRITE, a.id) if a.perms == Permissions.READ else a for a in default
    ]


def delete_cluster(client: KazooClient, root: str, name: str | None, *, force: bool = False) -> None:
    """Delete the cluster at ``root`` recursively. Unless ``force``, the root must hold a cluster named
    ``name`` (a guard against deleting the wrong cluster)."""
    ClusterPaths(root)
    with zk_errors(f"delete cluster at {root}"):
        if client.exists(root) is None:
            raise ClusterNotFoundError(f"no cluster at {root}")
    if not force:
        params = read_cluster_params(client, root)
        if params.name != name:
            raise MetadataError(f"the cluster at {root} is named {params.name!r}, not {name!r}")
    with zk_errors(f"delete cluster at {root}"):
        client.delete(root, recursive=True)


# ---------------------------------------------------------------------------------------------------- reads


def read_cluster_params(client: KazooClient, root: str) -> ClusterParams:
    """The name and partition count of the cluster at ``root`` (ClusterNotFoundError if there is none)."""
    ClusterPaths(root)
    try:
        with zk_errors(f"read cluster params at {root}"):
            raw, _ = client.get(root)
    except MetadataError:
        raise ClusterNotFoundError(f"no cluster at {root}") from None
    try:
        return ClusterParams.decode(raw)
    except MetadataError as e:
        raise ClusterNotFoundError(f"no cluster at {root} ({e})") from None


def read_store_params(client: KazooClient, root: str) -> StoreParams:
    """The cluster key and partition count a storage node must match (ClusterNotFoundError if none)."""
    paths = ClusterPaths(root)
    try:
        value, _ = read_value(client, paths.store, StoreParams.decode, f"store params at {paths.store}")
    except MetadataError as e:
        with zk_errors(f"store params at {paths.store}"):
            missing = client.exists(root) is None or client.exists(paths.store) is None
        if missing:
            raise ClusterNotFoundError(f"no cluster at {root}") from None
        raise e
    return value


def read_partition_assignment(client: KazooClient, root: str) -> tuple[PartitionAssignment, Any]:
    """The server assignment and the stat of ``serverDescriptors`` (its ``version`` and ``cversion``)."""
    paths = ClusterPaths(root)
    return read_value(client, paths.server_descriptors, PartitionAssignment.decode, "partition assignment")


def read_server_descriptors(client: KazooClient, root: str) -> tuple[dict[str, ServerDescriptor], int]:
    """Live servers' descriptors by znode name, and the ``cversion`` of the list they were read at."""
    paths = ClusterPaths(root)
    with zk_errors("server descriptors"):
        children, stat = client.get_children(paths.server_descriptors, include_data=True)
        out: dict[str, ServerDescriptor] = {}
        for child in sorted(children):
            try:
                raw, _ = client.get(f"{paths.server_descriptors}/{child}")
            except NoNodeError:
                continue  # The server left while we were reading; the next change event re-reads.
            out[child] = ServerDescriptor.decode(raw)
    return out, int(stat.cversion)


def read_replica_assignments(client: KazooClient, root: str) -> ReplicaAssignments:
    p = ClusterPaths(root).replica_assignments
    return read_value(client, p, ReplicaAssignments.decode, "replica assignments")[0]


def read_group_descriptor(client: KazooClient, root: str) -> GroupDescriptor:
    return read_value(client, ClusterPaths(root).groups, GroupDescriptor.decode, "group descriptor")[0]


def read_connection_metadata(client: KazooClient, root: str) -> ConnectionMetadata:
    p = ClusterPaths(root).connections
    return read_value(client, p, ConnectionMetadata.decode, "connection metadata")[0]


def read_partition_metadata(
    client: KazooClient, root: str, partition_id: int
) -> tuple[PartitionMetadata, int]:
    """A partition's store metadata and the znode version to pass to :func:`write_partition_metadata`."""
    path = ClusterPaths(root).partition(partition_id)
    value, stat = read_value(client, path, PartitionMetadata.decode, f"partition metadata {partition_id}")
    return value, int(stat.version)


def write_partition_metadata(
    client: KazooClient, root: str, partition_id: int, metadata: PartitionMetadata, expected_version: int
) -> int:
    """Replace a partition's metadata if its znode is still at ``expected_version``; returns the new version.

    Raises ConcurrentUpdateError if another writer got there first (re-read, re-decide, retry).
    """
    path = ClusterPaths(root).partition(partition_id)
    with zk_errors(f"partition metadata {partition_id}"):
        stat = client.set(path, metadata.encode(partition_id), version=expected_version)
    return int(stat.version)


@dataclass(frozen=True)
class ClusterInfo:
    """Everything ``waltz cluster list`` shows."""

    root: str
    params: ClusterParams
    store: StoreParams
    assignment: PartitionAssignment
    servers: dict[str, ServerDescriptor]
    replicas: ReplicaAssignments
    groups: GroupDescriptor
    connections: ConnectionMetadata
    partitions: dict[int, PartitionMetadata] = field(default_factory=dict)


def describe_cluster(client: KazooClient, root: str) -> ClusterInfo:
    params = read_cluster_params(client, root)
    assignment, _ = read_partition_assignment(client, root)
    servers, _ = read_server_descriptors(client, root)
    partitions: dict[int, PartitionMetadata] = {}
    for p in range(params.num_partitions):
        try:
            partitions[p] = read_partition_metadata(client, root, p)[0]
        except MetadataError:
            continue
    return ClusterInfo(
        root=root,
        params=params,
        store=read_store_params(client, root),
        assignment=assignment,
        servers=servers,
        replicas=read_replica_assignments(client, root),
        groups=read_group_descriptor(client, root),
        connections=read_connection_metadata(client, root),
        partitions=partitions,
    )


# ---------------------------------------------------------------------------------------------- id counters


def next_id(client: KazooClient, root: str, kind: str) -> int:
    """Take the next unique id of ``kind`` (``"client"`` or ``"server"``) with a compare-and-set loop."""
    paths = ClusterPaths(root)
    if kind not in ("client", "server"):
        raise ValueError(f"unknown id kind {kind!r}")
    path = paths.client_ids if kind == "client" else paths.server_ids
    with zk_errors(f"{kind} id counter"):
        exists = client.exists(root) is not None
    if not exists:
        raise ClusterNotFoundError(f"no cluster at {root}")
    seen = compare_and_set(
        client, path, decode_counter, lambda v: encode_counter(v + 1), f"{kind} id counter", max_attempts=100
    )
    if seen is None:  # Cannot happen: the update above always writes.
        raise MetadataError(f"{kind} id counter: nothing written")
    return seen + 1


# -------------------------------------------------------------------------------------------- store edits


@dataclass
class _StoreSnapshot:
    num_partitions: int
    replicas: dict[str, list[int]]
    groups: dict[str, int]
    connections: dict[str, int]
    versions: dict[str, int]


def _snapshot(client: KazooClient, paths: ClusterPaths) -> _StoreSnapshot:
    store, _ = read_value(client, paths.store, StoreParams.decode, "store params")
    ra, ra_stat = read_value(
        client, paths.replica_assignments, ReplicaAssignments.decode, "replica assignments"
    )
    gd, gd_stat = read_value(client, paths.groups, GroupDescriptor.decode, "group descriptor")
    cm, cm_stat = read_value(client, paths.connections, ConnectionMetadata.decode, "connection metadata")
    return _StoreSnapshot(
        num_partitions=store.num_partitions,
        replicas={s: list(p) for s, p in ra.replicas.items()},
        groups=dict(gd.groups),
        connections=dict(cm.admin_ports),
        versions={
            paths.replica_assignments: ra_stat.version,
            paths.groups: gd_stat.version,
            paths.connections: cm_stat.version,
        },
    )


def _write_snapshot(client: KazooClient, paths: ClusterPaths, snap: _StoreSnapshot, what: str) -> None:
    t = client.transaction()
    values = {
        paths.replica_assignments: ReplicaAssignments(snap.replicas).encode(),
        paths.groups: GroupDescriptor(snap.groups).encode(),
        paths.connections: ConnectionMetadata(snap.connections).encode(),
    }
    for path, data in values.items():
        t.set_data(path, data, version=snap.versions[path])
    commit(t, what)


def _edit_store(client: KazooClient, root: str, what: str, edit: Any) -> None:
    """Run ``edit(snapshot)`` under the admin lock and commit the snapshot with version checks."""
    paths = ClusterPaths(root)
    read_cluster_params(client, root)  # ClusterNotFoundError before anything else.
    lock = client.Lock(paths.admin_lock, what)
    try:
        with zk_errors(f"{what}: admin lock"):
            acquired = lock.acquire(timeout=ADMIN_LOCK_TIMEOUT_S)
    except LockTimeout:
        acquired = False
    if not acquired:
        raise ConcurrentUpdateError(f"{what}: another metadata edit holds the admin lock")
    try:
        snap = _snapshot(client, paths)
        edit(snap)
        _write_snapshot(client, paths, snap, what)
    finally:
        with zk_errors(f"{what}: admin lock"):
            lock.release()


def add_storage_node(client: KazooClient, root: str, storage: str, group: int, admin_port: int) -> None:
    """Register a storage node (``host:port`` of its data port) in ``group`` with its admin port."""
    if group < 0:
        raise MetadataError(f"group must be non-negative, got {group}")
    if not 0 < admin_port < 65536:
        raise MetadataError(f"admin port out of range: {admin_port}")

    def edit(snap: _StoreSnapshot) -> None:
        if storage in snap.groups or storage in snap.connections or storage in snap.replicas:
            raise MetadataError(f"storage node {storage} is already in the cluster")
        snap.groups[storage] = group
        snap.connections[storage] = admin_port
        snap.replicas[storage] = []

    _edit_store(client, root, f"add storage node {storage}", edit)


def remove_storage_node(client: KazooClient, root: str, storage: str) -> None:
    """Forget a storage node; refused while it still holds partitions."""

    def edit(snap: _StoreSnapshot) -> None:
        if storage not in snap.groups and storage not in snap.connections and storage not in snap.replicas:
            raise MetadataError(f"storage node {storage} is not in the cluster")
        held = snap.replicas.get(storage, [])
        if held:
            raise MetadataError(
                f"storage node {storage} still holds partitions {_ranges(held)}; unassign them first"
            )
        snap.groups.pop(storage, None)
        snap.connections.pop(storage, None)
        snap.replicas.pop(storage, None)

    _edit_store(client, root, f"remove storage node {storage}", edit)


def assign_partitions(client: KazooClient, root: str, storage: str, partitions: Iterable[int]) -> None:
    """Add replicas of ``partitions`` on ``storage`` (which must be registered); none may be there yet."""
    wanted = sorted(set(partitions))

    def edit(snap: _StoreSnapshot) -> None:
        _check_known(snap, storage)
        _check_range(snap, wanted)
        current = set(snap.replicas.get(storage, []))
        dup = sorted(current.intersection(wanted))
        if dup:
            raise MetadataError(f"partitions {_ranges(dup)} are already assigned to {storage}")
        snap.replicas[storage] = sorted(current.union(wanted))

    _edit_store(client, root, f"assign partitions to {storage}", edit)


def unassign_partitions(client: KazooClient, root: str, storage: str, partitions: Iterable[int]) -> None:
    """Remove replicas of ``partitions`` from ``storage``; refused if its group would lose its last copy."""
    wanted = sorted(set(partitions))

    def edit(snap: _StoreSnapshot) -> None:
        _check_known(snap, storage)
        _check_range(snap, wanted)
        current = set(snap.replicas.get(storage, []))
        missing = sorted(set(wanted) - current)
        if missing:
            raise MetadataError(f"partitions {_ranges(missing)} are not assigned to {storage}")
        group = snap.groups[storage]
        peers = [s for s, g in snap.groups.items() if g == group and s != storage]
        last = [p for p in wanted if not any(p in snap.replicas.get(s, []) for s in peers)]
        if last:
            raise MetadataError(
                f"refusing to unassign partitions {_ranges(last)} from {storage}: "
                f"it holds group {group}'s last copy of them"
            )
        snap.replicas[storage] = sorted(current - set(wanted))

    _edit_store(client, root, f"unassign partitions from {storage}", edit)


def auto_assign(client: KazooClient, root: str, group: int) -> dict[str, list[int]]:
    """Spread every partition round-robin over ``group``'s nodes (sorted by connect string).

    The group must have nodes and none of them may hold partitions yet. Returns the new assignment.
    """
    result: dict[str, list[int]] = {}

    def edit(snap: _StoreSnapshot) -> None:
        members = sorted(s for s, g in snap.groups.items() if g == group)
        if not members:
            raise MetadataError(f"group {group} has no storage nodes")
        busy = [s for s in members if snap.replicas.get(s)]
        if busy:
            raise MetadataError(f"group {group} already has assignments (on {', '.join(busy)})")
        for s in members:
            result[s] = []
        for p in range(snap.num_partitions):
            result[members[p % len(members)]].append(p)
        snap.replicas.update(result)

    _edit_store(client, root, f"auto-assign group {group}", edit)
    return result


def _check_known(snap: _StoreSnapshot, storage: str) -> None:
    if storage not in snap.groups:
        raise MetadataError(f"storage node {storage} is not in the cluster; add it with add-storage-node")


def _check_range(snap: _StoreSnapshot, partitions: list[int]) -> None:
    bad = [p for p in partitions if not 0 <= p < snap.num_partitions]
    if bad:
        raise MetadataError(f"partitions {_ranges(bad)} out of range: the cluster has {snap.num_partitions}")
    if not partitions:
        raise MetadataError("no partitions given")


def _ranges(ids: Iterable[int]) -> str:
    """``[0,1,2,5]`` -> ``"0-2,5"``."""
    out: list[str] = []
    items = sorted(set(ids))
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        out.append(str(items[i]) if i == j else f"{items[i]}-{items[j]}")
        i = j + 1
    return ",".join(out)


def format_ranges(ids: Iterable[int]) -> str:
    """Public form of the range formatter used in messages and ``waltz cluster list``."""
    return _ranges(ids)
