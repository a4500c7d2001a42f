"""The data behind ``waltz top``: one snapshot of a running cluster, as an operator reads it.

:func:`gather` reads ZooKeeper (the partition assignment, the servers registered, the replica assignment,
storage admin ports) and asks every process what it knows, all at once and each within ``timeout_s``:

* each **server** in ZooKeeper, over its client port: the partitions it serves, whether each has an open
  store session, and each one's high-water mark;
* each **storage node**, over its admin port: for each partition it holds, its max transaction id and
  whether it is available.

It returns a :class:`TopSnapshot`: per partition its owner, generation, high-water mark, append rate (from
the previous snapshot, if given), the state and lag of each replica and one health word; per process whether
it answered. A process that does not answer in time is shown as down, never waited for: the view is refreshed
every second.

Health of a partition, worst first:

=========== ======================================================================================
unserved    no server owns it in ZooKeeper, or its owner did not answer or does not serve it
unhealthy   its owner serves it without an open store session (recovering, or no quorum): appends wait
degraded    open, but a replica is down, offline, unassigned on its node, or behind
ok          open, and every replica holds the high-water mark
=========== ======================================================================================

A replica's lag is ``high-water mark - its max transaction id`` (0 if it holds more: uncommitted writes in
flight). States: ``ok``, ``behind`` (lag > 0), ``offline`` (assigned but not available), ``unassigned``
(ZooKeeper assigns it, the node does not hold it), ``down`` (the node did not answer).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from ssl import SSLContext
from typing import Any, TypeVar

from kazoo.client import KazooClient

from waltz.cluster import store_metadata as sm
from waltz.config import host_port
from waltz.errors import RemoteProtocolError, WaltzError
from waltz.ops.servers import ADMIN_CLIENT_ID, admin_req_id, query
from waltz.protocol import client_server as cs
from waltz.protocol.records import ReqId
from waltz.server.storage_client import AdminClient

__all__ = ["PartitionRow", "ProcessRow", "ReplicaRow", "TopSnapshot", "gather"]

DEFAULT_TIMEOUT_S = 2.0

T = TypeVar("T")


@dataclass(frozen=True)
class ReplicaRow:
    storage: str
    state: str
    """ok, behind, offline, unassigned or down (see the module docstring)."""
    max_transaction_id: int
    """-1 when unknown."""
    lag: int
    """Committed transactions it does not hold; -1 when unknown."""


@dataclass(frozen=True)
class PartitionRow:
    partition: int
    owner: str
    """The owning server as ``id@host:port``, or "-"."""
    generation: int
    high_water_mark: int | None
    """None when unknown (no owner answered); -1 for an empty log."""
    append_rate: float | None
    """Transactions per second since the previous snapshot (None without one, or when unknown)."""
    health: str
    """unserved, unhealthy, degraded or ok (see the module docstring)."""
    replicas: tuple[ReplicaRow, ...]


@dataclass(frozen=True)
class ProcessRow:
    kind: str
    """server or storage."""
    address: str
    alive: bool
    detail: str


@dataclass(frozen=True)
class TopSnapshot:
    cluster: str
    root: str
    taken_s: float
    """``time.monotonic()`` when it was taken."""
    partitions: tuple[PartitionRow, ...]
    processes: tuple[ProcessRow, ...]

    @property
    def healthy(self) -> bool:
        return all(p.health == "ok" for p in self.partitions) and all(p.alive for p in self.processes)


@dataclass(frozen=True)
class _ServerAnswer:
    partitions: dict[int, bool]
    """Partition -> whether its store session is open."""
    high_water_marks: dict[int, int]


async def _within(timeout_s: float, what: Awaitable[T]) -> T | None:
    """``what``'s result, or None if it failed or took longer than ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            return await what
    except (WaltzError, OSError, TimeoutError):
        return None


