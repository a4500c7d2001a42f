"""Helpers shared by the CLI command groups: argument parsing that raises clear errors."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from waltz.cluster.zk import zk_auth_keys
from waltz.config import ConfigSchema, Key, flatten, read_yaml
from waltz.tls import TlsConfig, tls_keys

CLI_CONFIG_SCHEMA = ConfigSchema(
    [
        Key("zookeeper.connectString", str, doc="ZooKeeper ensemble, host:port[,host:port...]"),
        Key("zookeeper.sessionTimeout", int, 30000, "ZooKeeper session timeout", min_value=1000),
        Key("zookeeper.connectTimeout", int, 10000, "time allowed to connect to ZooKeeper", min_value=100),
        Key("cluster.root", str, doc="the cluster's root znode, e.g. /waltz/mycluster"),
        *zk_auth_keys(),
        *tls_keys("ssl."),
    ],
    ignore_prefixes=("client.", "server.", "storage."),
)
_TLS_FILES = ("certFile", "keyFile", "caFile")


def load_cli_config(path: str | Path) -> dict[str, Any]:
    """Read a ``-c/--cli-config-path`` YAML file (ZooKeeper address, session timeout, cluster root)."""
    return CLI_CONFIG_SCHEMA.load(path)


def cli_tls(values: Mapping[str, Any], source: str = "CLI config") -> TlsConfig:
    """TLS settings of admin commands (which connect to storage admin ports and servers): the ``ssl.*`` keys
    of a ``-c`` file or, when it has none, its ``client.ssl.*`` keys, so a client configuration (such as the
    ``client.yaml`` of ``waltz local up --tls``) serves as a CLI configuration too."""
    flat = flatten(values)
    prefix = "ssl."
    if not any(flat.get(f"ssl.{k}") for k in _TLS_FILES) and any(
        flat.get(f"client.ssl.{k}") for k in _TLS_FILES
    ):
        prefix = "client.ssl."
    keys = ConfigSchema(tls_keys(prefix)).parse(
        {k: v for k, v in flat.items() if k.startswith(prefix)}, source
    )
    return TlsConfig.from_config(keys, prefix, role="connect", source=source)


def load_cli_tls(path: str | Path | None) -> TlsConfig:
    """:func:`cli_tls` of a ``-c`` file (checked like :func:`load_cli_config`); plain TCP without a file."""
    if path is None:
        return TlsConfig()
    values = read_yaml(path)
    CLI_CONFIG_SCHEMA.parse(values, str(path))
    return cli_tls(values, str(path))


def add_cli_config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-c",
        "--cli-config-path",
        required=True,
        metavar="FILE",
        help="YAML with zookeeper.* and cluster.root (and ssl.* for TLS)",
    )
