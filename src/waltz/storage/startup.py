"""Starting a storage node process: the cluster's identity, ZooKeeper, and the run until a stop signal."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable

from waltz.http import build_info
from waltz.runtime import tune_gc, tune_malloc, wait_for_stop_signal
from waltz.storage.authority import SessionAuthority, ZkSessionAuthority
from waltz.storage.config import StorageConfig
from waltz.storage.fileio import OS_FS, FileSystem
from waltz.storage.node import StorageNode

log = logging.getLogger(__name__)

SESSION_CHECK_TIMEOUT_S = 10.0
"""How long a request with a new session id waits for ZooKeeper to confirm it before it is refused."""


def load_cluster_identity(config: StorageConfig) -> tuple[uuid.UUID, int]:
    """The cluster key and partition count: from ZooKeeper when configured, else from the config file.

    Blocking (talks to ZooKeeper); call it before the event loop starts or through ``asyncio.to_thread``.
    """
    if config.zookeeper_connect:
        from waltz.cluster import zk
        from waltz.cluster.store_metadata import read_store_params

        client = zk.connect(
            config.zookeeper_connect,
            session_timeout_ms=config.zookeeper_session_timeout_ms,
            connect_timeout_ms=config.zookeeper_connect_timeout_ms,
            auth=config.zookeeper_auth,
        )
        try:
            params = read_store_params(client, config.cluster_root)
        finally:
            zk.close(client)
        return params.cluster_key, params.num_partitions
    assert config.cluster_key is not None  # StorageConfig guarantees it without ZooKeeper
    return config.cluster_key, config.num_partitions


async def run_node(
    config: StorageConfig,
    *,
    ready: Callable[[StorageNode], None] | None = None,
    fs: FileSystem = OS_FS,
) -> None:
    """Run a storage node until SIGTERM/SIGINT (or cancellation), then close it cleanly. ``fs``: the file
    layer of its logs (tests inject one; see :mod:`waltz.testing.faultfs`)."""
    info = build_info()
    log.info(
        "waltz storage node %s starting (python %s%s): directory %s, %s, %s:%d admin %d HTTP %s, TLS %s",
        info["version"],
        info["python"],
        f", commit {info['commit'][:12]}" if "commit" in info else "",
        config.directory,
        f"zookeeper {config.zookeeper_connect} cluster {config.cluster_root}"
        if config.zookeeper_connect
        else "standalone",
        config.host,
        config.port,
        config.admin_port,
        config.http_port or "off",
        "on" if config.tls.enabled else "off",
    )
    key, num_partitions = await asyncio.to_thread(load_cluster_identity, config)
    zk_client = None
    authority: SessionAuthority | None = None
    if config.zookeeper_connect:
        from waltz.cluster import zk

        # Kept for the node's lifetime: new session ids are checked against the partitions' metadata.
        zk_client = await asyncio.to_thread(
            zk.connect,
            config.zookeeper_connect,
            session_timeout_ms=config.zookeeper_session_timeout_ms,
            connect_timeout_ms=config.zookeeper_connect_timeout_ms,
            auth=config.zookeeper_auth,
        )
        authority = ZkSessionAuthority(zk_client, config.cluster_root, SESSION_CHECK_TIMEOUT_S)
    try:
        if zk_client is not None:
            from waltz.cluster.features import check_supported

            await asyncio.to_thread(check_supported, zk_client, config.cluster_root, "this storage node")
        node = await StorageNode.start(config, key, num_partitions, authority, fs=fs)
        if zk_client is not None:
            from waltz.cluster.zk_metrics import ZooKeeperCollector

            node.registry.register(ZooKeeperCollector(lambda: zk_client))
        tune_gc()
        tune_malloc()
        try:
            if ready is not None:
                ready(node)
            await wait_for_stop_signal()
        finally:
            await node.aclose()
    finally:
        if zk_client is not None:
            from waltz.cluster import zk

            await asyncio.to_thread(zk.close, zk_client)
        log.info("storage node stopped")
