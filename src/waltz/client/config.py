"""Client configuration: the keys of the original ``WaltzClientConfig`` plus the limits this client adds.

A YAML file may spell keys dotted or nested (see :mod:`waltz.config`). Durations are milliseconds.

=====================================  =========  ===========================================================
key                                    default    meaning
=====================================  =========  ===========================================================
zookeeper.connectString                required   ZooKeeper ensemble ``host:port[,host:port...]``
zookeeper.sessionTimeout               required   ZooKeeper session timeout (ms)
zookeeper.authFile                     ""         file with ZooKeeper digest credentials ``user:password``
zookeeper.ssl.enabled                  false      reach ZooKeeper over TLS (its secure client port)
zookeeper.ssl.certFile                 empty      PEM client certificate presented to ZooKeeper
zookeeper.ssl.keyFile                  empty      its PEM private key
zookeeper.ssl.caFile                   empty      PEM CA ZooKeeper's certificate must chain to
zookeeper.ssl.checkHostname            true       ZooKeeper's certificate must name the host connected to
cluster.root                           required   the cluster's root znode, e.g. ``/waltz/mycluster``
client.autoMount                       true       mount every partition; false: only ``set_partitions``
client.numTransactionRetryThreads      1          accepted for compatibility; retries are asyncio tasks
client.numConsumerThreads              10         threads running callbacks and ``execute``
client.callbackMode                    auto       ``auto`` (``threads``: the same): coroutine callbacks on
                                                  the event loop, plain ones on the callback threads;
                                                  ``inline``: every callback on the event loop
client.longWaitThreshold               5000       a partition with appends pending this long gets a flush
client.answerTimeout                   15000      a mount, or an append, the server leaves unanswered this
                                                  long makes the client reconnect and mount again
client.maxConcurrentTransactions       64         contexts in flight per partition (back pressure)
client.submitTimeout                   10000      how long ``submit`` waits for room before it fails
client.mountTimeout                    10000      how long an append waits for its partition to be mounted
client.requestTimeout                  30000      time limit of one RPC (data fetch, high-water mark)
client.retryInitialBackoff             10         first delay before re-executing a failed context
client.retryMaxBackoff                 1000       the delay doubles up to this bound
client.maxTransactionAttempts          0          executions of one context before it fails (0: no limit)
client.transactionTimeout              0          a context older than this fails (0: never expires)
client.feedQueueSize                   1000       committed transactions buffered per partition
client.ssl.certFile                    empty      PEM client certificate (for servers that require one)
client.ssl.keyFile                     empty      its PEM private key
client.ssl.caFile                      empty      PEM CA the servers' certificates must chain to
client.ssl.checkHostname               true       a server's certificate must name the host connected to
=====================================  =========  ===========================================================

Any ``client.ssl.*`` file turns TLS on for every server connection (see :mod:`waltz.tls`); the files are
checked when the configuration is built. ``zookeeper.ssl.*`` is ZooKeeper's own TLS (see
:class:`waltz.cluster.zk.ZkTls`), checked when the configuration is built too.

``client.mockDriver`` cannot come from a file: set :attr:`ClientConfig.mock_driver` in code (or pass
``driver=`` to the client) to run against :class:`waltz.testing.MockDriver`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from waltz.client.dispatch import MODES
from waltz.cluster.zk import ZK_SSL_PREFIX, ZkAuth, ZkTls, read_auth_file, zk_tls_keys
from waltz.config import ConfigSchema, Key, read_yaml
from waltz.errors import ConfigError
from waltz.tls import TLS_KEY_NAMES, TlsConfig, tls_keys

if TYPE_CHECKING:
    from waltz.client.driver import ClientDriver


def _non_blank(value: Any) -> str | None:
    return "must not be empty" if not str(value).strip() else None


def _znode_path(value: Any) -> str | None:
    text = str(value)
    if not text.startswith("/") or (len(text) > 1 and text.endswith("/")):
        return f"must be an absolute znode path like /waltz/mycluster, got {text!r}"
    return None


CALLBACK_MODES = MODES
"""Where application code runs (see waltz.client.dispatch): ``auto`` (the default; ``threads`` is the same):
coroutine functions on the client's event loop, plain functions on the callback threads; ``inline``: every
callback on the loop."""


def _callback_mode(value: Any) -> str | None:
    if value not in CALLBACK_MODES:
        return f"must be one of {', '.join(CALLBACK_MODES)}, got {value!r}"
    return None


SSL_PREFIX = "client.ssl."

CLIENT_SCHEMA = ConfigSchema(
    [
        Key("zookeeper.connectString", str, doc="ZooKeeper ensemble", check=_non_blank),
        Key("zookeeper.sessionTimeout", int, doc="ZooKeeper session timeout (ms)", min_value=1),
        Key("cluster.root", str, doc="the cluster's root znode", check=_znode_path),
        Key("zookeeper.authFile", str, "", "file with ZooKeeper digest credentials user:password"),
        *zk_tls_keys(),
        Key("client.autoMount", bool, True, "mount every partition automatically"),
        Key("client.numTransactionRetryThreads", int, 1, "compatibility only", min_value=1),
        Key("client.numConsumerThreads", int, 10, "callback threads", min_value=1, max_value=1024),
        Key("client.callbackMode", str, "auto", "auto | threads | inline", check=_callback_mode),
        Key("client.longWaitThreshold", int, 5000, "nudge a stuck partition (ms)", min_value=1),
        Key("client.answerTimeout", int, 15000, "reconnect after no answer for this long (ms)", min_value=1),
        Key("client.maxConcurrentTransactions", int, 64, "contexts in flight per partition", min_value=1),
        Key("client.submitTimeout", int, 10000, "submit waits this long for room (ms)", min_value=1),
        Key("client.mountTimeout", int, 10000, "wait for a mounted partition (ms)", min_value=1),
        Key("client.requestTimeout", int, 30000, "one RPC's time limit (ms)", min_value=1),
        Key("client.retryInitialBackoff", int, 10, "first retry delay (ms)", min_value=0),
        Key("client.retryMaxBackoff", int, 1000, "largest retry delay (ms)", min_value=0),
        Key("client.maxTransactionAttempts", int, 0, "0 = unlimited", min_value=0),
        Key("client.transactionTimeout", int, 0, "0 = never (ms)", min_value=0),
        Key("client.feedQueueSize", int, 1000, "feed records buffered per partition", min_value=1),
        *tls_keys(SSL_PREFIX),
    ],
)


@dataclass(frozen=True)
class ClientConfig:
    """Validated client settings. Build it with :meth:`from_yaml` / :meth:`from_dict`, or directly in code
    (for the mock driver, where the ZooKeeper keys may stay empty).

    Instances are immutable; use :meth:`replace` to derive a variant.
    """

    zookeeper_connect_string: str = ""
    zookeeper_session_timeout_ms: int = 30000
    cluster_root: str = ""
    zookeeper_auth_file: str = ""
    """A file holding ``user:password``: the client's ZooKeeper digest identity (docs/security.md)."""
    zookeeper_ssl: Mapping[str, Any] = field(default_factory=dict)
    """``zookeeper.ssl.*`` keys without the prefix (``enabled``, ``certFile``, ``keyFile``, ``caFile``,
    ``checkHostname``): TLS to ZooKeeper."""
    auto_mount: bool = True
    num_transaction_retry_threads: int = 1
    num_consumer_threads: int = 10
    callback_mode: str = "auto"
    """``auto`` (``threads`` is the same) or ``inline``; see "Where callbacks run" in docs/client.md."""
    long_wait_threshold_ms: int = 5000
    answer_timeout_ms: int = 15000
    """A MountRequest unanswered, or an append neither committed nor resolved, for this long: the client
    drops the connection and mounts again (the flush after READY then decides each pending append)."""
    max_concurrent_transactions: int = 64
    submit_timeout_ms: int = 10000
    mount_timeout_ms: int = 10000
    request_timeout_ms: int = 30000
    retry_initial_backoff_ms: int = 10
    retry_max_backoff_ms: int = 1000
    max_transaction_attempts: int = 0
    transaction_timeout_ms: int = 0
    feed_queue_size: int = 1000
    ssl: Mapping[str, Any] = field(default_factory=dict)
    """``client.ssl.*`` keys without the prefix (``certFile``, ``keyFile``, ``caFile``, ``checkHostname``)."""
    tls: TlsConfig = field(init=False, compare=False, repr=False)
    """:attr:`ssl` checked and parsed (derived, not an argument); the network driver's TLS settings."""
    zookeeper_tls: ZkTls = field(init=False, compare=False, repr=False)
    """:attr:`zookeeper_ssl` checked and parsed (derived, not an argument)."""
    mock_driver: ClientDriver | None = field(default=None, compare=False)
    """The driver to use instead of the network driver (tests; see :mod:`waltz.testing`)."""

    def __post_init__(self) -> None:
        # Values built in code get the same checks as values read from a file.
        problems: list[str] = []
        for key_name, attr in _KEY_TO_ATTR.items():
            key = CLIENT_SCHEMA.keys[key_name]
            value = getattr(self, attr)
            if key_name in ("zookeeper.connectString", "cluster.root") and value == "":
                continue  # Only needed by the network driver, which checks them (see require_cluster).
            try:
                key.convert(value)
            except ValueError as e:
                problems.append(f"{key_name} ({attr}): {e}")
        if self.retry_max_backoff_ms < self.retry_initial_backoff_ms:
            problems.append(
                "client.retryMaxBackoff must be at least client.retryInitialBackoff "
                f"({self.retry_max_backoff_ms} < {self.retry_initial_backoff_ms})"
            )
        unknown = sorted(set(self.ssl) - set(TLS_KEY_NAMES))
        if unknown:
            problems.append(f"unknown TLS keys {', '.join(SSL_PREFIX + k for k in unknown)}")
        unknown_zk = sorted(set(self.zookeeper_ssl) - {*TLS_KEY_NAMES, "enabled"})
        if unknown_zk:
            problems.append(f"unknown TLS keys {', '.join(ZK_SSL_PREFIX + k for k in unknown_zk)}")
        if problems:
            raise ConfigError("client config: " + "; ".join(problems))
        tls = TlsConfig.from_config(
            {SSL_PREFIX + k: v for k, v in self.ssl.items()},
            SSL_PREFIX,
            role="connect",
            source="client config",
        )
        object.__setattr__(self, "tls", tls)  # A derived field of a frozen dataclass.
        zk_tls = ZkTls.from_config(
            {ZK_SSL_PREFIX + k: v for k, v in self.zookeeper_ssl.items()}, source="client config"
        )
        object.__setattr__(self, "zookeeper_tls", zk_tls)

    def zookeeper_auth(self) -> ZkAuth:
        """How this client reaches and authenticates with ZooKeeper: :attr:`zookeeper_tls` and the identity in
        :attr:`zookeeper_auth_file` (read now, bounded; ConfigError naming the key if it is unusable)."""
        credentials = (
            read_auth_file(self.zookeeper_auth_file, "client config") if self.zookeeper_auth_file else ""
        )
        return ZkAuth(credentials, tls=self.zookeeper_tls)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str = "client config") -> ClientConfig:
        """Parse dotted (or nested) keys; every problem is reported at once in one ``ConfigError``."""
        if "client.mockDriver" in values or "mockDriver" in values.get("client", {}):
            raise ConfigError(
                f"{source}: client.mockDriver cannot be set from a file; set ClientConfig.mock_driver in code"
            )
        parsed = CLIENT_SCHEMA.parse(values, source)
        kwargs: dict[str, Any] = {attr: parsed[key] for key, attr in _KEY_TO_ATTR.items()}
        kwargs["ssl"] = {
            k.removeprefix("client.ssl."): v for k, v in parsed.items() if k.startswith("client.ssl.")
        }
        kwargs["zookeeper_ssl"] = {
            k.removeprefix(ZK_SSL_PREFIX): v for k, v in parsed.items() if k.startswith(ZK_SSL_PREFIX)
        }
        return cls(**kwargs)

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: Mapping[str, Any] | None = None) -> ClientConfig:
        """Read a YAML file (``overrides``, dotted keys, win over the file)."""
        values = read_yaml(path)
        if overrides:
            values.update(overrides)
        return cls.from_dict(values, source=str(path))

    def replace(self, **changes: Any) -> ClientConfig:
        """A copy with some attributes changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def require_cluster(self) -> None:
        """Raise ``ConfigError`` unless the keys needed to reach a real cluster are set."""
        missing = [
            key
            for key, attr in (
                ("zookeeper.connectString", "zookeeper_connect_string"),
                ("cluster.root", "cluster_root"),
            )
            if not getattr(self, attr)
        ]
        if missing:
            raise ConfigError(f"client config: {', '.join(missing)} required to connect to a cluster")


_KEY_TO_ATTR: dict[str, str] = {
    "zookeeper.connectString": "zookeeper_connect_string",
    "zookeeper.sessionTimeout": "zookeeper_session_timeout_ms",
    "cluster.root": "cluster_root",
    "zookeeper.authFile": "zookeeper_auth_file",
    "client.autoMount": "auto_mount",
    "client.numTransactionRetryThreads": "num_transaction_retry_threads",
    "client.numConsumerThreads": "num_consumer_threads",
    "client.callbackMode": "callback_mode",
    "client.longWaitThreshold": "long_wait_threshold_ms",
    "client.answerTimeout": "answer_timeout_ms",
    "client.maxConcurrentTransactions": "max_concurrent_transactions",
    "client.submitTimeout": "submit_timeout_ms",
    "client.mountTimeout": "mount_timeout_ms",
    "client.requestTimeout": "request_timeout_ms",
    "client.retryInitialBackoff": "retry_initial_backoff_ms",
    "client.retryMaxBackoff": "retry_max_backoff_ms",
    "client.maxTransactionAttempts": "max_transaction_attempts",
    "client.transactionTimeout": "transaction_timeout_ms",
    "client.feedQueueSize": "feed_queue_size",
}
