"""``zookeeper.ssl.*`` (``waltz.cluster.zk.ZkTls``): parsed the same way by every component, and every bad
setting is a ConfigError naming the key and the file before anything connects."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tls_fixture import zk_tls_keys
from waltz.cli.common import load_cli_config
from waltz.cli.main import main
from waltz.client.config import ClientConfig
from waltz.cluster.zk import ZkAuth, ZkTls
from waltz.errors import ConfigError
from waltz.local.certs import LocalPki
from waltz.server.config import ServerConfig
from waltz.spark.options import parse_options
from waltz.storage.config import StorageConfig


def test_plain_by_default() -> None:
    tls = ZkTls.from_config({})
    assert not tls.enabled
    assert tls.kazoo_args() == {}
    assert ZkAuth.from_config({}).tls == tls


def test_enabled_with_the_clusters_files(tls_pki: LocalPki) -> None:
    tls = ZkTls.from_config(zk_tls_keys(tls_pki, "client"))
    assert tls.enabled
    assert tls.files.has_identity
    assert tls.files.ca_file == str(tls_pki.ca_file)
    args = tls.kazoo_args()
    assert args["use_ssl"] is True
    assert args["handler"] is not None
    # Enabled without files: the system's CAs, no client certificate (for a ZooKeeper with a public cert).
    assert ZkTls.from_config({"zookeeper.ssl.enabled": "true"}).describe() == "TLS"


def test_files_without_the_switch_are_refused(tls_pki: LocalPki) -> None:
    keys = {k: v for k, v in zk_tls_keys(tls_pki, "client").items() if k != "zookeeper.ssl.enabled"}
    with pytest.raises(ConfigError, match=r"zookeeper\.ssl\.enabled is not true"):
        ZkTls.from_config(keys, "x.yaml")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"zookeeper.ssl.certFile": "/nonexistent/zk.pem"},
            r"zookeeper\.ssl\.certFile: cannot read /nonexistent",
        ),
        (
            {"zookeeper.ssl.caFile": "/dev/zero"},
            r"zookeeper\.ssl\.caFile: /dev/zero holds more than 1048576 bytes",
        ),
        ({"zookeeper.ssl.caFile": "/"}, r"zookeeper\.ssl\.caFile: / is a directory"),
        (
            {"zookeeper.ssl.keyFile": ""},
            r"zookeeper\.ssl\.certFile is set but zookeeper\.ssl\.keyFile is not",
        ),
        ({"zookeeper.ssl.enabled": "maybe"}, r"zookeeper\.ssl\.enabled: expected true or false"),
    ],
)
def test_bad_settings_name_the_key_and_the_file(
    tls_pki: LocalPki, change: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        ZkTls.from_config({**zk_tls_keys(tls_pki, "client"), **change}, "x.yaml")


def test_a_key_that_is_not_the_certificates_is_refused(tls_pki: LocalPki) -> None:
    keys = {**zk_tls_keys(tls_pki, "client"), "zookeeper.ssl.keyFile": str(tls_pki.key_file("server"))}
    with pytest.raises(ConfigError, match=r"zookeeper\.ssl\.keyFile: .* is not the private key"):
        ZkTls.from_config(keys)


def test_every_component_reads_the_keys(tmp_path: Path, tls_pki: LocalPki) -> None:
    keys = zk_tls_keys(tls_pki, "server")
    server = ServerConfig.from_mapping(
        {"zookeeper.connectString": "127.0.0.1:2181", "cluster.root": "/w", "server.port": 0, **keys}
    )
    assert server.zookeeper_auth.tls.files.cert_file == str(tls_pki.cert_file("server"))
    storage = StorageConfig.from_mapping(
        {
            "storage.port": 0,
            "storage.admin.port": 0,
            "storage.directory": str(tmp_path),
            "zookeeper.connectString": "127.0.0.1:2181",
            "cluster.root": "/w",
            **keys,
        }
    )
    assert storage.zookeeper_auth.tls.enabled
    cli_yaml = tmp_path / "admin.yaml"
    cli_yaml.write_text(
        "zookeeper.connectString: 127.0.0.1:2181\ncluster.root: /w\n"
        + "".join(f"{k}: {v}\n" for k, v in keys.items())
    )
    assert ZkAuth.from_config(load_cli_config(cli_yaml)).tls.enabled


def test_client_config_and_spark_options(tls_pki: LocalPki) -> None:
    keys = zk_tls_keys(tls_pki, "client")
    base = {
        "zookeeper.connectString": "127.0.0.1:2181",
        "zookeeper.sessionTimeout": 4000,
        "cluster.root": "/w",
    }
    config = ClientConfig.from_dict({**base, **keys})
    assert config.zookeeper_tls.enabled
    assert config.zookeeper_auth().tls == config.zookeeper_tls
    assert config.zookeeper_auth().credentials == ""
    with pytest.raises(
        ConfigError, match=r"client config: zookeeper\.ssl\.certFile: cannot read /nonexistent"
    ):
        ClientConfig.from_dict({**base, **keys, "zookeeper.ssl.certFile": "/nonexistent"})
    with pytest.raises(ConfigError, match=r"unknown TLS keys zookeeper\.ssl\.trustStore"):
        ClientConfig(zookeeper_ssl={"trustStore": "x"})
    # The Spark source passes waltz.zookeeper.ssl.* options (strings) on to its client configuration.
    options = parse_options(
        {
            "waltz.zookeeper.connectString": "127.0.0.1:2181",
            "waltz.cluster.root": "/w",
            **{f"waltz.{k}": str(v).lower() if isinstance(v, bool) else str(v) for k, v in keys.items()},
        }
    )
    assert options.client_config.zookeeper_tls.files.key_file == str(tls_pki.key_file("client"))


def test_the_cli_names_the_file_and_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "admin.yaml"
    bad.write_text(
        "zookeeper.connectString: 127.0.0.1:1\ncluster.root: /w\nzookeeper.ssl.enabled: true\n"
        "zookeeper.ssl.caFile: /dev/zero\n"
    )
    assert main(["cluster", "list", "-c", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: zookeeper.ssl.caFile: /dev/zero holds more than 1048576 bytes" in err
