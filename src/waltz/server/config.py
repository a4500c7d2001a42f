"""Configuration of a Waltz server (``waltz server run --config server.yaml``); keys as in REFERENCE §7.2."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from waltz.cluster.zk import ZkAuth, zk_auth_keys
from waltz.config import ConfigSchema, Key, distinct_ports, host_port, read_yaml
from waltz.errors import ConfigError
from waltz.protocol.client_server import FEED_WINDOW_MAX
from waltz.server.partition import DEFAULT_MIN_FETCH_SIZE
from waltz.server.store.support import StoreConfig
from waltz.tls import TlsConfig, tls_keys

CATCH_UP_BATCH_RECORDS = 1000
"""Records a lagging replica copies per round trip (see ``from_mapping``)."""

MAX_PENDING_BATCHES = 64
"""Committed batches a replica may lag behind before it counts as unable to keep up (see ``from_mapping``)."""

SERVER_SCHEMA = ConfigSchema(
    [
        Key("zookeeper.connectString", str, doc="ZooKeeper ensemble"),
        # 2 s: a crashed server's partitions are served again within 3 s. ZooKeeper must allow it
        # (minSessionTimeout <= 2000, so tickTime <= 1000); docs/deploy.md, "Failover", has the trade-off.
        Key("zookeeper.sessionTimeout", int, 2000, "ZooKeeper session timeout (ms)", 1000),
        Key("zookeeper.connectTimeout", int, 10000, "time allowed to reach ZooKeeper at start (ms)", 100),
        Key("cluster.root", str, doc="cluster root znode"),
        *zk_auth_keys(),
        Key("server.host", str, "127.0.0.1", "address to listen on and to advertise"),
        Key("server.port", int, doc="client port (0 = pick a free port)", min_value=0, max_value=65535),
        Key(
            "server.advertisedAddress",
            str,
            "",
            "host:port registered for clients (default: server.host and the listening port)",
        ),
        Key("server.http.port", int, 0, "HTTP port for /health and /metrics (0 = off)", 0, 65535),
        Key("server.optimisticLockTableSize", int, 30000, "lock table slots per partition", 16, 100_000_000),
        Key("server.feedCacheSize", int, 64 * 1024 * 1024, "feed cache bytes", 1024),
        # A window above FEED_WINDOW_MAX is more than a client buffers per partition without pausing its
        # connection's reads: a lagging partition would stall the client's other partitions again. The
        # default is not the reference's 100 (see DEFAULT_MIN_FETCH_SIZE).
        Key(
            "server.minFetchSize",
            int,
            DEFAULT_MIN_FETCH_SIZE,
            f"smallest feed window (at most {FEED_WINDOW_MAX}, the window a client buffers per partition)",
            1,
            FEED_WINDOW_MAX,
        ),
        # The reference splits feeds into a realtime and a catch-up task by this lag; here every mounted
        # client has its own feed task (a lagging one delays only itself): the key is kept for its configs.
        Key(
            "server.realtimeThreshold",
            int,
            1000,
            "no effect on feeds (one task per client feed); server.minFetchSize must be below it",
            2,
        ),
        Key("server.transactionDataCacheSize", int, 128 * 1024 * 1024, "transaction data cache bytes", 0),
        Key("server.maxFrameBytes", int, 32 * 1024 * 1024, "largest frame accepted", 1024, 2**31 - 1),
        Key("server.appendQueueSize", int, 1000, "appends queued per partition", 1, 1_000_000),
        Key("server.preferredPartitions", str, "", "partition ranges this server prefers, e.g. 0-3"),
        # Bounds per client connection (what one peer may hold; see docs/operations.md, "Limits").
        Key("server.connection.maxInFlight", int, 64, "unanswered mounts/reads/flushes per connection", 1),
        Key(
            "server.connection.maxResponseBytes",
            int,
            64 * 1024 * 1024,
            "bytes of read responses one connection may hold (being read or unsent)",
            1024,
        ),
        Key("server.connection.idleTimeout", int, 180_000, "close a connection silent this long (ms)", 100),
        Key("server.maxConnections", int, 1024, "client connections served at once", 1, 1_000_000),
        Key("server.connection.maxPerSource", int, 256, "connections from one address", 1, 1_000_000),
        Key("server.maxFetchesInFlight", int, 64, "transaction data store reads at once", 1, 100_000),
        Key("storage.maxBatchSize", int, 100, "appends per replication round", 1, 100_000),
        Key(
            "storage.maxBatchBytes",
            int,
            4 * 1024 * 1024,
            "data bytes per replication round (a larger single append still goes alone)",
            1024,
        ),
        Key("storage.maxInflightBatches", int, 4, "replication rounds in flight per partition", 1, 64),
        Key("storage.initialRetryInterval", int, 100, "first retry delay (ms)", 1),
        Key("storage.maxRetryInterval", int, 20000, "largest retry delay (ms)", 1),
        Key("storage.checkpointInterval", int, 250_000, "transactions between forced new sessions", 1),
        Key("storage.rpcTimeout", int, 10_000, "storage request timeout (ms)", 100),
        Key(
            "storage.metadataConflictReport",
            int,
            30_000,
            "report (and re-read every this many ms) partition metadata at a generation no assignment gave",
            100,
        ),
        Key(
            "storage.damagePollInterval",
            int,
            10_000,
            "how often (ms) to ask replicas for records their scrub found damaged, to repair them (0: never)",
            0,
        ),
        Key(
            "server.retention.checkInterval",
            int,
            60_000,
            "how often (ms) the owning server applies the retention policy to its partitions",
            100,
            86_400_000,
        ),
        # One set of keys for both sides, as in the original: the listener for clients, and the client
        # context towards storage nodes (whose certificate must chain to server.ssl.caFile).
        *tls_keys("server.ssl."),
    ],
)


@dataclass(frozen=True)
class ServerConfig:
    """A validated server configuration."""

    zookeeper_connect: str
    zookeeper_session_timeout_ms: int
    zookeeper_connect_timeout_ms: int
    cluster_root: str
    host: str
    port: int
    http_port: int
    advertised_address: tuple[str, int] | None
    """Registered in ZooKeeper for clients instead of ``(host, port)``; None: the listening address."""
    lock_table_size: int
    feed_cache_bytes: int
    min_fetch_size: int
    realtime_threshold: int
    transaction_cache_bytes: int
    max_frame_bytes: int
    append_queue_size: int
    preferred_partitions: str
    store: StoreConfig
    tls: TlsConfig = field(default_factory=lambda: TlsConfig(prefix="server.ssl."))
    """``server.ssl.*``: TLS towards clients and towards storage nodes (see :mod:`waltz.tls`)."""
    connection_max_in_flight: int = 64
    connection_max_response_bytes: int = 64 * 1024 * 1024
    connection_idle_timeout_ms: int = 180_000
    max_connections: int = 1024
    max_connections_per_source: int = 256
    max_fetches_in_flight: int = 64
    retention_check_interval_ms: int = 60_000
    """``server.retention.checkInterval``: how often the retention policy is applied."""
    zookeeper_auth: ZkAuth = field(default_factory=ZkAuth)
    """``zookeeper.authFile``/``aclReaders``/``ssl.*``: how the server reaches and logs in to ZooKeeper."""

    @classmethod
    def from_mapping(cls, values: dict[str, Any], source: str = "server config") -> ServerConfig:
        c = SERVER_SCHEMA.parse(values, source)
        distinct_ports(c, ["server.port", "server.http.port"], source)
        if c["server.minFetchSize"] >= c["server.realtimeThreshold"]:
            raise ConfigError(f"{source}: server.minFetchSize must be below server.realtimeThreshold")
        if c["storage.initialRetryInterval"] > c["storage.maxRetryInterval"]:
            raise ConfigError(f"{source}: storage.initialRetryInterval exceeds storage.maxRetryInterval")
        batch = c["storage.maxBatchSize"]
        return cls(
            zookeeper_connect=c["zookeeper.connectString"],
            zookeeper_session_timeout_ms=c["zookeeper.sessionTimeout"],
            zookeeper_connect_timeout_ms=c["zookeeper.connectTimeout"],
            cluster_root=c["cluster.root"],
            host=c["server.host"],
            port=c["server.port"],
            http_port=c["server.http.port"],
            advertised_address=host_port(c["server.advertisedAddress"])
            if c["server.advertisedAddress"]
            else None,
            lock_table_size=c["server.optimisticLockTableSize"],
            feed_cache_bytes=c["server.feedCacheSize"],
            min_fetch_size=c["server.minFetchSize"],
            realtime_threshold=c["server.realtimeThreshold"],
            transaction_cache_bytes=c["server.transactionDataCacheSize"],
            max_frame_bytes=c["server.maxFrameBytes"],
            append_queue_size=c["server.appendQueueSize"],
            preferred_partitions=c["server.preferredPartitions"],
            store=StoreConfig(
                max_batch_size=batch,
                max_batch_bytes=c["storage.maxBatchBytes"],
                max_queued_appends=2 * batch,
                max_inflight_batches=c["storage.maxInflightBatches"],
                # The original copies 20 records per catch-up round trip; a replica added to a busy partition
                # then falls behind for good (each round trip also waits for an fsync on the copy's target).
                # Whole write batches per round trip let it catch up with a writer at full speed.
                catch_up_batch_size=max(CATCH_UP_BATCH_RECORDS, batch),
                # A participant this many committed batches behind ends the session. Batches of a lone client
                # hold one record each, so 8 (the store default) is an 8 ms fsync stall at 1000 appends/s:
                # sessions then restarted every few seconds. A replica writes everything waiting in one
                # request, so a short stall is caught up at once.
                max_pending_batches=MAX_PENDING_BATCHES,
                checkpoint_interval=c["storage.checkpointInterval"],
                initial_retry_interval_ms=c["storage.initialRetryInterval"],
                max_retry_interval_ms=c["storage.maxRetryInterval"],
                rpc_timeout_ms=c["storage.rpcTimeout"],
                damage_poll_interval_ms=c["storage.damagePollInterval"],
                stale_report_ms=c["storage.metadataConflictReport"],
            ),
            tls=TlsConfig.from_config(c, "server.ssl.", role="both", source=source),
            connection_max_in_flight=c["server.connection.maxInFlight"],
            connection_max_response_bytes=c["server.connection.maxResponseBytes"],
            connection_idle_timeout_ms=c["server.connection.idleTimeout"],
            max_connections=c["server.maxConnections"],
            max_connections_per_source=c["server.connection.maxPerSource"],
            max_fetches_in_flight=c["server.maxFetchesInFlight"],
            retention_check_interval_ms=c["server.retention.checkInterval"],
            zookeeper_auth=ZkAuth.from_config(c, source),
        )

    @classmethod
    def load(cls, path: str | Path) -> ServerConfig:
        return cls.from_mapping(read_yaml(path), str(path))
