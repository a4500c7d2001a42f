"""``waltz_zookeeper_*``: a process's view of its ZooKeeper session, for servers, storage nodes and clients.

Read when scraped from the counts :func:`waltz.cluster.zk.session_state` keeps (kazoo calls back on every
session state change; nothing is counted per request). Every series exists from the start, at 0, so the first
suspension or expiry shows in ``increase()``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from waltz.cluster.zk import session_state

__all__ = ["ZooKeeperCollector"]


class ZooKeeperCollector(Collector):
    """``waltz_zookeeper_connected`` (1 while the session is connected, 0 while suspended, expired or not
    started), ``waltz_zookeeper_suspensions_total`` (connections lost, kazoo's SUSPENDED) and
    ``waltz_zookeeper_sessions_expired_total`` (kazoo's LOST) of the kazoo client ``client()`` returns; none
    of them while it returns None (a client whose discovery is not ZooKeeper's, or not open). Counts start
    over when the process (or its kazoo client) does."""

    def __init__(self, client: Callable[[], Any]) -> None:
        self._client = client

    def collect(self) -> Iterator[Metric]:
        zk_client = self._client()
        if zk_client is None:
            return
        state = session_state(zk_client)
        yield GaugeMetricFamily(
            "waltz_zookeeper_connected",
            "1 while this process's ZooKeeper session is connected; 0 while suspended, expired, not started",
            value=1 if state is not None and state.connected else 0,
        )
        yield CounterMetricFamily(
            "waltz_zookeeper_suspensions",
            "ZooKeeper connections lost (the session may come back: appends are held meanwhile)",
            value=0 if state is None else state.suspensions,
        )
        yield CounterMetricFamily(
            "waltz_zookeeper_sessions_expired",
            "ZooKeeper sessions expired (ephemeral znodes gone: a server's partitions moved away)",
            value=0 if state is None else state.expiries,
        )
