"""ClientConfig: REFERENCE §5.4 keys, dotted or nested YAML, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from waltz import ClientConfig
from waltz.errors import ConfigError
from waltz.testing import MockDriver


def test_yaml_with_nested_and_dotted_keys(tmp_path: Path) -> None:
    f = tmp_path / "client.yaml"
    f.write_text(
        "zookeeper:\n  connectString: zk1:2181,zk2:2181\n  sessionTimeout: 30000\n"
        "cluster.root: /waltz/bank\n"
        "client:\n  maxConcurrentTransactions: 20\n  autoMount: false\n  ssl.checkHostname: false\n"
    )
    config = ClientConfig.from_yaml(f)
    assert config.zookeeper_connect_string == "zk1:2181,zk2:2181"
    assert config.zookeeper_session_timeout_ms == 30000
    assert config.cluster_root == "/waltz/bank"
    assert config.max_concurrent_transactions == 20
    assert config.auto_mount is False
    assert config.ssl["checkHostname"] is False
    assert not config.tls.enabled
    # Defaults from the original client.
    assert config.num_consumer_threads == 10
    assert config.long_wait_threshold_ms == 5000
    assert config.num_transaction_retry_threads == 1


def test_every_problem_is_reported_at_once_with_the_file_name(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text(
        "zookeeper.connectString: zk:2181\nclient.maxConcurentTransactions: 3\nclient.autoMount: maybe\n"
    )
    with pytest.raises(ConfigError) as e:
        ClientConfig.from_yaml(f)
    text = str(e.value)
    assert str(f) in text
    assert "did you mean 'client.maxConcurrentTransactions'" in text
    assert "client.autoMount: expected true or false" in text
    assert "zookeeper.sessionTimeout: required but missing" in text
    assert "cluster.root: required but missing" in text


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("client.maxConcurrentTransactions", 0, "at least 1"),
        ("cluster.root", "waltz", "absolute znode path"),
        ("zookeeper.connectString", " ", "must not be empty"),
        ("client.retryInitialBackoff", -1, "at least 0"),
    ],
)
def test_values_are_checked(key: str, value: object, message: str) -> None:
    values = {"zookeeper.connectString": "zk:2181", "zookeeper.sessionTimeout": 1000, "cluster.root": "/w"}
    values[key] = value  # type: ignore[assignment]
    with pytest.raises(ConfigError, match=message):
        ClientConfig.from_dict(values)


def test_mock_driver_cannot_come_from_a_file() -> None:
    with pytest.raises(ConfigError, match="mock_driver in code"):
        ClientConfig.from_dict({"client.mockDriver": "x"})


def test_config_built_in_code_is_validated_too() -> None:
    with pytest.raises(ConfigError, match="max_concurrent_transactions"):
        ClientConfig(max_concurrent_transactions=0)
    with pytest.raises(ConfigError, match="retryMaxBackoff"):
        ClientConfig(retry_initial_backoff_ms=100, retry_max_backoff_ms=10)
    driver = MockDriver()
    assert ClientConfig().replace(mock_driver=driver).mock_driver is driver


def test_a_real_cluster_needs_zookeeper_and_root() -> None:
    with pytest.raises(ConfigError, match=r"zookeeper.connectString, cluster.root required"):
        ClientConfig().require_cluster()
