"""What ``waltz local status`` and ``waltz local up`` show: each process, each partition's owner, high-water
mark and replicas, as gathered from the cluster's record, the processes' ``/health`` and ``/metrics``,
ZooKeeper and the storage admin ports."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from waltz.cluster import store_metadata as sm
from waltz.cluster import zk as zkutil
from waltz.cluster.partition_metadata import UNRESOLVED
from waltz.errors import WaltzError
from waltz.local import configs, probe, procs
from waltz.local.state import LocalCluster, ProcessRecord
from waltz.server.storage_client import AdminClient


@dataclass
class PartitionStatus:
    partition: int
    owner: str = "-"
    generation: int = -1
    healthy: bool = False
    high_water_mark: int | None = None
    replicas: dict[str, str] = field(default_factory=dict)


@dataclass
class ProcessStatus:
    name: str
    pid: int | None
    running: bool
    ports: str
    detail: str = ""


@dataclass
class ClusterStatus:
    directory: Path
    processes: list[ProcessStatus]
    partitions: list[PartitionStatus]
    zookeeper_ok: bool
    errors: list[str] = field(default_factory=list)
    tls: bool = False

    @property
    def all_served(self) -> bool:
        return bool(self.partitions) and all(p.healthy for p in self.partitions)

    def to_json(self) -> dict[str, Any]:
        return {
            "directory": str(self.directory),
            "zookeeper_ok": self.zookeeper_ok,
            "tls": self.tls,
            "processes": [vars(p) for p in self.processes],
            "partitions": [vars(p) for p in self.partitions],
            "errors": self.errors,
        }


def status(directory: str | Path) -> ClusterStatus:
    """Processes, partition owners, high-water marks and replica states of the cluster in ``directory``."""
    cluster = LocalCluster.load(directory)
    rows: list[ProcessStatus] = []
    for rec in cluster.processes:
        alive = procs.is_alive(rec.process)
        if rec.kind == "zookeeper":
            ports = f"{'TLS ' if cluster.zk_tls else ''}client {rec.port}"
            if rec.quorum_port:
                ports += f", quorum {rec.quorum_port}, election {rec.election_port}"
            detail = rec.data_dir
        elif rec.kind == "storage":
            ports = f"data {rec.port}, admin {rec.admin_port}, http {rec.http_port}"
            detail = f"group {rec.group}, partitions {sm.format_ranges(rec.partitions) or '-'}"
        else:
            ports, detail = f"client {rec.port}, http {rec.http_port}", f"server id {rec.server_id}"
        rows.append(ProcessStatus(rec.name, rec.pid, alive, ports, detail))
    result = ClusterStatus(
        cluster.directory,
        rows,
        [PartitionStatus(p) for p in range(cluster.num_partitions)],
        zookeeper_ok=False,
        tls=cluster.tls,
    )
    by_id = {s.server_id: s for s in cluster.servers}
    hwm: dict[int, float] = {}
    healthy: set[int] = set()
    for rec in cluster.servers:
        if procs.is_alive(rec.process):
            healthy |= probe.served_partitions(rec.http_port)  # also refreshes the gauges read below
            hwm.update(probe.partition_gauges(rec.http_port, "waltz_server_high_water_mark"))
    # Why a process is unhealthy, in its own words (a partition that takes no appends, a failed task...).
    for rec in [*cluster.servers, *cluster.storages]:
        if rec.http_port and procs.is_alive(rec.process):
            result.errors.extend(f"{rec.name}: {problem}" for problem in probe.problems(rec.http_port))
    for p in result.partitions:
        p.healthy = p.partition in healthy
        if p.partition in hwm:
            p.high_water_mark = int(hwm[p.partition])
    if any(procs.is_alive(z.process) for z in cluster.zookeepers):
        try:
            _zk_status(cluster, result, by_id)
            result.zookeeper_ok = True
        except WaltzError as e:
            result.errors.append(f"ZooKeeper: {e}")
    else:
        result.errors.append("ZooKeeper is not running")
    try:
        asyncio.run(_storage_status(cluster, result))
    except WaltzError as e:
        result.errors.append(f"storage: {e}")
    return result


def _zk_status(cluster: LocalCluster, result: ClusterStatus, by_id: dict[int, ProcessRecord]) -> None:
    client = configs.zk_connect(cluster, 3_000)
    try:
        info = sm.describe_cluster(client, cluster.cluster_root)
    finally:
        zkutil.close(client)
    live = {d.server_id for d in info.servers.values()}
    for server_id, parts in info.assignment.servers.items():
        rec = by_id.get(server_id)
        name = rec.name if rec is not None else f"server id {server_id}"
        if server_id not in live:
            name += " (not live)"
        for pid, generation in parts.items():
            if 0 <= pid < len(result.partitions):
                result.partitions[pid].owner = name
                result.partitions[pid].generation = generation
    storage_names = {s.address: s.name for s in cluster.storages}
    for pid, meta in info.partitions.items():
        if not 0 <= pid < len(result.partitions):
            continue
        for storage, state in meta.replicas.items():
            closing = state.closing_high_water_mark
            shown = "open" if closing == UNRESOLVED else f"closed at {closing}"
            result.partitions[pid].replicas[storage_names.get(storage, storage)] = (
                f"session {state.session_id} {shown}"
            )


async def _storage_status(cluster: LocalCluster, result: ClusterStatus) -> None:
    live = [s for s in cluster.storages if procs.is_alive(s.process)]
    if not live:
        return
    key = await asyncio.to_thread(configs.cluster_key, cluster) if result.zookeeper_ok else None
    ssl = configs.admin_ssl(cluster)
    for rec in cluster.storages:
        if rec not in live:
            for p in rec.partitions:
                result.partitions[p].replicas.setdefault(rec.name, "")
                result.partitions[p].replicas[rec.name] = (
                    f"{result.partitions[p].replicas[rec.name]}; DOWN".lstrip("; ")
                )
            continue
        if key is None:
            continue
        try:
            async with asyncio.timeout(5):
                admin = await AdminClient.connect(
                    procs.LOOPBACK, rec.admin_port, key, cluster.num_partitions, ssl=ssl
                )
                async with admin:
                    data = json.loads(await admin.metrics_json())
        except (WaltzError, OSError, TimeoutError) as e:
            result.errors.append(f"{rec.name}: admin port did not answer: {e!r}")
            continue
        for pid_s, p in data.get("partitions", {}).items():
            pid = int(pid_s)
            if not 0 <= pid < len(result.partitions):
                continue
            prefix = result.partitions[pid].replicas.get(rec.name, "")
            state = (
                f"max id {p['maxTransactionId']}, lwm {p['lowWaterMark']}, "
                f"{'available' if p['available'] else 'UNAVAILABLE'}"
            )
            result.partitions[pid].replicas[rec.name] = f"{prefix}; {state}".lstrip("; ")


def _tls_line(cluster: LocalCluster) -> str:
    if not cluster.tls:
        return "TLS: off"
    return (
        f"TLS: mutual, on every storage, server and client link; CA and certificates in {cluster.tls_dir}\n"
        f"ZooKeeper: {'TLS only, client certificates required, and ' if cluster.zk_tls else ''}digest ACLs "
        f"(credentials in {cluster.tls_dir}); operator config: "
        f"{cluster.directory / configs.ADMIN_CONFIG_FILE}"
    )


def render_status(st: ClusterStatus) -> str:
    lines = [
        f"cluster in {st.directory} ({'mutual TLS' if st.tls else 'plain TCP'})",
        "",
        f"{'process':<11} {'pid':>8}  {'state':<8} ports / details",
    ]
    for p in st.processes:
        state = "running" if p.running else "DOWN"
        lines.append(
            f"{p.name:<11} {p.pid if p.pid is not None else '-':>8}  {state:<8} {p.ports}; {p.detail}"
        )
    lines += ["", f"{'partition':>9}  {'owner':<12} {'gen':>4} {'served':<7} {'hwm':>8}  replicas"]
    for part in st.partitions:
        hwm = "-" if part.high_water_mark is None else str(part.high_water_mark)
        gen = "-" if part.generation < 0 else str(part.generation)
        lines.append(
            f"{part.partition:>9}  {part.owner:<12} {gen:>4} {'yes' if part.healthy else 'NO':<7} {hwm:>8}"
        )
        for name, state in sorted(part.replicas.items()):
            lines.append(f"{'':>44}{name}: {state}")
    for err in st.errors:
        lines.append(f"warning: {err}")
    return "\n".join(lines)


def render_up(cluster: LocalCluster) -> str:
    lines = [f"{'process':<11} {'pid':>8}  {'port':>6} {'admin':>6} {'http':>6}  data / details"]
    for rec in cluster.processes:
        admin = str(rec.admin_port) if rec.admin_port else "-"
        http = str(rec.http_port) if rec.http_port else "-"
        if rec.kind == "storage":
            detail = f"{rec.data_dir} (group {rec.group}, partitions {sm.format_ranges(rec.partitions)})"
        elif rec.kind == "server":
            detail = f"server id {rec.server_id}"
        else:
            detail = rec.data_dir
        lines.append(f"{rec.name:<11} {rec.pid or '-':>8}  {rec.port:>6} {admin:>6} {http:>6}  {detail}")
    lines += [
        "",
        f"ZooKeeper: {cluster.zk_connect}, cluster root {cluster.cluster_root}, "
        f"{cluster.num_partitions} partitions, {cluster.groups} replica group(s)",
        _tls_line(cluster),
        f"client config: {cluster.client_config_path}",
        f"logs: {cluster.directory / 'logs'}",
        f"stop with: waltz local down --dir {cluster.directory}",
    ]
    return "\n".join(lines)
