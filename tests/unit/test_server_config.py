"""The server's feed keys: a window a client cannot buffer is refused at load time."""

from __future__ import annotations

from typing import Any

import pytest

from waltz.errors import ConfigError
from waltz.protocol.client_server import FEED_WINDOW_MAX
from waltz.server.config import ServerConfig

BASE: dict[str, Any] = {"zookeeper.connectString": "127.0.0.1:2181", "cluster.root": "/w", "server.port": 0}


def test_min_fetch_size_up_to_the_feed_window_is_accepted() -> None:
    assert ServerConfig.from_mapping(BASE).min_fetch_size == 500
    config = {**BASE, "server.minFetchSize": FEED_WINDOW_MAX, "server.realtimeThreshold": FEED_WINDOW_MAX + 1}
    assert ServerConfig.from_mapping(config).min_fetch_size == FEED_WINDOW_MAX


def test_min_fetch_size_above_the_feed_window_is_refused_whatever_the_realtime_threshold() -> None:
    # Such a window is more than a client buffers per partition without pausing its connection's reads.
    config = {**BASE, "server.minFetchSize": FEED_WINDOW_MAX + 1, "server.realtimeThreshold": 10**6}
    with pytest.raises(
        ConfigError, match=rf"server\.minFetchSize: must be at most {FEED_WINDOW_MAX}, got 1001"
    ):
        ServerConfig.from_mapping(config, "s.yaml")


def test_min_fetch_size_must_stay_below_the_realtime_threshold() -> None:
    config = {**BASE, "server.minFetchSize": 500, "server.realtimeThreshold": 500}
    with pytest.raises(ConfigError, match=r"server\.minFetchSize must be below server\.realtimeThreshold"):
        ServerConfig.from_mapping(config)