async def _ask_server(address: str, ssl: SSLContext | None, timeout_s: float) -> _ServerAnswer:
    timeout_ms = int(timeout_s * 1000)
    (health,) = await query(
        address, [cs.ServerPartitionsHealthStatRequest(admin_req_id(1))], timeout_ms, ssl=ssl
    )
    if not isinstance(health, cs.ServerPartitionsHealthStatResponse):
        raise RemoteProtocolError(f"unexpected answer from {address}: {type(health).__name__}")
    served = dict(health.partition_health)
    # A server drops a high-water mark request for a partition it does not serve: ask only for its own.
    requests: list[cs.Message] = [
        cs.HighWaterMarkRequest(ReqId.of(ADMIN_CLIENT_ID, 0, pid, 2 + i))
        for i, pid in enumerate(sorted(served))
    ]
    answers = await query(address, requests, timeout_ms, ssl=ssl) if requests else []
    hwms = {
        a.req_id.partition_id: a.transaction_id for a in answers if isinstance(a, cs.HighWaterMarkResponse)
    }
    return _ServerAnswer(served, hwms)


async def _ask_storage(
    host: str, admin_port: int, key: Any, num_partitions: int, ssl: SSLContext | None, timeout_s: float
) -> dict[str, Any]:
    async with await AdminClient.connect(
        host, admin_port, key, num_partitions, ssl=ssl, connect_timeout_ms=int(timeout_s * 1000)
    ) as admin:
        data: dict[str, Any] = json.loads(await admin.metrics_json())
        return data


