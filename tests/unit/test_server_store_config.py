"""The server's ``storage.*`` keys reach the store layer's StoreConfig, validated."""

from __future__ import annotations

from typing import Any

import pytest

from waltz.errors import ConfigError
from waltz.server.config import ServerConfig
from waltz.server.store import StoreConfig

BASE: dict[str, Any] = {"zookeeper.connectString": "127.0.0.1:2181", "cluster.root": "/w", "server.port": 0}


def test_max_inflight_batches_defaults_to_four_and_is_passed_on() -> None:
    assert ServerConfig.from_mapping(BASE).store.max_inflight_batches == 4
    config = ServerConfig.from_mapping({**BASE, "storage.maxInflightBatches": 1})
    assert config.store.max_inflight_batches == 1


@pytest.mark.parametrize("value", [0, 65, "many"])
def test_max_inflight_batches_out_of_range_is_refused(value: object) -> None:
    with pytest.raises(ConfigError, match=r"storage\.maxInflightBatches"):
        ServerConfig.from_mapping({**BASE, "storage.maxInflightBatches": value})


def test_store_config_refuses_no_batch_in_flight() -> None:
    with pytest.raises(ValueError, match="max_inflight_batches"):
        StoreConfig(max_inflight_batches=0)
