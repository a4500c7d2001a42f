"""``waltz cluster rebuild-metadata``: rebuild a cluster's lost ZooKeeper metadata from its storage nodes.

When ZooKeeper's data is lost, everything the log needs is still on the storage nodes: each control file
holds the cluster key, the partition count and, per partition, whether the node holds a replica, its last
store session id and its low-water mark; each replica's newest record carries the generation of the server
that wrote it. This tool reads all of that through the admin ports (the node identity request needs no
cluster key), plans the whole tree, prints the plan, and writes it only when asked (one ZooKeeper
transaction, refused if the root exists: an existing root is deleted first only with ``replace``).

What the plan writes, and why recovery then keeps every committed transaction:

* **Cluster and store params**: the operator's name, the nodes' key and partition count. Nodes that disagree
  on the key or the count are refused (they belong to different clusters).
* **Replica assignments, groups, admin ports**: a node holds a replica of every partition its control file
  marks assigned (or whose entry is damaged: it held one); groups are the operator's (default 0).
* **Partition metadata**: session id = the highest session id any replica persisted or was fenced with, so
  the next store session's id is above every one a node has seen (nodes refuse an id the metadata does not
  cover, and fence lower ones). Every replica is recorded ``(S, UNRESOLVED)`` with ``S`` the highest
  *persisted* session among the partition's replicas. Replicas of session ``S`` then vote with their max id
  (any transaction acknowledged in or before session ``S`` is on a quorum of them or below their low-water
  mark); replicas of an older session classify RESTORED: cut to their own clean point and counted as
  unknown, never as proof that something is absent (their tail may be a dirty one an older session left).
  Recording no replicas at all, as a fresh cluster does, would make recovery resolve -1 and truncate every
  replica to empty.
* **Generations**: the published assignment names the partition at the highest generation stamped in any
  replica's newest record (under server id 0, which is never handed out), so the first server takes the
  partition one generation above, and no new request id can equal a stored one. The client-id counter
  starts at the highest client id among those records.
* **Trim points**: each partition's is the highest trim point a replica recorded in its control file (every
  one came from ZooKeeper's, so none is above it), written to ``<root>/store/trim`` in the same transaction,
  so the servers refuse reads below it again. A replica whose log holds nothing at or above its trim point (it
  restarted there) has no newest record to read.

A partition whose vote the plan predicts undecidable (its replicas of session ``S`` alone cannot reach a
quorum) is named in the plan with the command that repairs it (``waltz storage recover-partition``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from ssl import SSLContext

from kazoo.client import KazooClient

from waltz.cluster import store_metadata as sm
from waltz.cluster.cluster_params import ClusterParams
from waltz.cluster.connection_metadata import ConnectionMetadata
from waltz.cluster.group_descriptor import GroupDescriptor
from waltz.cluster.partition_assignment import NOT_COMPUTED, PartitionAssignment
from waltz.cluster.partition_metadata import UNRESOLVED, PartitionMetadata, ReplicaState
from waltz.cluster.replica_assignments import ReplicaAssignments
from waltz.cluster.store_params import StoreParams
from waltz.cluster.trim_points import TrimEntry, TrimPoints
from waltz.cluster.zk import ClusterPaths, zk_errors
from waltz.config import host_port
from waltz.errors import ConfigError, WaltzError
from waltz.server.storage_client import AdminClient
from waltz.server.store.interfaces import SessionInfo
from waltz.server.store.recovery import ReplicaClass, classify_replica
from waltz.server.store.voting import resolve_high_water_mark

__all__ = [
    "NodeSeen",
    "PartitionPlan",
    "RebuildPlan",
    "ReplicaSeen",
    "apply_rebuild",
    "parse_storage_arg",
    "plan_rebuild",
    "read_nodes",
]

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_MS = 3_000
NODE_TIMEOUT_S = 30.0
"""Time allowed to read one node (identity, metrics, one record per partition)."""
PHANTOM_SERVER_ID = 0
"""The server id the rebuilt assignment files the used generations under; server ids start at 1."""


@dataclass(frozen=True)
class ReplicaSeen:
    """One partition on one node, as its control file and newest record say."""

    storage: str
    session_id: int
    fencing_session_id: int
    low_water_mark: int
    local_low_water_mark: int
    max_transaction_id: int
    newest_generation: int
    """The generation in the newest record's request id (-1: no record)."""
    newest_client_id: int
    damaged: bool = False
    """The control-file entry did not verify: the node held a replica but its state is unknown."""
    replica_damaged: bool = False
    """The node found the replica lost records it held (``replicaDamaged``): recovery does not count it."""
    trim_point: int = 0
    """The trim point in the replica's control file (``trimPoint``; 0 from a node that does not say)."""


