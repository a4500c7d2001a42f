"""What each process of a local cluster is told, and how the orchestrator reaches the cluster.

The configuration of every storage node, server, client and operator (``D/client.yaml``, ``D/admin.yaml``),
with the certificate of its role and its ZooKeeper identity when the cluster runs TLS (see
:mod:`waltz.local.cluster`), and the orchestrator's own ZooKeeper session and admin-port TLS context.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from ssl import SSLContext
from typing import Any

import yaml

from waltz.cluster import store_metadata as sm
from waltz.cluster import zk as zkutil
from waltz.cluster.files import write_durable
from waltz.cluster.zkserver import ServerTls
from waltz.local import procs
from waltz.local.state import LocalCluster, ProcessRecord
from waltz.tls import TlsConfig

TLS_NAMES = ("storage", "server", "client", "admin", "zookeeper")
"""One certificate per role in ``D/tls/``: ``<name>.pem`` and ``<name>-key.pem``, plus ``ca.pem``."""


STORAGE_PEERS = ("waltz server", "waltz admin")
"""Certificate common names (``waltz <role>``, see ``certs``) allowed on storage data and admin ports."""


ADMIN_CONFIG_FILE = "admin.yaml"


ZK_CLUSTER_AUTH = "zk-cluster.auth"


ZK_CLIENT_AUTH = "zk-client.auth"


def _zk_auth_files(cluster: LocalCluster) -> tuple[Path, Path] | None:
    """The cluster's and the applications' ZooKeeper credential files (only with TLS)."""
    if not cluster.tls:
        return None
    return cluster.tls_dir / ZK_CLUSTER_AUTH, cluster.tls_dir / ZK_CLIENT_AUTH


def make_zk_credentials(cluster: LocalCluster) -> None:
    files = _zk_auth_files(cluster)
    if files is None:
        return
    cluster.tls_dir.mkdir(parents=True, exist_ok=True)
    for path, user in zip(files, ("waltz", "client"), strict=True):
        path.touch(mode=0o600)
        path.chmod(0o600)
        path.write_text(f"{user}:{secrets.token_urlsafe(24)}\n", encoding="ascii")


def _zk_keys(cluster: LocalCluster, *, identity: str, cert: str) -> dict[str, Any]:
    """How a process reaches ZooKeeper: ``zookeeper.ssl.*`` with the certificate of role ``cert`` (when
    ZooKeeper serves TLS), ``zookeeper.authFile`` (and, for the cluster identity, ``aclReaders``); nothing
    without TLS."""
    files = _zk_auth_files(cluster)
    if files is None:
        return {}
    keys: dict[str, Any] = {}
    if cluster.zk_tls:
        keys["zookeeper.ssl.enabled"] = True
        keys.update(_tls_keys(cluster, zkutil.ZK_SSL_PREFIX, cert))
    cluster_file, client_file = files
    if identity == "client":
        return {**keys, "zookeeper.authFile": str(client_file)}
    reader = zkutil.digest_id(zkutil.read_auth_file(str(client_file)))
    return {**keys, "zookeeper.authFile": str(cluster_file), "zookeeper.aclReaders": reader}


def zk_connect(cluster: LocalCluster, connect_timeout_ms: int) -> Any:
    """The orchestrator's ZooKeeper session: the operator's certificate, the cluster identity (with TLS)."""
    keys = _zk_keys(cluster, identity="cluster", cert="admin")
    auth = zkutil.ZkAuth.from_config(keys, str(cluster.tls_dir)) if keys else None
    return zkutil.connect(
        cluster.zk_connect, session_timeout_ms=10_000, connect_timeout_ms=connect_timeout_ms, auth=auth
    )


def zk_server_tls(cluster: LocalCluster) -> ServerTls | None:
    if not cluster.zk_tls:
        return None
    d = cluster.tls_dir
    return ServerTls(d / "zookeeper.pem", d / "zookeeper-key.pem", d / "ca.pem")


def _tls_keys(cluster: LocalCluster, prefix: str, name: str) -> dict[str, Any]:
    """``<prefix>certFile/keyFile/caFile`` for role ``name`` (mutual TLS), or nothing without TLS."""
    if not cluster.tls:
        return {}
    d = cluster.tls_dir
    return {
        f"{prefix}certFile": str(d / f"{name}.pem"),
        f"{prefix}keyFile": str(d / f"{name}-key.pem"),
        f"{prefix}caFile": str(d / "ca.pem"),
    }


def admin_ssl(cluster: LocalCluster) -> SSLContext | None:
    """The context this orchestrator uses towards the storage admin ports (the client certificate)."""
    keys = _tls_keys(cluster, "ssl.", "admin")
    return TlsConfig.from_config(keys, "ssl.", role="connect", source=str(cluster.tls_dir)).client_context()


def storage_config(cluster: LocalCluster, rec: ProcessRecord, segment_size_bytes: int) -> dict[str, Any]:
    return {
        "storage.host": procs.LOOPBACK,
        "storage.port": rec.port,
        "storage.admin.port": rec.admin_port,
        "storage.http.port": rec.http_port,
        "storage.directory": rec.data_dir,
        "storage.segment.size.threshold": segment_size_bytes,
        "zookeeper.connectString": cluster.zk_connect,
        "zookeeper.sessionTimeout": cluster.zk_session_timeout_ms,
        "cluster.root": cluster.cluster_root,
        **_tls_keys(cluster, "storage.ssl.", "storage"),
        **({"storage.ssl.allowedPeers": ",".join(STORAGE_PEERS)} if cluster.tls else {}),
        **_zk_keys(cluster, identity="cluster", cert="storage"),
    }


def server_config(cluster: LocalCluster, rec: ProcessRecord) -> dict[str, Any]:
    return {
        "server.host": procs.LOOPBACK,
        "server.port": rec.port,
        "server.http.port": rec.http_port,
        "zookeeper.connectString": cluster.zk_connect,
        # Short sessions: a killed server's partitions move to a live one within seconds, not 30 s.
        "zookeeper.sessionTimeout": cluster.zk_session_timeout_ms,
        "cluster.root": cluster.cluster_root,
        # Reconnect to a restarted storage node quickly.
        "storage.initialRetryInterval": 50,
        "storage.maxRetryInterval": 1000,
        "storage.rpcTimeout": 5000,
        **_tls_keys(cluster, "server.ssl.", "server"),
        **_zk_keys(cluster, identity="cluster", cert="server"),
    }


def client_config(cluster: LocalCluster) -> dict[str, Any]:
    return {
        "zookeeper": {"connectString": cluster.zk_connect, "sessionTimeout": 30000},
        "cluster": {"root": cluster.cluster_root},
        **_tls_keys(cluster, "client.ssl.", "client"),
        **_zk_keys(cluster, identity="client", cert="client"),
    }


def admin_config(cluster: LocalCluster) -> dict[str, Any]:
    """The operator's CLI configuration (``waltz cluster|storage ... -c D/admin.yaml``)."""
    return {
        "zookeeper.connectString": cluster.zk_connect,
        "cluster.root": cluster.cluster_root,
        **_tls_keys(cluster, "ssl.", "admin"),
        **_zk_keys(cluster, identity="cluster", cert="admin"),
    }


def write_yaml(path: Path, values: dict[str, Any]) -> None:
    write_durable(path, yaml.safe_dump(values, sort_keys=True).encode("utf-8"))


def cluster_key(cluster: LocalCluster) -> Any:
    client = zk_connect(cluster, 5_000)
    try:
        return sm.read_store_params(client, cluster.cluster_root).cluster_key
    finally:
        zkutil.close(client)
