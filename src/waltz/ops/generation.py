"""``waltz cluster fix-generation``: bring a partition's metadata generation back to what the assignment says.

A partition's generation in ``<root>/store/partition/<id>`` is written only by the server the assignment
names, with the generation the assignment gave it; a server refuses a partition whose metadata is at a higher
generation than its own (that is how a moved partition's old owner is fenced). A write from anyone else (an
anonymous ZooKeeper client before ACLs, a bad restore, a typo) that put a generation no assignment handed out
leaves the partition unserved: its owner reports it (``metadataConflicts`` in ``/health``) and does not obey.
This tool is the repair path. It plans, then writes only when asked:

* The **target** generation is the one the assignment gives the partition's owner (or ``--to``).
* It never lowers the generation below one that was really used: not below the assignment's, and not below
  the generation stamped in the newest record any replica holds (a server only commits appends of its own
  generation, so that generation had an owner). Lowering below a used generation would let a fenced old
  owner write again.
* It never lowers the session id: the new metadata's session id is the highest of the metadata's and every
  session id a replica has persisted or been fenced with (read from each replica's admin port), so the next
  store session takes an id above every one a storage node has seen, and the storage nodes' session-id check
  (which trusts the metadata) does not refuse it.
* It refuses when a replica cannot be read (it cannot know what that replica saw), and when the metadata lists
  no replicas while a storage node holds records (the value was overwritten wholesale, not just its
  generation: reconstructing replica states is not something to guess).

The write is version-checked: if anything changed the metadata since it was read, nothing is written.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

from kazoo.client import KazooClient

from waltz.cluster import store_metadata as sm
from waltz.cluster.partition_metadata import PartitionMetadata
from waltz.errors import ConfigError, WaltzError
from waltz.ops.view import ClusterView

__all__ = ["GenerationFix", "ReplicaSeen", "apply_generation_fix", "plan_generation_fix"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaSeen:
    """What one replica of the partition has seen: session ids and the generation of its newest record."""

    storage: str
    session_id: int
    """The session id persisted in its control file."""
    fencing_session_id: int
    """The highest session id that reached it since it started (fences older ones)."""
    max_transaction_id: int
    newest_generation: int
    """The generation in the req id of its newest record (-1 if it holds none)."""


@dataclass(frozen=True)
class GenerationFix:
    """A planned change of one partition's metadata (see the module docstring)."""

    partition: int
    current: PartitionMetadata
    version: int
    """The metadata znode's version when read: the write is refused if it moved since."""
    assigned: int | None
    """The generation the assignment gives the partition's owner (None: no server has it)."""
    replicas: tuple[ReplicaSeen, ...]
    target: PartitionMetadata

    @property
    def changes(self) -> bool:
        return self.target != self.current

    def describe(self) -> list[str]:
        """What the fix changes and why it is safe, one line each."""
        cur, new = self.current, self.target
        lines = [
            f"partition {self.partition}: metadata generation {cur.generation}, session {cur.session_id}; "
            f"the assignment gives generation {'none' if self.assigned is None else self.assigned}"
        ]
        lines.extend(
            f"  replica {r.storage}: session {r.session_id} (fencing {r.fencing_session_id}), "
            f"max transaction id {r.max_transaction_id}, newest record's generation {r.newest_generation}"
            for r in self.replicas
        )
        if not self.changes:
            lines.append("nothing to change")
            return lines
        lines.append(
            f"change: generation {cur.generation} -> {new.generation}, session {cur.session_id} -> "
            f"{new.session_id} (replica states kept)"
        )
        return lines


async def _replica_seen(view: ClusterView, storage: str, partition: int, timeout_s: float) -> ReplicaSeen:
    try:
        async with asyncio.timeout(timeout_s), view.admin(storage) as admin:
            metrics = json.loads(await admin.metrics_json())
            entry = metrics.get("partitions", {}).get(str(partition))
            if entry is None:
                raise ConfigError(f"{storage} does not hold partition {partition} (not assigned there)")
            max_id = int(entry["maxTransactionId"])
            generation = -1
            if max_id >= 0:
                newest = await admin.read_records(partition, max_id, 1)
                if newest:
                    generation = newest[0].req_id.generation
            return ReplicaSeen(
                storage, int(entry["sessionId"]), int(entry["fencingSessionId"]), max_id, generation
            )
    except (WaltzError, TimeoutError, OSError, KeyError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(
            f"cannot read what replica {storage} of partition {partition} has seen ({e!r}); every replica "
            "must answer before the generation is changed"
        ) from None


async def plan_generation_fix(
    client: KazooClient, view: ClusterView, partition: int, to: int | None, timeout_s: float = 10.0
) -> GenerationFix:
    """Read the metadata, the assignment and every replica; return the fix, or raise ConfigError if the change
    asked for (or any change) would be unsafe. Blocking ZooKeeper reads run in a thread."""
    root = view.info.root
    view.check_partition(partition)
    current, version = await asyncio.to_thread(sm.read_partition_metadata, client, root, partition)
    assignment, _ = await asyncio.to_thread(sm.read_partition_assignment, client, root)
    assigned = assignment.generations().get(partition)
    storages = sorted(set(view.replicas_of(partition)) | set(current.replicas))
    seen = tuple(await asyncio.gather(*(_replica_seen(view, s, partition, timeout_s) for s in storages)))
    if not current.replicas and any(r.max_transaction_id >= 0 for r in seen):
        raise ConfigError(
            f"partition {partition}'s metadata lists no replicas but storage nodes hold its records: the "
            "value was overwritten, not only its generation; refusing to guess the replica states"
        )
    target_generation = to if to is not None else assigned
    if target_generation is None:
        raise ConfigError(f"no server is assigned partition {partition}; pass --to GENERATION")
    floor, why = -1, "nothing"
    if assigned is not None:
        floor, why = assigned, "the assignment's generation"
    for r in seen:
        if r.newest_generation > floor:
            floor, why = r.newest_generation, f"the generation of {r.storage}'s newest record"
    if target_generation < floor:
        raise ConfigError(
            f"refusing to set partition {partition}'s generation to {target_generation}: below {floor}, "
            f"{why} (a generation that was used; lowering below it would let a fenced owner write again)"
        )
    if target_generation > current.generation:
        raise ConfigError(
            f"partition {partition}'s metadata is at generation {current.generation}, below "
            f"{target_generation}: nothing to lower (its owner raises it when it opens a session)"
        )
    session_id = max([current.session_id, *(max(r.session_id, r.fencing_session_id) for r in seen)])
    target = PartitionMetadata(target_generation, session_id, current.replicas)
    return GenerationFix(partition, current, version, assigned, seen, target)


def apply_generation_fix(client: KazooClient, root: str, fix: GenerationFix) -> None:
    """Write the planned metadata if the znode is still at the version planned from (else
    ConcurrentUpdateError: plan again). Blocking (ZooKeeper). One INFO line says what changed."""
    if not fix.changes:
        return
    sm.write_partition_metadata(client, root, fix.partition, fix.target, fix.version)
    log.info(
        "partition %d: metadata generation %d -> %d, session %d -> %d (waltz cluster fix-generation)",
        fix.partition,
        fix.current.generation,
        fix.target.generation,
        fix.current.session_id,
        fix.target.session_id,
    )
