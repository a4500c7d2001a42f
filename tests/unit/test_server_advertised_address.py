"""``server.advertisedAddress``: the address registered for clients when they reach the server through a
proxy or NAT (the fault suite puts a cuttable proxy there)."""

from __future__ import annotations

from typing import Any

import pytest

from waltz.errors import ConfigError
from waltz.server.config import ServerConfig

BASE: dict[str, Any] = {"zookeeper.connectString": "127.0.0.1:2181", "cluster.root": "/w", "server.port": 0}


def test_by_default_clients_are_told_the_listening_address() -> None:
    assert ServerConfig.from_mapping(BASE).advertised_address is None


def test_an_advertised_address_is_parsed() -> None:
    config = ServerConfig.from_mapping({**BASE, "server.advertisedAddress": "proxy.example:9000"})
    assert config.advertised_address == ("proxy.example", 9000)


@pytest.mark.parametrize("value", ["no-port", "host:0", "host:http"])
def test_a_bad_advertised_address_is_refused(value: str) -> None:
    with pytest.raises(ConfigError):
        ServerConfig.from_mapping({**BASE, "server.advertisedAddress": value})
