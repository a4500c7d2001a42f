"""Where the cluster's partitions live: :class:`Discovery`, and :class:`ZkDiscovery` from ZooKeeper.

A :class:`Discovery` supplies the cluster's name, its partition count, a unique client id and, on every
change, where each partition lives: ``{partition: ("host:port", generation)}``. :class:`ZkDiscovery` reads
them from ZooKeeper (``cluster.root``) with a :class:`~waltz.cluster.membership.ClusterWatcher`, which only
ever publishes assignments consistent with the live membership. Tests may pass their own to the
:class:`~waltz.client.network.NetworkDriver`. Everything runs on the client's event loop; kazoo's threads
only reach it through the ClusterWatcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Final, Protocol

from kazoo.client import KazooClient

from waltz.client.config import ClientConfig
from waltz.client.driver import CoordinationTrouble
from waltz.cluster import zk
from waltz.cluster.membership import ClusterWatcher
from waltz.cluster.retention import read_retention
from waltz.cluster.store_metadata import next_id, read_cluster_params
from waltz.cluster.trim_points import (
    DEFAULT_MIN_KEPT_TRANSACTIONS,
    TrimOutcome,
    TrimSource,
    raise_trim_point,
)
from waltz.errors import ClientError

__all__ = ["Discovery", "Endpoints", "ZkDiscovery"]

log = logging.getLogger(__name__)

ZK_CLOSE_TIMEOUT_S: Final = 5.0
ZK_MIN_CONNECT_TIMEOUT_MS: Final = 1000
ZK_MAX_CONNECT_TIMEOUT_MS: Final = 10000

Endpoints = dict[int, tuple[str, int]]
"""``{partition: ("host:port", generation)}``."""


class Discovery(Protocol):
    """Where the cluster's partitions live. ``open`` first; the properties are valid afterwards."""

    @property
    def cluster_name(self) -> str: ...

    @property
    def num_partitions(self) -> int: ...

    @property
    def endpoints(self) -> Endpoints:
        """The latest assignment (empty before the first one)."""
        ...

    async def open(self) -> None: ...

    async def new_client_id(self) -> int:
        """An id no other client of the cluster has."""
        ...

    def updates(self) -> AsyncIterator[Endpoints]:
        """The current assignment (if any), then each new one, until :meth:`close`."""
        ...

    async def close(self) -> None: ...


class ZkDiscovery:
    """:class:`Discovery` from ZooKeeper: ``zookeeper.*`` and ``cluster.root`` of the client config."""

    def __init__(self, config: ClientConfig) -> None:
        config.require_cluster()
        self._config = config
        self._zk: KazooClient | None = None
        self._watcher: ClusterWatcher | None = None
        self._name = ""
        self._num_partitions = 0
        self._unreachable_since_s: float | None = None
        """When ZooKeeper stopped answering this client (monotonic), None while connected. Written on kazoo's
        thread (one assignment), read on the loop."""

    @property
    def cluster_name(self) -> str:
        return self._name

    @property
    def num_partitions(self) -> int:
        return self._num_partitions

    @property
    def endpoints(self) -> Endpoints:
        return self._watcher.endpoints if self._watcher is not None else {}

    async def open(self) -> None:
        config = self._config
        session_timeout_ms = config.zookeeper_session_timeout_ms
        client = await asyncio.to_thread(
            zk.connect,
            config.zookeeper_connect_string,
            auth=config.zookeeper_auth(),
            session_timeout_ms=session_timeout_ms,
            # An ensemble that does not answer within a session timeout is reported, not waited for.
            connect_timeout_ms=max(
                ZK_MIN_CONNECT_TIMEOUT_MS, min(session_timeout_ms, ZK_MAX_CONNECT_TIMEOUT_MS)
            ),
        )
        client.add_listener(self._on_state)
        try:
            params = await asyncio.to_thread(read_cluster_params, client, config.cluster_root)
            watcher = ClusterWatcher(client, config.cluster_root)
            await watcher.start()
        except BaseException:
            await _close_zk(client)
            raise
        self._zk, self._watcher = client, watcher
        self._name, self._num_partitions = params.name, params.num_partitions

    @property
    def zookeeper_client(self) -> KazooClient | None:
        return self._zk

    def _on_state(self, state: str) -> bool:
        """kazoo's session listener (its thread): note when ZooKeeper stops and starts answering."""
        if state == "CONNECTED":
            self._unreachable_since_s = None
        elif self._unreachable_since_s is None:
            self._unreachable_since_s = time.monotonic()
        return False  # stay registered

    def coordination_trouble(self) -> CoordinationTrouble | None:
        """ZooKeeper does not answer this client (connection suspended or session lost), or None."""
        since_s = self._unreachable_since_s
        if since_s is None:
            return None
        return CoordinationTrouble(
            since_s,
            f"ZooKeeper ({self._config.zookeeper_connect_string}) has not answered this client for "
            f"{time.monotonic() - since_s:.1f} s (no quorum, or unreachable); the servers hold appends "
            "while ZooKeeper does not answer them either",
        )

    async def new_client_id(self) -> int:
        if self._zk is None:
            raise ClientError("discovery is not open")
        return await asyncio.to_thread(next_id, self._zk, self._config.cluster_root, "client")

    async def raise_trim_point(
        self, partition_id: int, target: int, high_water_mark: int, min_kept_transactions: int | None
    ) -> TrimOutcome:
        """Raise ``partition_id``'s trim point in ZooKeeper (the rules of ``waltz cluster trim``): pending
        for the cluster's grace (``retention.graceMs``), then in force."""
        zk_client = self._zk
        if zk_client is None:
            raise ClientError("discovery is not open")
        root = self._config.cluster_root
        grace_ms = (await asyncio.to_thread(read_retention, zk_client, root)).grace_ms
        return await asyncio.to_thread(
            lambda: raise_trim_point(
                zk_client,
                root,
                partition_id,
                target,
                high_water_mark,
                min_kept_transactions=(
                    DEFAULT_MIN_KEPT_TRANSACTIONS if min_kept_transactions is None else min_kept_transactions
                ),
                grace_ms=grace_ms,
                source=TrimSource.CLIENT,
            )
        )

    async def updates(self) -> AsyncIterator[Endpoints]:
        if self._watcher is None:
            return
        async for endpoints in self._watcher.updates():
            yield endpoints

    async def close(self) -> None:
        watcher, self._watcher = self._watcher, None
        client, self._zk = self._zk, None
        if watcher is not None:
            with contextlib.suppress(Exception):
                await watcher.close()
        if client is not None:
            await _close_zk(client)


async def _close_zk(client: KazooClient) -> None:
    # kazoo's stop() can wait on an unreachable ensemble; close() must return regardless.
    try:
        async with asyncio.timeout(ZK_CLOSE_TIMEOUT_S):
            await asyncio.to_thread(zk.close, client)
    except (TimeoutError, Exception) as e:  # noqa: BLE001 - closing is best effort, say why and go on
        log.warning("closing the ZooKeeper client failed: %s", e or type(e).__name__)
