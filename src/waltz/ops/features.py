"""Show and raise the cluster's feature version (``waltz cluster features`` / ``raise-features``).

The feature version says which formats and messages the processes of a cluster may use
(:mod:`waltz.cluster.features`). Raising it is refused unless every process that may run in the cluster
supports the new version: every live server (its descriptor, and the feature range it registered beside it;
no registration means Waltz 0.1.0, feature version 1) and every storage node in the cluster's metadata (asked
on its admin port; a node that negotiates admin V0 is 0.1.0, and a node that cannot be reached refuses the
raise: it could come back with a release that does not support it). The write itself is version-checked, so
two operators raising at once cannot both succeed on a stale read.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from ssl import SSLContext

from kazoo.client import KazooClient

from waltz.cluster import features as ft
from waltz.cluster import store_metadata as sm
from waltz.config import host_port
from waltz.errors import FeatureVersionError, WaltzError
from waltz.server.storage_client import AdminClient

log = logging.getLogger(__name__)

__all__ = ["FeatureReport", "ProcessReport", "feature_report", "raise_features"]

NODE_TIMEOUT_MS = 3_000
"""Time allowed to reach one storage node's admin port."""


@dataclass(frozen=True)
class ProcessReport:
    """One process of the cluster and the feature versions it supports (None: could not tell)."""

    kind: str
    name: str
    software: str
    features: ft.FeatureRange | None
    problem: str = ""

    def line(self) -> str:
        supported = f"features {self.features}" if self.features is not None else "features unknown"
        tail = f": {self.problem}" if self.problem else ""
        return f"{self.kind} {self.name}: Waltz {self.software}, {supported}{tail}"


@dataclass(frozen=True)
class FeatureReport:
    """The cluster's feature version, its znode version, and every process's supported range."""

    feature_version: int
    znode_version: int
    processes: tuple[ProcessReport, ...]

    def blockers(self, target: int) -> list[ProcessReport]:
        """The processes that do not (or may not) support feature version ``target``."""
        return [p for p in self.processes if p.features is None or target not in p.features]


async def _storage_report(storage: str, admin_port: int | None, ssl: SSLContext | None) -> ProcessReport:
    if admin_port is None:
        return ProcessReport("storage", storage, "?", None, "ZooKeeper has no admin port for it")
    host, _ = host_port(storage)
    try:
        resp = await AdminClient.node_version(host, admin_port, connect_timeout_ms=NODE_TIMEOUT_MS, ssl=ssl)
    except (WaltzError, OSError, TimeoutError) as e:
        return ProcessReport(
            "storage", storage, "?", None, f"admin port {host}:{admin_port} unreachable: {e}"
        )
    if resp is None:
        return ProcessReport("storage", storage, "0.1.0", ft.RELEASE_0_1_0, "admin codec V0 only")
    return ProcessReport(
        "storage", storage, resp.software, ft.FeatureRange(resp.features_lo, resp.features_hi)
    )


def _server_reports(client: KazooClient, root: str) -> list[ProcessReport]:
    descriptors, _ = sm.read_server_descriptors(client, root)
    registered = ft.read_server_processes(client, root)
    out = []
    for d in sorted(descriptors.values(), key=lambda d: d.server_id):
        info = registered.get(str(d.server_id))
        name = f"{d.server_id} ({d.endpoint})"
        if info is None:
            out.append(ProcessReport("server", name, "0.1.0", ft.RELEASE_0_1_0, "no feature registration"))
        else:
            out.append(ProcessReport("server", name, info.software, info.features))
    return out


def feature_report(client: KazooClient, root: str, ssl: SSLContext | None = None) -> FeatureReport:
    """Read the feature version and ask every process what it supports (blocking: ZooKeeper, network)."""
    fv, znode_version = ft.read_feature_version(client, root)
    servers = _server_reports(client, root)
    info = sm.describe_cluster(client, root)
    storages = sorted(
        set(info.groups.groups) | set(info.replicas.replicas) | set(info.connections.admin_ports)
    )

    async def ask() -> list[ProcessReport]:
        return list(
            await asyncio.gather(
                *(_storage_report(s, info.connections.admin_ports.get(s), ssl) for s in storages)
            )
        )

    return FeatureReport(fv, znode_version, tuple(servers + asyncio.run(ask())))


def raise_features(
    client: KazooClient, root: str, target: int | None = None, ssl: SSLContext | None = None
) -> tuple[int, int]:
    """Raise the cluster's feature version to ``target`` (default: the highest this release knows);
    returns ``(old, new)``. Raises FeatureVersionError, naming every process that holds it back, if a
    process does not support ``target``; ConcurrentUpdateError if another raise won meanwhile."""
    report = feature_report(client, root, ssl)
    new = ft.SUPPORTED_FEATURES.hi if target is None else target
    old = report.feature_version
    if new not in ft.SUPPORTED_FEATURES:
        raise FeatureVersionError(
            f"feature version {new} is not one this Waltz knows (it supports {ft.SUPPORTED_FEATURES})"
        )
    if new < old:
        raise FeatureVersionError(
            f"the cluster's feature version is {old}; it is never lowered (formats of {old} may be in use)"
        )
    if new == old:
        return old, new
    blockers = report.blockers(new)
    if blockers:
        lines = "; ".join(b.line() for b in blockers)
        raise FeatureVersionError(
            f"cannot raise the feature version from {old} to {new}: {len(blockers)} process(es) do not "
            f"support it: {lines}. Upgrade (or start) them first"
        )
    ft.write_feature_version(client, root, new, report.znode_version)
    log.info("cluster %s: feature version raised from %d to %d", root, old, new)
    return old, new
