"""kazoo logs through Waltz's filtered logger in every process that connects with ``waltz.cluster.zk``
(servers, storage nodes, tools and client applications alike): its per-attempt warnings ("Connection
dropped", "Connection refused") reach no handler unless that logger is enabled for DEBUG; the one line per
session state change is Waltz's own."""

from __future__ import annotations

import logging
import socket

import pytest

from waltz.cluster import zk
from waltz.errors import ClusterError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _connect_to_nothing() -> None:
    with pytest.raises(ClusterError, match="no answer within"):
        zk.connect(f"127.0.0.1:{free_port()}", connect_timeout_ms=1500)


def test_kazoos_connection_warnings_are_filtered_at_info(caplog: pytest.LogCaptureFixture) -> None:
    # An application's usual set-up: the root logger at INFO, nothing said about kazoo.
    with caplog.at_level(logging.INFO):
        _connect_to_nothing()
    kazoo = [r for r in caplog.records if r.name.startswith(("kazoo", "waltz.cluster.zk.kazoo"))]
    assert kazoo == [], [r.getMessage() for r in kazoo]


def test_kazoos_warnings_return_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger=zk.KAZOO_LOG.name):
        _connect_to_nothing()
    messages = [r.getMessage() for r in caplog.records if r.name == zk.KAZOO_LOG.name]
    # Every failed attempt: the noise the filter keeps from an application's log.
    assert any("Connection dropped" in m or "Connection time-out" in m for m in messages), messages
