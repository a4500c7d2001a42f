"""The cluster checks: ``waltz cluster verify``, ``waltz cluster check-connectivity``,
``waltz storage validate``, ``waltz storage sync-partitions``, and the guard of ``remove-partition -d``.

Every check compares ZooKeeper's metadata (:class:`~waltz.ops.view.ClusterView`) with what the storage nodes
and servers report, and returns :class:`Problem` lines rather than raising: an unreachable node is a finding,
not a failure of the tool. Each node is asked with a time limit, concurrently.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from waltz.cluster.partition_metadata import UNRESOLVED
from waltz.cluster.trim_points import TrimPoints, describe_entry
from waltz.errors import WaltzError
from waltz.ops.servers import ServerReport, server_report
from waltz.ops.view import ClusterView
from waltz.server.store.interfaces import SessionInfo
from waltz.server.store.recovery import ReplicaClass, classify_replica
from waltz.server.store.voting import quorum_of

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 10.0


@dataclass(frozen=True, order=True)
class Problem:
    """One finding; ``partition`` is None for node-level findings."""

    partition: int | None
    text: str

    def __str__(self) -> str:
        return self.text if self.partition is None else f"partition {self.partition}: {self.text}"


@dataclass(frozen=True)
class ReplicaReport:
    """What one storage node says about one partition."""

    assigned: bool
    available: bool
    session_id: int = -1
    low_water_mark: int = -1
    local_low_water_mark: int = -1
    max_transaction_id: int = -1
    damaged: str | None = None
    """Why the node found this replica damaged (it lost records it held), or None."""

    @property
    def info(self) -> SessionInfo:
        return SessionInfo(
            self.session_id, self.low_water_mark, self.local_low_water_mark, self.damaged is not None
        )


@dataclass
class StorageReport:
    """What one storage node says, or why it could not be asked."""

    storage: str
    error: str | None = None
    partitions: dict[int, ReplicaReport] = field(default_factory=dict)


async def _within(timeout_s: float, what: Awaitable[T]) -> T:
    async with asyncio.timeout(timeout_s):
        return await what


def _reason(e: BaseException) -> str:
    if isinstance(e, TimeoutError):
        return "no answer in time"
    return str(e) or type(e).__name__


async def storage_report(
    view: ClusterView, storage: str, timeout_s: float = DEFAULT_TIMEOUT_S
) -> StorageReport:
    """The node's partitions (assigned, available, control info, max id) through its admin port."""

    async def ask() -> StorageReport:
        async with view.admin(storage) as admin:
            data = json.loads(await admin.metrics_json())
            out: dict[int, ReplicaReport] = {}
            for pid, p in data.get("partitions", {}).items():
                out[int(pid)] = ReplicaReport(
                    True,
                    bool(p["available"]),
                    int(p["sessionId"]),
                    int(p["lowWaterMark"]),
                    int(p["localLowWaterMark"]),
                    int(p["maxTransactionId"]),
                    p.get("replicaDamaged"),
                )
            return StorageReport(storage, None, out)

    try:
        return await _within(timeout_s, ask())
    except (WaltzError, OSError, TimeoutError) as e:
        return StorageReport(storage, _reason(e))