@dataclass(frozen=True)
class NodeSeen:
    """One storage node: its addresses, the cluster it was made for, and its replicas."""

    admin: str
    storage: str
    """The data address ``host:port`` (the name ZooKeeper knows the node by)."""
    group: int
    cluster_key: uuid.UUID
    num_partitions: int
    replicas: dict[int, ReplicaSeen] = field(default_factory=dict)


@dataclass(frozen=True)
class PartitionPlan:
    partition: int
    replicas: tuple[ReplicaSeen, ...]
    metadata: PartitionMetadata
    generation: int
    """The highest generation stamped in a replica's newest record (the next owner takes one above)."""
    predicted: int | None
    """What the first recovery will resolve (None: undecidable until a replica is repaired)."""
    classes: dict[str, ReplicaClass]
    trim_point: int = 0
    """The highest trim point a replica recorded (0: never trimmed)."""

    def describe(self) -> list[str]:
        m = self.metadata
        if not self.replicas:
            return [f"partition {self.partition}: no replica on any node (left unassigned)"]
        lines = [
            f"partition {self.partition}: generation {self.generation}, session id {m.session_id}, "
            + (
                "no session yet"
                if not m.replicas
                else f"replicas recorded in session {next(iter(m.replicas.values())).session_id}"
            )
            + (f", trim point {self.trim_point}" if self.trim_point > 0 else "")
        ]
        for r in self.replicas:
            kind = self.classes.get(r.storage)
            lines.append(
                f"  {r.storage}: "
                + (
                    "control entry damaged"
                    if r.damaged
                    else f"replica damaged, session {r.session_id}, max transaction id {r.max_transaction_id}"
                    if r.replica_damaged
                    else f"session {r.session_id} (fencing {r.fencing_session_id}), low-water mark "
                    f"{r.low_water_mark}, max transaction id {r.max_transaction_id}"
                )
                + (f" -> recovery classifies it {kind.value}" if kind is not None else "")
            )
        sources = [r for r in self.replicas if not r.damaged and not r.replica_damaged]
        if self.predicted is None and sources:
            best = max(sources, key=lambda r: (r.session_id, r.max_transaction_id))
            lines.append(
                "  WARNING: the first recovery cannot decide the high-water mark: too few replicas of the "
                "newest session. Repair the others from the best copy, e.g. `waltz storage "
                f"recover-partition --partition {self.partition} --source {best.storage} --destination ...`"
            )
        elif self.predicted is None:
            lines.append(
                "  WARNING: the first recovery cannot decide the high-water mark, and every replica is "
                "damaged: no copy can be a recover-partition source (see `waltz cluster accept-loss`)"
            )
        elif m.replicas:
            lines.append(f"  recovery will resolve the high-water mark {self.predicted}")
        return lines


@dataclass(frozen=True)
class RebuildPlan:
    root: str
    params: ClusterParams
    store: StoreParams
    nodes: tuple[NodeSeen, ...]
    partitions: tuple[PartitionPlan, ...]
    last_client_id: int

    def describe(self) -> list[str]:
        lines = [
            f"rebuild {self.root}: cluster {self.params.name!r}, key {self.store.cluster_key}, "
            f"{self.store.num_partitions} partitions, client ids from {self.last_client_id + 1}"
        ]
        lines.extend(
            f"storage node {n.storage} (admin {n.admin}, group {n.group}): replicas of partitions "
            f"{sorted(n.replicas) or 'none'}"
            for n in self.nodes
        )
        for p in self.partitions:
            lines.extend(p.describe())
        return lines

    def tree(self) -> sm.ClusterTree:
        now_ms = int(time.time() * 1000)
        generations = {p.partition: p.generation for p in self.partitions if p.generation > 0}
        return sm.ClusterTree(
            params=self.params,
            store=self.store,
            partitions={p.partition: p.metadata for p in self.partitions},
            assignment=PartitionAssignment(
                NOT_COMPUTED,
                self.store.num_partitions,
                {PHANTOM_SERVER_ID: generations} if generations else {},
            ),
            replicas=ReplicaAssignments({n.storage: sorted(n.replicas) for n in self.nodes}),
            groups=GroupDescriptor({n.storage: n.group for n in self.nodes}),
            connections=ConnectionMetadata({n.storage: host_port(n.admin)[1] for n in self.nodes}),
            last_client_id=self.last_client_id,
            trim_points=TrimPoints(
                {p.partition: TrimEntry(p.trim_point, now_ms) for p in self.partitions if p.trim_point}
            ),
        )