async def gather(
    zk_client: KazooClient,
    root: str,
    *,
    ssl: SSLContext | None = None,
    previous: TopSnapshot | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> TopSnapshot:
    """One snapshot of the cluster at ``root`` (see the module docstring); ``previous`` gives append rates.

    ZooKeeper is read in a thread (kazoo blocks); servers and storage nodes are asked concurrently, each
    within ``timeout_s``. Raises only for ZooKeeper problems (ClusterError), never for a process that is down.
    """
    info = await asyncio.to_thread(sm.describe_cluster, zk_client, root)
    taken_s = time.monotonic()
    servers = {d.server_id: f"{d.host}:{d.port}" for d in info.servers.values()}
    storages = sorted(
        set(info.replicas.replicas) | set(info.groups.groups) | set(info.connections.admin_ports)
    )
    server_answers, storage_answers = await _ask_all(info, servers, storages, ssl, timeout_s)
    rows = _partition_rows(info, servers, server_answers, storage_answers, previous, taken_s)
    processes = _process_rows(info, servers, server_answers, storage_answers)
    return TopSnapshot(info.params.name, root, taken_s, tuple(rows), tuple(processes))


async def _ask_all(
    info: sm.ClusterInfo,
    servers: dict[int, str],
    storages: list[str],
    ssl: SSLContext | None,
    timeout_s: float,
) -> tuple[dict[int, _ServerAnswer | None], dict[str, dict[str, Any] | None]]:
    """Every server's and storage node's answer (None for one that did not answer), asked concurrently: by
    server id in id order, by storage address in the order of ``storages``."""
    server_ids = sorted(servers)

    async def ask_node(storage: str) -> dict[str, Any] | None:
        admin_port = info.connections.admin_ports.get(storage)
        if admin_port is None:
            return None
        host, _ = host_port(storage)
        job = _ask_storage(
            host, admin_port, info.store.cluster_key, info.params.num_partitions, ssl, timeout_s
        )
        return await _within(timeout_s, job)

    server_jobs = asyncio.gather(
        *(_within(timeout_s, _ask_server(servers[s], ssl, timeout_s)) for s in server_ids)
    )
    storage_jobs = asyncio.gather(*(ask_node(s) for s in storages))
    server_list, storage_list = await asyncio.gather(server_jobs, storage_jobs)
    return dict(zip(server_ids, server_list, strict=True)), dict(zip(storages, storage_list, strict=True))


def _partition_rows(
    info: sm.ClusterInfo,
    servers: dict[int, str],
    server_answers: dict[int, _ServerAnswer | None],
    storage_answers: dict[str, dict[str, Any] | None],
    previous: TopSnapshot | None,
    taken_s: float,
) -> list[PartitionRow]:
    """One row per partition: its owner, high-water mark, append rate, health and replicas."""
    owners: dict[int, tuple[int, int]] = {}
    for server_id, parts in info.assignment.servers.items():
        for pid, generation in parts.items():
            owners[pid] = (server_id, generation)
    earlier = {p.partition: p for p in previous.partitions} if previous is not None else {}
    rows = []
    for pid in range(info.params.num_partitions):
        owner = owners.get(pid)
        answer = server_answers.get(owner[0]) if owner is not None else None
        served = answer is not None and pid in answer.partitions
        hwm = answer.high_water_marks.get(pid) if answer is not None and served else None
        replicas = [
            _replica(storage, pid, storage_answers.get(storage), hwm)
            for storage in sorted(s for s, parts in info.replicas.replicas.items() if pid in parts)
        ]
        if not served:
            health = "unserved"
        elif answer is not None and not answer.partitions[pid]:
            health = "unhealthy"
        elif any(r.state != "ok" for r in replicas):
            health = "degraded"
        else:
            health = "ok"
        rows.append(
            PartitionRow(
                partition=pid,
                owner=f"{owner[0]}@{servers.get(owner[0], '?')}" if owner is not None else "-",
                generation=owner[1]
                if owner is not None
                else info.partitions.get(pid, _NO_METADATA).generation,
                high_water_mark=hwm,
                append_rate=_append_rate(previous, earlier.get(pid), hwm, taken_s),
                health=health,
                replicas=tuple(replicas),
            )
        )
    return rows


def _append_rate(
    previous: TopSnapshot | None, before: PartitionRow | None, hwm: int | None, taken_s: float
) -> float | None:
    """Appends per second since ``previous`` (whose row of this partition is ``before``), or None."""
    if previous is None or before is None or hwm is None or before.high_water_mark is None:
        return None
    elapsed_s = taken_s - previous.taken_s
    if elapsed_s > 0 and hwm >= before.high_water_mark:
        return (hwm - before.high_water_mark) / elapsed_s
    return None


def _process_rows(
    info: sm.ClusterInfo,
    servers: dict[int, str],
    server_answers: dict[int, _ServerAnswer | None],
    storage_answers: dict[str, dict[str, Any] | None],
) -> list[ProcessRow]:
    """One row per server, then one per storage node, in the order of the answers."""
    processes = []
    for server_id, server_answer in server_answers.items():
        if server_answer is None:
            detail = "did not answer"
        else:
            served_ids = sorted(server_answer.partitions)
            detail = f"serves {sm.format_ranges(served_ids) if served_ids else 'no partitions'}"
        processes.append(
            ProcessRow("server", f"{server_id}@{servers[server_id]}", server_answer is not None, detail)
        )
    for storage, storage_answer in storage_answers.items():
        if storage_answer is None:
            reason = (
                "no admin port in ZooKeeper"
                if storage not in info.connections.admin_ports
                else "did not answer"
            )
            processes.append(ProcessRow("storage", storage, False, reason))
            continue
        held = storage_answer.get("partitions", {})
        available = sum(1 for p in held.values() if p.get("available"))
        processes.append(
            ProcessRow("storage", storage, True, f"{len(held)} partitions assigned, {available} available")
        )
    return processes


class _NoMetadata:
    generation = 0


_NO_METADATA = _NoMetadata()


def _replica(storage: str, pid: int, answer: dict[str, Any] | None, hwm: int | None) -> ReplicaRow:
    if answer is None:
        return ReplicaRow(storage, "down", -1, -1)
    held = answer.get("partitions", {}).get(str(pid))
    if held is None:
        return ReplicaRow(storage, "unassigned", -1, -1)
    max_id = int(held.get("maxTransactionId", -1))
    lag = max(0, hwm - max_id) if hwm is not None else -1
    if not held.get("available", False):
        return ReplicaRow(storage, "offline", max_id, lag)
    return ReplicaRow(storage, "behind" if lag > 0 else "ok", max_id, lag)