async def storage_reports(
    view: ClusterView, storages: Iterable[str] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> dict[str, StorageReport]:
    names = list(view.storages if storages is None else storages)
    reports = await asyncio.gather(*(storage_report(view, s, timeout_s) for s in names))
    return dict(zip(names, reports, strict=True))


def replica_class(
    view: ClusterView, partition: int, storage: str, report: ReplicaReport
) -> ReplicaClass | None:
    """How the next store session would classify this replica (None: ZooKeeper has no replica states yet)."""
    metadata = view.metadata(partition)
    if metadata is None or not metadata.replicas:
        return None
    return classify_replica(metadata, storage, report.info, report.max_transaction_id).kind


def is_good_copy(view: ClusterView, partition: int, storage: str, report: StorageReport) -> bool:
    """Whether ``storage`` holds a copy of ``partition`` that recovery counts (reachable, assigned, and not
    restored or unknown to ZooKeeper)."""
    if report.error is not None:
        return False
    replica = report.partitions.get(partition)
    if replica is None:
        return False
    return replica_class(view, partition, storage, replica) not in (
        ReplicaClass.RESTORED,
        ReplicaClass.NEW,
        ReplicaClass.DAMAGED,
    )


# ---------------------------------------------------------------------------------- remove-partition -d guard


async def deletion_problems(
    view: ClusterView, storage: str, partitions: Iterable[int], timeout_s: float = DEFAULT_TIMEOUT_S
) -> list[Problem]:
    """Why deleting ``partitions`` on ``storage`` would leave one with fewer than a quorum of good copies
    (empty when it would not). A partition ZooKeeper never recorded a session for holds nothing to lose."""
    parts = [p for p in partitions if storage in view.replicas_of(p)]
    others = sorted({s for p in parts for s in view.replicas_of(p)} - {storage})
    reports = await storage_reports(view, others, timeout_s)
    problems = []
    for p in parts:
        metadata = view.metadata(p)
        if metadata is None or not metadata.replicas:
            continue
        replicas = view.replicas_of(p)
        good = [s for s in replicas if s != storage and is_good_copy(view, p, s, reports[s])]
        need = quorum_of(len(replicas))
        if len(good) < need:
            problems.append(
                Problem(
                    p,
                    f"deleting the copy on {storage} leaves {len(good)} good "
                    f"cop{'y' if len(good) == 1 else 'ies'} ({', '.join(good) or 'none'}) of {len(replicas)} "
                    f"replicas, fewer than the quorum of {need}",
                )
            )
    return problems


# -------------------------------------------------------------------------------------------- connectivity


@dataclass(frozen=True)
class ServerView:
    server_id: int
    address: str
    report: ServerReport | None
    error: str | None


async def server_views(view: ClusterView, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[ServerView]:
    """Every live server's report (owned partitions, health, storage connectivity), by server id."""
    servers = sorted(view.info.servers.values(), key=lambda d: d.server_id)

    async def one(server_id: int, address: str) -> ServerView:
        try:
            report = await _within(timeout_s, server_report(address, int(timeout_s * 1000), view.ssl))
        except (WaltzError, OSError, TimeoutError) as e:
            return ServerView(server_id, address, None, _reason(e))
        return ServerView(server_id, address, report, None)

    return list(await asyncio.gather(*(one(d.server_id, d.endpoint) for d in servers)))


async def check_connectivity(view: ClusterView, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[ServerView]:
    """Each live server's view of each storage node (it connects to every node ZooKeeper assigns)."""
    return await server_views(view, timeout_s)


# ---------------------------------------------------------------------------------------------- validate


@dataclass(frozen=True)
class PortCheck:
    storage: str
    port: str
    """``data`` or ``admin``."""
    address: str
    error: str | None


async def validate_storages(view: ClusterView, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[PortCheck]:
    """Open the data port and the admin port of every storage node in ZooKeeper with the cluster key."""

    async def data(storage: str) -> PortCheck:
        try:
            async with asyncio.timeout(timeout_s), view.data(storage):
                pass
        except (WaltzError, OSError, TimeoutError) as e:
            return PortCheck(storage, "data", storage, _reason(e))
        return PortCheck(storage, "data", storage, None)

    async def admin(storage: str) -> PortCheck:
        try:
            host, port = view.admin_address(storage)
        except WaltzError as e:
            return PortCheck(storage, "admin", "?", _reason(e))
        try:
            async with asyncio.timeout(timeout_s), view.admin(storage):
                pass
        except (WaltzError, OSError, TimeoutError) as e:
            return PortCheck(storage, "admin", f"{host}:{port}", _reason(e))
        return PortCheck(storage, "admin", f"{host}:{port}", None)

    checks = [c for s in view.storages for c in (data(s), admin(s))]
    return list(await asyncio.gather(*checks))


# ------------------------------------------------------------------------------------------ sync-partitions


@dataclass(frozen=True)
class SyncChange:
    storage: str
    added: tuple[int, ...]
    removed: tuple[int, ...]
    error: str | None = None


async def sync_partitions(
    view: ClusterView, *, dry_run: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S
) -> list[SyncChange]:
    """Make each storage node's assigned partitions equal ZooKeeper's assignment: assign the missing ones and
    unassign the extra ones (their files are kept; the node forgets their control info, as
    ``remove-partition`` without ``-d`` does). One change per node that differs (or could not be reached)."""

    async def one(storage: str) -> SyncChange | None:
        wanted = set(view.assigned_to(storage))
        try:
            async with asyncio.timeout(timeout_s), view.admin(storage) as admin:
                held = {s.partition_id for s in await admin.partition_statuses()}
                added, removed = sorted(wanted - held), sorted(held - wanted)
                if not dry_run:
                    if added:
                        await admin.set_assigned(added, True)
                    if removed:
                        await admin.set_assigned(removed, False)
        except (WaltzError, OSError, TimeoutError) as e:
            return SyncChange(storage, (), (), _reason(e))
        if not added and not removed:
            return None
        return SyncChange(storage, tuple(added), tuple(removed))

    results = await asyncio.gather(*(one(s) for s in view.storages))
    return [r for r in results if r is not None]


# ------------------------------------------------------------------------------------------------- verify


async def verify(
    view: ClusterView, partitions: Iterable[int] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> list[Problem]:
    """Every problem found, one per line (empty: the cluster is healthy). Checks, in order:

    1. ZooKeeper's assignments are valid: every partition has replicas, every replica's node has an admin
       port, every partition is owned by exactly one live server, and its metadata's generation is not above
       the one the assignment gives (only an anonymous or corrupt write puts it there);
    2. servers agree with ZooKeeper: each live server answers, owns the partitions ZooKeeper gives it, and
       reaches every storage node;
    3. storage nodes agree with ZooKeeper: each answers, holds exactly the partitions ZooKeeper assigns it,
       and holds them online;
    4. per partition, a quorum of its replicas is reachable and online, and each replica is recovered (not
       closed, restored or unknown in ZooKeeper's record of the last session);
    5. the owning server reports the partition healthy.
    """
    wanted = sorted(set(range(view.num_partitions) if partitions is None else partitions))
    for p in wanted:
        view.check_partition(p)
    problems: list[Problem] = []
    live = {d.server_id for d in view.info.servers.values()}
    owners = _zookeeper_problems(view, wanted, live, problems)
    servers, storages = await asyncio.gather(
        server_views(view, timeout_s), storage_reports(view, None, timeout_s)
    )
    health = _server_problems(view, servers, wanted, problems)
    _storage_problems(view, storages, wanted, problems)
    for p in wanted:
        _replica_problems(view, p, storages, problems)
        owner = owners.get(p, [])
        if len(owner) == 1 and owner[0] in live and p in health and not health[p]:
            problems.append(
                Problem(p, f"server {owner[0]} reports it unhealthy (its store session is not open)")
            )
    return problems


def pending_trims(points: TrimPoints, partitions: Iterable[int], now_ms: int) -> list[str]:
    """A line per partition of ``partitions`` whose trim point is pending at ``now_ms``: set, in its grace,
    nothing deleted for it yet (``waltz cluster trim -p N --cancel`` still stops it), worded as
    ``waltz cluster retention show`` words it. Not a :class:`Problem`: a grace is how a trim is meant to wait,
    but an operator checking the cluster should see what is about to be deleted."""
    return [
        f"pending trim: {describe_entry(p, points.entry(p), now_ms)}"
        for p in partitions
        if points.entry(p).settled(now_ms).pending is not None
    ]


def _zookeeper_problems(
    view: ClusterView, wanted: list[int], live: set[int], problems: list[Problem]
) -> dict[int, list[int]]:
    """Step 1 of :func:`verify`: ZooKeeper's own assignments. Returns the servers assigned each partition."""
    add = problems.append
    info = view.info
    for storage in view.storages:
        if storage not in info.connections.admin_ports:
            add(Problem(None, f"storage {storage}: ZooKeeper has no admin port for it"))
    owners: dict[int, list[int]] = {}
    for sid, parts in info.assignment.servers.items():
        for p in parts:
            owners.setdefault(p, []).append(sid)
    for p in wanted:
        if not view.replicas_of(p):
            add(Problem(p, "no storage node holds a replica in ZooKeeper"))
        owner = owners.get(p, [])
        if not owner:
            add(Problem(p, "no server is assigned it in ZooKeeper"))
        elif len(owner) > 1:
            add(Problem(p, f"several servers are assigned it in ZooKeeper: {owner}"))
        elif owner[0] not in live:
            add(Problem(p, f"its server {owner[0]} is not live"))
        metadata = view.metadata(p)
        assigned = info.assignment.servers.get(owner[0], {}).get(p) if len(owner) == 1 else None
        if metadata is not None and assigned is not None and metadata.generation > assigned:
            # Owners write the generation the assignment gave them, and assignments only raise it.
            add(
                Problem(
                    p,
                    f"its metadata is at generation {metadata.generation}, above the assignment's "
                    f"{assigned}: no owner wrote that (repair: `waltz cluster fix-generation`)",
                )
            )
    return owners


def _server_problems(
    view: ClusterView, servers: list[ServerView], wanted: list[int], problems: list[Problem]
) -> dict[int, bool]:
    """Step 2 of :func:`verify`: the servers against ZooKeeper. Returns the health each owner reports of the
    partitions ZooKeeper assigns it."""
    add = problems.append
    health: dict[int, bool] = {}
    for sv in servers:
        name = f"server {sv.server_id} ({sv.address})"
        if sv.report is None:
            add(Problem(None, f"{name}: unreachable: {sv.error}"))
            continue
        expected = {p for p in view.info.assignment.servers.get(sv.server_id, {}) if p in wanted}
        actual = {p for p in sv.report.partitions if p in wanted}
        for p in sorted(expected - actual):
            add(Problem(p, f"{name} is assigned it in ZooKeeper but does not serve it"))
        for p in sorted(actual - expected):
            add(Problem(p, f"{name} serves it but ZooKeeper assigns it elsewhere"))
        for storage, ok in sorted(sv.report.storage_connectivity.items()):
            if not ok:
                add(Problem(None, f"{name} cannot reach storage {storage}"))
        health.update({p: ok for p, ok in sv.report.health.items() if p in expected})
    return health


def _storage_problems(
    view: ClusterView, storages: dict[str, StorageReport], wanted: list[int], problems: list[Problem]
) -> None:
    """Step 3 of :func:`verify`: the storage nodes against ZooKeeper."""
    add = problems.append
    for storage, report in sorted(storages.items()):
        if report.error is not None:
            add(Problem(None, f"storage {storage}: unreachable: {report.error}"))
            continue
        zk_parts = {p for p in view.assigned_to(storage) if p in wanted}
        held = {p for p in report.partitions if p in wanted}
        for p in sorted(zk_parts - held):
            add(Problem(p, f"ZooKeeper assigns a replica to {storage}, which does not hold it"))
        for p in sorted(held - zk_parts):
            add(Problem(p, f"{storage} holds a replica ZooKeeper does not assign it"))
        for p in sorted(held & zk_parts):
            if not report.partitions[p].available:
                add(Problem(p, f"the replica on {storage} is offline"))


def _replica_problems(
    view: ClusterView, p: int, storages: dict[str, StorageReport], problems: list[Problem]
) -> None:
    """Step 4 of :func:`verify` for partition ``p``: each online replica's state, then the quorum."""
    replicas = view.replicas_of(p)
    if not replicas:
        return
    add = problems.append
    online = []
    restored: list[str] = []
    for storage in replicas:
        node = storages.get(storage)
        replica = None if node is None else node.partitions.get(p)
        if replica is None or not replica.available:
            continue
        online.append(storage)
        kind = replica_class(view, p, storage, replica)
        if replica.damaged is None and kind is ReplicaClass.RESTORED:
            restored.append(f"{storage} holds up to {replica.max_transaction_id}")
        problem = _replica_problem(view, p, storage, replica, kind)
        if problem is not None:
            add(Problem(p, problem))
    if restored and len(restored) == len(replicas):
        add(
            Problem(
                p,
                f"every replica is older than ZooKeeper's record ({'; '.join(restored)}): nothing to "
                "copy back; `waltz cluster accept-loss` keeps the best copy and loses what is above it",
            )
        )
    need = quorum_of(len(replicas))
    if len(online) < need:
        add(
            Problem(
                p,
                f"no quorum: {len(online)} of {len(replicas)} replicas reachable and online "
                f"({', '.join(online) or 'none'}), {need} needed",
            )
        )


def _replica_problem(
    view: ClusterView, p: int, storage: str, replica: ReplicaReport, kind: ReplicaClass | None
) -> str | None:
    """What is wrong with the online replica of partition ``p`` on ``storage`` (damaged, restored, not
    recovered), or None; ``kind`` is its :func:`replica_class`."""
    if replica.damaged is not None:
        return (
            f"the replica on {storage} is damaged ({replica.damaged}); it does not vote until "
            "repaired: the owning server's recovery catches it up, or copy it back with "
            "`waltz storage recover-partition`"
        )
    if kind is ReplicaClass.RESTORED:
        return (
            f"the replica on {storage} lost its data (session {replica.session_id}, max "
            f"transaction id {replica.max_transaction_id}, is older than ZooKeeper's record of "
            "it: wiped or restored); it cannot vote until copied back with "
            "`waltz storage recover-partition`"
        )
    metadata = view.metadata(p)
    if metadata is None or not metadata.replicas:
        return None
    state = metadata.replicas.get(storage)
    if state is None:
        return f"the replica on {storage} has not recovered yet (new in the replica set)"
    if state.closing_high_water_mark != UNRESOLVED:
        return (
            f"the replica on {storage} has not recovered since session {state.session_id} "
            f"(closed at {state.closing_high_water_mark})"
        )
    return None