def parse_storage_arg(text: str) -> tuple[str, int]:
    """``host:adminport`` or ``host:adminport=group`` -> (``host:adminport``, group)."""
    address, sep, group_s = text.partition("=")
    group = 0
    if sep:
        try:
            group = int(group_s)
        except ValueError:
            raise ConfigError(f"bad group in {text!r}: expected host:adminport=GROUP") from None
        if group < 0:
            raise ConfigError(f"bad group in {text!r}: must not be negative")
    host, port = host_port(address)
    return f"{host}:{port}", group


async def _read_node(admin: str, group: int, ssl: SSLContext | None) -> NodeSeen:
    host, port = host_port(admin)
    try:
        async with asyncio.timeout(NODE_TIMEOUT_S):
            ident = await AdminClient.identify(host, port, connect_timeout_ms=CONNECT_TIMEOUT_MS, ssl=ssl)
            storage = f"{host}:{ident.data_port}"
            client = await AdminClient.connect(
                host,
                port,
                ident.cluster_key,
                ident.num_partitions,
                connect_timeout_ms=CONNECT_TIMEOUT_MS,
                ssl=ssl,
            )
            async with client:
                metrics = json.loads(await client.metrics_json())
                replicas: dict[int, ReplicaSeen] = {}
                for pid_s, e in metrics.get("partitions", {}).items():
                    replicas[int(pid_s)] = await _replica(client, storage, int(pid_s), e)
                for pid_s in metrics.get("damagedControlEntries", {}):
                    replicas[int(pid_s)] = ReplicaSeen(storage, -1, -1, -1, -1, -1, -1, -1, damaged=True)
    except (WaltzError, TimeoutError, OSError, KeyError, ValueError, TypeError) as e:
        raise ConfigError(f"cannot read storage node at admin address {admin}: {e!r}") from None
    return NodeSeen(
        admin, storage, group, ident.cluster_key, ident.num_partitions, dict(sorted(replicas.items()))
    )


async def _replica(client: AdminClient, storage: str, partition: int, e: dict[str, object]) -> ReplicaSeen:
    max_id = int(str(e["maxTransactionId"]))
    trim_point = int(str(e.get("trimPoint", 0)))
    generation = client_id = -1
    if max_id >= max(0, trim_point):  # a log that restarted at its trim point may hold nothing readable
        newest = await client.read_records(partition, max_id, 1)
        if newest:
            generation, client_id = newest[0].req_id.generation, newest[0].req_id.client_id
    return ReplicaSeen(
        storage,
        int(str(e["sessionId"])),
        int(str(e["fencingSessionId"])),
        int(str(e["lowWaterMark"])),
        int(str(e["localLowWaterMark"])),
        max_id,
        generation,
        client_id,
        replica_damaged=bool(e.get("replicaDamaged")),
        trim_point=trim_point,
    )


async def read_nodes(storages: Sequence[tuple[str, int]], ssl: SSLContext | None = None) -> list[NodeSeen]:
    """Read every node (``(host:adminport, group)``); ConfigError naming the first that cannot be read."""
    if not storages:
        raise ConfigError("give every storage node of the cluster with --storage host:adminport")
    admins = [a for a, _ in storages]
    dup = sorted({a for a in admins if admins.count(a) > 1})
    if dup:
        raise ConfigError(f"storage node given twice: {', '.join(dup)}")
    return list(await asyncio.gather(*(_read_node(a, g, ssl) for a, g in storages)))


