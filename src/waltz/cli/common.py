"""Helpers shared by the CLI command groups: argument parsing that raises clear errors."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from waltz.config import ConfigSchema, Key
from waltz.errors import ConfigError


def parse_partition_ranges(text: str, num_partitions: int | None = None) -> list[int]:
    """Parse ``"0-6,7,10-16"`` into a sorted list of distinct partition ids.

    Raises ConfigError for malformed input, reversed ranges, negatives, or ids >= ``num_partitions``.
    """
    ids: set[int] = set()
    if not text.strip():
        raise ConfigError("empty partition list")
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo_s, hi_s = part.split("-", 1)
                lo, hi = int(lo_s), int(hi_s)
            else:
                lo = hi = int(part)
        except ValueError:
            raise ConfigError(f"bad partition range {part!r}: expected N or N-M") from None
        if lo < 0 or hi < lo:
            raise ConfigError(f"bad partition range {part!r}")
        if num_partitions is not None and hi >= num_partitions:
            raise ConfigError(f"partition {hi} out of range: the cluster has {num_partitions} partitions")
        ids.update(range(lo, hi + 1))
    return sorted(ids)


def host_port(text: str) -> tuple[str, int]:
    """Parse ``host:port`` with a clear error."""
    host, sep, port_s = text.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"expected host:port, got {text!r}")
    try:
        port = int(port_s)
    except ValueError:
        raise ConfigError(f"bad port in {text!r}") from None
    if not 0 < port < 65536:
        raise ConfigError(f"port out of range in {text!r}")
    return host, port


CLI_CONFIG_SCHEMA = ConfigSchema(
    [
        Key("zookeeper.connectString", str, doc="ZooKeeper ensemble, host:port[,host:port...]"),
        Key("zookeeper.sessionTimeout", int, 30000, "ZooKeeper session timeout", min_value=1000),
        Key("zookeeper.connectTimeout", int, 10000, "time allowed to connect to ZooKeeper", min_value=100),
        Key("cluster.root", str, doc="the cluster's root znode, e.g. /waltz/mycluster"),
    ],
    passthrough_prefixes=("ssl.",),
    ignore_prefixes=("client.", "server.", "storage."),
)


def load_cli_config(path: str | Path) -> dict[str, Any]:
    """Read a ``-c/--cli-config-path`` YAML file (ZooKeeper address, session timeout, cluster root)."""
    return CLI_CONFIG_SCHEMA.load(path)


def add_cli_config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-c",
        "--cli-config-path",
        required=True,
        metavar="FILE",
        help="YAML with zookeeper.* and cluster.root",
    )
