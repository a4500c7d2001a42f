"""``waltz cluster accept-loss``: the way out when every replica is older than ZooKeeper's record.

After every disk of a partition was restored from snapshots, each replica's persisted session is older than
the one ZooKeeper records for it. Recovery classifies them all *restored*: unknown in the vote, so the vote
can never be decided, and the partition stays unserved. Nothing can say what was committed after the
snapshots; the operator must accept losing it. This tool makes that an explicit, named decision:

* the operator names the last transaction to keep, ``K``; the plan prints, per replica, what it holds and
  what it loses (and that whatever the cluster committed after the snapshots, above every copy, is lost too);
* it refuses when recovery can still settle on its own (the vote is decidable with ZooKeeper's record), when
  a replica cannot be read, when no replica holds ``K``, or when ``K`` is below a replica's persisted
  low-water marks (records up to those were committed: cutting them is beyond this tool);
* with ``yes`` it makes every replica hold exactly the source's ``0..K`` (the source: the replica of the
  newest session holding ``K``), offline, using the same copy and truncate path as ``recover-partition``;
  sets each replica's low-water mark to ``K`` with session ``S``, the highest session id ZooKeeper or any
  node has seen; writes ZooKeeper's partition metadata version-checked: session ``S``, every replica
  ``(S, UNRESOLVED)``; and brings the replicas back online.

It refuses while the partition's owner is a live server: a running recovery cuts restored replicas to their
clean points and would race the repair (the runbook stops the servers before the restored nodes start).
When the servers start again, the first recovery classifies every replica VOTING with max id ``K`` and
resolves ``K``: the partition is served again from ``K + 1``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

from kazoo.client import KazooClient

from waltz.cluster import store_metadata as sm
from waltz.cluster.partition_metadata import UNRESOLVED, PartitionMetadata, ReplicaState
from waltz.errors import ConfigError, WaltzError
from waltz.ops.recover import DEFAULT_BATCH_RECORDS, copy_records, repair_truncate
from waltz.ops.view import ClusterView
from waltz.server.store.interfaces import SessionInfo
from waltz.server.store.recovery import classify_replica
from waltz.server.store.voting import resolve_high_water_mark

__all__ = ["LossPlan", "ReplicaHeld", "apply_accept_loss", "plan_accept_loss"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaHeld:
    """One replica as its node reports it (not ZooKeeper's record of it)."""

    storage: str
    session_id: int
    fencing_session_id: int
    low_water_mark: int
    local_low_water_mark: int
    max_transaction_id: int
    damaged: bool = False
    """Its node found it lost records it held (``replicaDamaged``): never the source, never counted."""


@dataclass(frozen=True)
class LossPlan:
    partition: int
    keep_through: int
    metadata: PartitionMetadata
    version: int
    replicas: tuple[ReplicaHeld, ...]
    source: str
    session_id: int
    """The session every replica and ZooKeeper's record carry afterwards."""

    @property
    def target(self) -> PartitionMetadata:
        states = {r.storage: ReplicaState(r.storage, self.session_id, UNRESOLVED) for r in self.replicas}
        return PartitionMetadata(self.metadata.generation, self.session_id, states)

    def describe(self) -> list[str]:
        k = self.keep_through
        lines = [
            f"partition {self.partition}: ZooKeeper records session {self.metadata.session_id}; every "
            f"replica is older. Kept: transactions 0..{k} as {self.source} holds them. Lost: everything "
            f"above {k}, including whatever the cluster committed after the snapshots (no copy holds it, "
            "so its count is unknown)"
        ]
        for r in self.replicas:
            lost = max(0, r.max_transaction_id - k)
            lines.append(
                f"  {r.storage}{' (damaged)' if r.damaged else ''}: session {r.session_id}, low-water mark "
                f"{r.low_water_mark}, holds "
                f"0..{r.max_transaction_id}: "
                + (f"loses {k + 1}..{r.max_transaction_id} ({lost} records)" if lost else "loses nothing")
                + ("" if r.max_transaction_id >= k or r.storage == self.source else f", copies up to {k}")
            )
        lines.append(
            f"afterwards: every replica holds 0..{k} at session {self.session_id}; the partition is served "
            f"from {k + 1}"
        )
        return lines


async def _read(view: ClusterView, storage: str, partition: int, timeout_s: float) -> ReplicaHeld:
    try:
        async with asyncio.timeout(timeout_s), view.admin(storage) as admin:
            entry = json.loads(await admin.metrics_json()).get("partitions", {}).get(str(partition))
            if entry is None:
                raise ConfigError(f"{storage} does not hold partition {partition} (not assigned there)")
            return ReplicaHeld(
                storage,
                int(entry["sessionId"]),
                int(entry["fencingSessionId"]),
                int(entry["lowWaterMark"]),
                int(entry["localLowWaterMark"]),
                int(entry["maxTransactionId"]),
                bool(entry["replicaDamaged"]),
            )
    except (WaltzError, TimeoutError, OSError, KeyError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(
            f"cannot read replica {storage} of partition {partition} ({e!r}); every replica must answer"
        ) from None


async def plan_accept_loss(
    client: KazooClient, view: ClusterView, partition: int, keep_through: int, timeout_s: float = 10.0
) -> LossPlan:
    """Read ZooKeeper's record and every replica; the plan, or ConfigError naming why it is refused."""
    view.check_partition(partition)
    if keep_through < -1:
        raise ConfigError(f"--keep-through must be -1 or a transaction id, got {keep_through}")
    owner = view.info.assignment.owner_of(partition)
    live = {d.server_id: d for d in view.info.servers.values()}
    if owner is not None and owner in live:
        raise ConfigError(
            f"server {owner} ({live[owner].host}:{live[owner].port}) is live and owns partition {partition}: "
            "stop the servers first (their recovery cuts restored replicas and would race this repair)"
        )
    metadata, version = await asyncio.to_thread(sm.read_partition_metadata, client, view.info.root, partition)
    storages = view.replicas_of(partition)
    if not storages:
        raise ConfigError(f"partition {partition} has no replicas in ZooKeeper")
    seen = tuple(await asyncio.gather(*(_read(view, s, partition, timeout_s) for s in storages)))
    _refuse_if_recoverable(partition, metadata, seen)
    source = choose_source(partition, seen, keep_through)
    for r in seen:
        if keep_through < max(r.low_water_mark, r.local_low_water_mark):
            raise ConfigError(
                f"{r.storage}'s low-water marks for partition {partition} are ({r.low_water_mark}, "
                f"{r.local_low_water_mark}): transactions up to them were committed; keeping only "
                f"0..{keep_through} would cut them, which this tool does not do"
            )
    session_id = max([metadata.session_id, *(max(r.session_id, r.fencing_session_id) for r in seen)])
    return LossPlan(partition, keep_through, metadata, version, seen, source, session_id)


def choose_source(partition: int, seen: tuple[ReplicaHeld, ...], keep_through: int) -> str:
    """The replica of the newest session that holds ``keep_through`` and is not damaged (a damaged one lost
    records it held: copying it would spread the loss); ConfigError if there is none."""
    holders = [r for r in seen if r.max_transaction_id >= keep_through and not r.damaged]
    damaged = [r.storage for r in seen if r.damaged and r.max_transaction_id >= keep_through]
    if not holders and damaged:
        raise ConfigError(
            f"only damaged replicas of partition {partition} hold transaction {keep_through} "
            f"({', '.join(damaged)}: their nodes found they lost records they held): none can be the "
            "source; keep less, or repair them first"
        )
    if not holders:
        best = max(r.max_transaction_id for r in seen)
        raise ConfigError(
            f"no replica of partition {partition} holds transaction {keep_through} (the best holds up to "
            f"{best}): nothing above {best} can be kept"
        )
    return max(holders, key=lambda r: (r.session_id, r.max_transaction_id)).storage


def _refuse_if_recoverable(
    partition: int, metadata: PartitionMetadata, seen: tuple[ReplicaHeld, ...]
) -> None:
    """Accepting a loss is for a vote that can never be decided; anything else recovery settles itself."""
    if not metadata.replicas:
        raise ConfigError(f"partition {partition}'s metadata records no replicas: recovery starts it empty")
    known = []
    for r in seen:
        info = SessionInfo(r.session_id, r.low_water_mark, r.local_low_water_mark, r.damaged)
        c = classify_replica(metadata, r.storage, info, r.max_transaction_id)
        if c.counted:
            known.append(
                r.max_transaction_id if c.truncate_to is None else min(c.truncate_to, r.max_transaction_id)
            )
    decided = resolve_high_water_mark(known, len(metadata.replicas))
    if decided is not None:
        raise ConfigError(
            f"partition {partition} can recover without losing anything: recovery resolves {decided} from "
            "the replicas ZooKeeper trusts; nothing was changed"
        )


async def apply_accept_loss(
    client: KazooClient, view: ClusterView, plan: LossPlan, batch_records: int = DEFAULT_BATCH_RECORDS
) -> None:
    """Carry the plan out (see the module docstring). Replicas stay offline if anything fails; running it
    again (planned afresh) resumes."""
    p, k, s = plan.partition, plan.keep_through, plan.session_id
    by_name = {r.storage: r for r in plan.replicas}
    async with view.admin(plan.source) as src:
        for storage in [plan.source, *(r.storage for r in plan.replicas if r.storage != plan.source)]:
            r = by_name[storage]
            async with view.admin(storage) as admin, view.data(storage) as dst:
                await admin.set_available([p], False)
                current = r.max_transaction_id
                if storage != plan.source and current > r.low_water_mark:
                    # Above its clean point the replica may hold another session's tail: copy it again.
                    current = await dst.truncate(r.session_id, p, r.low_water_mark, offline=True)
                if current > k:
                    current = await repair_truncate(dst, r.session_id, p, k)
                floor = max(r.low_water_mark, r.local_low_water_mark)
                current = await copy_records(src, dst, r.session_id, p, current, k, floor, batch_records)
                await dst.set_low_water_mark(s, p, k, offline=True)
    await asyncio.to_thread(sm.write_partition_metadata, client, view.info.root, p, plan.target, plan.version)
    log.info(
        "partition %d: accepted the loss of every transaction above %d (kept as %s held them); every replica "
        "recorded at session %d (waltz cluster accept-loss)",
        p,
        k,
        plan.source,
        s,
    )
    for r in plan.replicas:
        async with view.admin(r.storage) as admin:
            await admin.set_available([p], True)