def _plan_partition(p: int, replicas: list[ReplicaSeen]) -> PartitionPlan:
    generation = max([0, *(r.newest_generation for r in replicas)])
    top = max([-1, *(max(r.session_id, r.fencing_session_id) for r in replicas)])
    newest = max([-1, *(r.session_id for r in replicas)])
    if newest < 0:
        holding = [r.storage for r in replicas if r.max_transaction_id >= 0]
        if holding:
            raise ConfigError(
                f"partition {p}: {', '.join(holding)} hold records but no replica has a store session: "
                "cannot tell which records were committed; refusing"
            )
        meta = PartitionMetadata(generation, top, {})
        return PartitionPlan(p, tuple(replicas), meta, generation, -1 if replicas else None, {})
    states = {r.storage: ReplicaState(r.storage, newest, UNRESOLVED) for r in replicas}
    meta = PartitionMetadata(generation, top, states)
    classes: dict[str, ReplicaClass] = {}
    known: list[int] = []
    for r in replicas:
        info = SessionInfo(r.session_id, r.low_water_mark, r.local_low_water_mark, r.replica_damaged)
        c = classify_replica(meta, r.storage, info, r.max_transaction_id)
        classes[r.storage] = c.kind
        if c.counted:
            known.append(
                r.max_transaction_id if c.truncate_to is None else min(c.truncate_to, r.max_transaction_id)
            )
    predicted = resolve_high_water_mark(known, len(replicas))
    trim_point = max([0, *(r.trim_point for r in replicas)])
    return PartitionPlan(p, tuple(replicas), meta, generation, predicted, classes, trim_point)


def plan_rebuild(root: str, name: str, nodes: Sequence[NodeSeen]) -> RebuildPlan:
    """The tree to write, from what the nodes hold; ConfigError where they disagree."""
    if not name:
        raise ConfigError("the cluster name must not be empty (--name)")
    if not nodes:
        raise ConfigError("no storage nodes given")
    first = nodes[0]
    for n in nodes[1:]:
        if n.cluster_key != first.cluster_key or n.num_partitions != first.num_partitions:
            raise ConfigError(
                f"storage nodes disagree: {first.admin} was made for cluster key {first.cluster_key} with "
                f"{first.num_partitions} partitions, {n.admin} for {n.cluster_key} with {n.num_partitions}; "
                "they are not one cluster (give only the nodes of the cluster to rebuild)"
            )
    storages = [n.storage for n in nodes]
    dup = sorted({s for s in storages if storages.count(s) > 1})
    if dup:
        raise ConfigError(f"two admin addresses lead to the same storage node {', '.join(dup)}")
    plans = [
        _plan_partition(p, [n.replicas[p] for n in nodes if p in n.replicas])
        for p in range(first.num_partitions)
    ]
    client_ids = [r.newest_client_id for n in nodes for r in n.replicas.values()]
    return RebuildPlan(
        root,
        ClusterParams(name, first.num_partitions),
        StoreParams(first.cluster_key, first.num_partitions),
        tuple(nodes),
        tuple(plans),
        max([0, *client_ids]),
    )


def apply_rebuild(client: KazooClient, plan: RebuildPlan, *, replace: bool = False) -> None:
    """Write the plan in one transaction. The root must not exist, unless ``replace`` (it is then deleted
    first). Blocking (ZooKeeper). One INFO line says what was written."""
    with zk_errors(f"rebuild cluster at {plan.root}"):
        exists = client.exists(plan.root) is not None
        if exists and not replace:
            raise ConfigError(
                f"{plan.root} exists in ZooKeeper: rebuilding would overwrite a cluster's metadata; check it "
                "is the broken one and give --replace to delete it first"
            )
        if exists:
            descriptors = ClusterPaths(plan.root).server_descriptors
            servers = client.get_children(descriptors) if client.exists(descriptors) else []
            if servers:
                raise ConfigError(
                    f"{len(servers)} server(s) are registered under {plan.root}: stop every server before "
                    "replacing the cluster's metadata"
                )
            client.delete(plan.root, recursive=True)
            log.info("deleted %s to rebuild it", plan.root)
    sm.write_cluster_tree(client, plan.root, plan.tree())
    log.info(
        "rebuilt %s from %d storage nodes: cluster key %s, %d partitions (waltz cluster rebuild-metadata)",
        plan.root,
        len(plan.nodes),
        plan.store.cluster_key,
        plan.store.num_partitions,
    )
