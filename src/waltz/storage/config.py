"""Configuration of a storage node (``waltz storage run --config storage.yaml``).

Keys follow the original Waltz's dotted names. The cluster key and partition count come from ZooKeeper
(``<cluster.root>/store``) when ``zookeeper.connectString`` is set; without ZooKeeper (single-node tests
and the first demo) they may be given as ``storage.cluster.key`` and ``storage.cluster.numPartitions``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from waltz.cluster.zk import ZkAuth, zk_auth_keys
from waltz.config import ConfigSchema, Key, distinct_ports, read_yaml
from waltz.errors import ConfigError
from waltz.storage.fsync import DEFAULT_SYNCFS_MIN_FILES
from waltz.tls import TlsConfig, parse_peer_names, tls_keys

DEFAULT_DELETE_BYTES_PER_SECOND = 64 * 1024 * 1024
"""Trimmed segments are freed at most this fast by default: freeing a gigabyte at once (the unlink of a whole
segment) makes the file system's next journal commits, and with online discard the device's TRIM, large
enough to stall the appends' fsyncs for hundreds of milliseconds. 64 MiB/s frees 1 GB in 16 s, with no
visible effect on append latency in ``bench/trim_p99.py`` (5.5 TB a day: more than a node writes)."""


def _directory_check(value: Any) -> str | None:
    # A blank directory would put the control file and partition folders in whatever the current directory
    # happens to be.
    if not str(value).strip():
        return "must name a directory (it is blank)"
    return None


DEFAULT_SEGMENT_PREALLOCATE_BYTES = 4 * 1024 * 1024
MIN_SEGMENT_PREALLOCATE_BYTES = 64 * 1024
MAX_SEGMENT_PREALLOCATE_BYTES = 1 << 30


def _preallocate_check(value: Any) -> str | None:
    # Below 64 KiB the zeros would be written (and fsynced) every few appends: more work than they save.
    if value != 0 and not MIN_SEGMENT_PREALLOCATE_BYTES <= value <= MAX_SEGMENT_PREALLOCATE_BYTES:
        return (
            f"must be 0 (off) or between {MIN_SEGMENT_PREALLOCATE_BYTES} and {MAX_SEGMENT_PREALLOCATE_BYTES} "
            f"bytes, got {value}"
        )
    return None


def _uuid_check(value: Any) -> str | None:
    if value == "":
        return None
    try:
        uuid.UUID(str(value))
    except ValueError:
        return f"not a UUID: {value!r}"
    return None


STORAGE_SCHEMA = ConfigSchema(
    [
        Key("storage.port", int, doc="data port (server connections)", min_value=0, max_value=65535),
        Key("storage.admin.port", int, doc="admin port", min_value=0, max_value=65535),
        Key("storage.http.port", int, 0, "HTTP port for /health and /metrics (0 = off)", 0, 65535),
        Key("storage.host", str, "127.0.0.1", "address to listen on"),
        Key(
            "storage.directory",
            str,
            doc="storage directory (control file and partition folders)",
            check=_directory_check,
        ),
        Key("storage.segment.size.threshold", int, 1_000_000_000, "roll a segment past this size", 1024),
        Key("storage.segment.cache.capacity", int, 5, "open read-only segments kept", 1, 10_000),
        Key(
            "storage.segment.preallocateBytes",
            int,
            DEFAULT_SEGMENT_PREALLOCATE_BYTES,
            "keep the newest segment's data file zero-filled (written after a group commit, fsynced by the "
            "next) this far ahead of its last record, so appends overwrite instead of extending it (0 = off)",
            check=_preallocate_check,
        ),
        Key("storage.maxFrameBytes", int, 64 * 1024 * 1024, "largest frame accepted", 1024, 2**31 - 1),
        Key("storage.partition.queueSize", int, 1000, "requests queued per partition", 1, 1_000_000),
        Key("storage.connection.maxInFlight", int, 2000, "unanswered requests per connection", 1, 1_000_000),
        # Bounds per connection (what one peer may hold; see docs/operations.md, "Limits").
        Key(
            "storage.connection.maxResponseBytes",
            int,
            64 * 1024 * 1024,
            "bytes of read responses one connection may have queued or unsent",
            1024,
        ),
        Key("storage.connection.idleTimeout", int, 180_000, "close a connection silent this long (ms)", 100),
        Key("storage.maxConnections", int, 1024, "data and admin connections served at once", 1, 1_000_000),
        Key("storage.connection.maxPerSource", int, 128, "connections from one address", 1, 1_000_000),
        Key("storage.maxGroupCommitRecords", int, 20_000, "records written before one fsync", 1, 10_000_000),
        Key(
            "storage.fsync.syncfsMinFiles",
            int,
            DEFAULT_SYNCFS_MIN_FILES,
            "make a batch of at least this many partitions' files durable with one syncfs(2) of the data "
            "directory's file system instead of an fdatasync each (Linux >= 5.8 on ext4, XFS or btrfs only; "
            "0 = never)",
            0,
            1_000_000,
        ),
        Key(
            "storage.trim.deleteBytesPerSecond",
            int,
            DEFAULT_DELETE_BYTES_PER_SECOND,
            "how fast trimmed segments are deleted (truncated in steps, then unlinked; 0 = at once)",
            0,
            2**40,
        ),
        Key(
            "storage.scrub.bytesPerSecond",
            int,
            4 * 1024 * 1024,
            "background verification read rate (0 = no scrub)",
            0,
            2**40,
        ),
        Key("storage.scrub.pauseMs", int, 60_000, "pause between two scrub passes over every partition", 1),
        Key(
            "storage.maxSessionIdStep",
            int,
            1_000_000,
            "standalone only: how far above the newest session id it accepted for a partition a request's "
            "session id may be (ZooKeeper's metadata decides when configured)",
            1,
            2**62,
        ),
        Key("storage.cluster.key", str, "", "cluster key when not using ZooKeeper", check=_uuid_check),
        Key("storage.cluster.numPartitions", int, 0, "partition count when not using ZooKeeper", 0, 100_000),
        Key("zookeeper.connectString", str, "", "ZooKeeper ensemble; empty = standalone"),
        Key("zookeeper.sessionTimeout", int, 30000, "ZooKeeper session timeout", 1000),
        Key("zookeeper.connectTimeout", int, 10000, "time allowed to reach ZooKeeper at start (ms)", 100),
        Key("cluster.root", str, "", "cluster root znode"),
        *zk_auth_keys(),
        *tls_keys("storage.ssl."),
        Key(
            "storage.ssl.allowedPeers",
            str,
            "",
            "certificate common names allowed on the data and admin ports (comma-separated; empty: any "
            "certificate the CA signed)",
        ),
    ],
)


@dataclass(frozen=True)
class StorageConfig:
    """A validated storage node configuration."""

    port: int
    admin_port: int
    http_port: int
    host: str
    directory: Path
    segment_size_threshold_bytes: int
    segment_cache_capacity: int
    max_frame_bytes: int
    partition_queue_size: int
    connection_max_in_flight: int
    max_group_commit_records: int
    scrub_bytes_per_second: int
    scrub_pause_ms: int
    cluster_key: uuid.UUID | None
    num_partitions: int
    zookeeper_connect: str
    zookeeper_session_timeout_ms: int
    zookeeper_connect_timeout_ms: int
    cluster_root: str
    tls: TlsConfig = field(default_factory=lambda: TlsConfig(prefix="storage.ssl."))
    """``storage.ssl.*``: TLS on the data and admin ports (see :mod:`waltz.tls`)."""
    connection_max_response_bytes: int = 64 * 1024 * 1024
    connection_idle_timeout_ms: int = 180_000
    max_connections: int = 1024
    max_connections_per_source: int = 128
    zookeeper_auth: ZkAuth = field(default_factory=ZkAuth)
    """``zookeeper.authFile``/``aclReaders``/``ssl.*``: how the node reaches and logs in to ZooKeeper."""
    allowed_peers: tuple[str, ...] = ()
    max_session_id_step: int = 1_000_000
    delete_bytes_per_second: int = DEFAULT_DELETE_BYTES_PER_SECOND
    """``storage.trim.deleteBytesPerSecond``: the pace of deleting trimmed segments (0 = at once)."""
    segment_preallocate_bytes: int = DEFAULT_SEGMENT_PREALLOCATE_BYTES
    """``storage.segment.preallocateBytes``: zeros kept ahead of the writable segment's last record (see
    :meth:`waltz.storage.segment.Segment.prefill`); 0 = off."""
    syncfs_min_files: int = DEFAULT_SYNCFS_MIN_FILES
    """``storage.fsync.syncfsMinFiles``: batches of fsyncs of at least this many files become one ``syncfs``
    where that is trusted (see :mod:`waltz.storage.fsync`); 0 = never."""
    """Standalone nodes: the largest jump above the newest accepted session id of a partition (see
    :func:`waltz.storage.authority.step_refusal`)."""
    """``storage.ssl.allowedPeers``: the certificate common names (servers, operators) that may connect."""

    @classmethod
    def from_mapping(cls, values: dict[str, Any], source: str = "storage config") -> StorageConfig:
        c = STORAGE_SCHEMA.parse(values, source)
        distinct_ports(c, ["storage.port", "storage.admin.port", "storage.http.port"], source)
        zk = c["zookeeper.connectString"]
        key = c["storage.cluster.key"]
        if zk and not c["cluster.root"]:
            raise ConfigError(f"{source}: cluster.root is required with zookeeper.connectString")
        if not zk and (not key or c["storage.cluster.numPartitions"] <= 0):
            raise ConfigError(
                f"{source}: give zookeeper.connectString and cluster.root, or storage.cluster.key "
                "and storage.cluster.numPartitions for a standalone node"
            )
        return cls(
            port=c["storage.port"],
            admin_port=c["storage.admin.port"],
            http_port=c["storage.http.port"],
            host=c["storage.host"],
            directory=Path(c["storage.directory"]),
            segment_size_threshold_bytes=c["storage.segment.size.threshold"],
            segment_cache_capacity=c["storage.segment.cache.capacity"],
            max_frame_bytes=c["storage.maxFrameBytes"],
            partition_queue_size=c["storage.partition.queueSize"],
            connection_max_in_flight=c["storage.connection.maxInFlight"],
            max_group_commit_records=c["storage.maxGroupCommitRecords"],
            scrub_bytes_per_second=c["storage.scrub.bytesPerSecond"],
            scrub_pause_ms=c["storage.scrub.pauseMs"],
            cluster_key=uuid.UUID(key) if key else None,
            num_partitions=c["storage.cluster.numPartitions"],
            zookeeper_connect=zk,
            zookeeper_session_timeout_ms=c["zookeeper.sessionTimeout"],
            zookeeper_connect_timeout_ms=c["zookeeper.connectTimeout"],
            cluster_root=c["cluster.root"],
            tls=TlsConfig.from_config(c, "storage.ssl.", role="listen", source=source),
            connection_max_response_bytes=c["storage.connection.maxResponseBytes"],
            connection_idle_timeout_ms=c["storage.connection.idleTimeout"],
            max_connections=c["storage.maxConnections"],
            max_connections_per_source=c["storage.connection.maxPerSource"],
            zookeeper_auth=ZkAuth.from_config(c, source),
            allowed_peers=_allowed_peers(c, source),
            max_session_id_step=c["storage.maxSessionIdStep"],
            segment_preallocate_bytes=c["storage.segment.preallocateBytes"],
            delete_bytes_per_second=c["storage.trim.deleteBytesPerSecond"],
            syncfs_min_files=c["storage.fsync.syncfsMinFiles"],
        )

    @classmethod
    def load(cls, path: str | Path) -> StorageConfig:
        """Read and validate ``path``; every problem is reported as one line in a ConfigError."""
        return cls.from_mapping(read_yaml(path), str(path))


def _allowed_peers(c: dict[str, Any], source: str) -> tuple[str, ...]:
    names = parse_peer_names(c["storage.ssl.allowedPeers"])
    if names and not c["storage.ssl.caFile"]:
        raise ConfigError(
            f"{source}: storage.ssl.allowedPeers needs storage.ssl.caFile (client certificates to check)"
        )
    return names
