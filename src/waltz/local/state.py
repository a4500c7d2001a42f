"""``D/cluster.json``: what ``waltz local up`` started, where, and under which pid.

Written atomically (a temporary file renamed over the old one) after every change, so a crash of the
orchestrating command never leaves a half-written file, and ``waltz local down`` can always find every process
that was started, even by an ``up`` that failed half-way. Example::

    {
      "version": 1,
      "state": "running",                      # "starting" while up runs, "stopped" after down
      "cluster_root": "/waltz/local", "cluster_name": "local", "num_partitions": 4, "groups": 3,
      "zookeeper": {"kind": "zookeeper", "index": 0, "pid": 4242, "start_ticks": 123456,
                    "port": 2181, "data_dir": "D/zookeeper", "log": "D/logs/zookeeper.log", ...},
      "storages": [{"kind": "storage", "index": 0, "pid": ..., "port": ..., "admin_port": ...,
                    "http_port": ..., "group": 0, "partitions": [0, 1, 2, 3], "data_dir": "D/storage-0",
                    "config": "D/storage-0.yaml", "log": "D/logs/storage-0.log", "stdout": ...}],
      "servers": [{"kind": "server", "index": 0, "pid": ..., "port": ..., "http_port": ...,
                   "server_id": 1, ...}],
      "zookeepers": [...],                     # an ensemble (up --zookeepers N): every member, each with
                                               # its quorum_port and election_port; "zookeeper" is the first
      "client_config": "D/client.yaml",
      "tls": false,                            # true: mutual TLS everywhere, certificates in D/tls/
      "zk_tls": false                          # true: ZooKeeper serves TLS only (absent in older files)
    }
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from waltz.cluster.files import write_durable
from waltz.errors import ConfigError
from waltz.local.procs import ProcessId

STATE_FILE = "cluster.json"
CLIENT_CONFIG_FILE = "client.yaml"
TLS_DIR = "tls"
FORMAT_VERSION = 1
DEFAULT_ZK_SESSION_TIMEOUT_MS = 2000
"""The servers' and storage nodes' ZooKeeper session timeout in a local cluster: a killed server's partitions
are served again within 3 s (docs/deploy.md, "Failover")."""


@dataclass
class ProcessRecord:
    """One process of the local cluster and the files that belong to it."""

    kind: str
    index: int
    port: int
    http_port: int
    data_dir: str
    log: str
    stdout: str = ""
    config: str = ""
    admin_port: int = 0
    group: int = 0
    partitions: list[int] = field(default_factory=list)
    server_id: int = -1
    quorum_port: int = 0
    """A ZooKeeper ensemble member's quorum (follower-to-leader) port; 0 for a standalone ZooKeeper."""
    election_port: int = 0
    """A ZooKeeper ensemble member's leader-election port; 0 for a standalone ZooKeeper."""
    pid: int | None = None
    start_ticks: int | None = None

    @property
    def name(self) -> str:
        if self.kind == "zookeeper" and not self.quorum_port:
            return "zookeeper"  # standalone: there is only one
        return f"{self.kind} {self.index}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def process(self) -> ProcessId | None:
        return None if self.pid is None else ProcessId(self.pid, self.start_ticks)

    def set_process(self, proc: ProcessId | None) -> None:
        self.pid = None if proc is None else proc.pid
        self.start_ticks = None if proc is None else proc.start_ticks

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> ProcessRecord:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in value.items() if k in names})


@dataclass
class LocalCluster:
    """The contents of cluster.json."""

    directory: Path
    cluster_root: str
    cluster_name: str
    num_partitions: int
    groups: int
    zookeepers: list[ProcessRecord]
    """One standalone ZooKeeper, or every member of an ensemble (``up --zookeepers N``), member ``i`` having
    ZooKeeper server id ``i + 1``."""
    storages: list[ProcessRecord] = field(default_factory=list)
    servers: list[ProcessRecord] = field(default_factory=list)
    state: str = "starting"
    zk_session_timeout_ms: int = DEFAULT_ZK_SESSION_TIMEOUT_MS
    tls: bool = False
    """Every storage node, server and client.yaml use mutual TLS with the certificates in ``D/tls/``."""
    zk_tls: bool = False
    """ZooKeeper serves only a TLS port requiring client certificates (``up --tls`` since ZooKeeper TLS came;
    a cluster made before keeps its plain ZooKeeper, which its configs expect)."""

    @property
    def zookeeper(self) -> ProcessRecord:
        """The standalone ZooKeeper, or an ensemble's first member."""
        return self.zookeepers[0]

    @property
    def is_ensemble(self) -> bool:
        return bool(self.zookeeper.quorum_port)

    @property
    def zk_connect(self) -> str:
        return ",".join(z.address for z in self.zookeepers)

    def zookeeper_member(self, index: int) -> ProcessRecord:
        if not 0 <= index < len(self.zookeepers):
            raise ConfigError(
                f"there is no zookeeper {index}: this cluster has zookeepers 0..{len(self.zookeepers) - 1}"
            )
        return self.zookeepers[index]

    @property
    def client_config_path(self) -> Path:
        return self.directory / CLIENT_CONFIG_FILE

    @property
    def tls_dir(self) -> Path:
        """Where ``up --tls`` writes the CA and certificates (see :mod:`waltz.local.certs`)."""
        return self.directory / TLS_DIR

    @property
    def processes(self) -> list[ProcessRecord]:
        """Every process, in start order (ZooKeeper, storage nodes, servers)."""
        return [*self.zookeepers, *self.storages, *self.servers]

    def member(self, kind: str, index: int) -> ProcessRecord:
        group = {"storage": self.storages, "server": self.servers}.get(kind)
        if group is None:
            raise ConfigError(f"unknown process kind {kind!r}")
        if not 0 <= index < len(group):
            raise ConfigError(
                f"there is no {kind} {index}: this cluster has {kind}s 0..{len(group) - 1}"
                if group
                else f"this cluster has no {kind}s"
            )
        return group[index]

    def to_json(self) -> dict[str, Any]:
        return {
            "version": FORMAT_VERSION,
            "state": self.state,
            "cluster_root": self.cluster_root,
            "cluster_name": self.cluster_name,
            "num_partitions": self.num_partitions,
            "groups": self.groups,
            "zk_session_timeout_ms": self.zk_session_timeout_ms,
            "tls": self.tls,
            "zk_tls": self.zk_tls,
            "zookeeper": dataclasses.asdict(self.zookeeper),
            **({"zookeepers": [dataclasses.asdict(z) for z in self.zookeepers]} if self.is_ensemble else {}),
            "storages": [dataclasses.asdict(s) for s in self.storages],
            "servers": [dataclasses.asdict(s) for s in self.servers],
            "client_config": str(self.client_config_path),
        }

    def save(self) -> None:
        write_durable(self.directory / STATE_FILE, (json.dumps(self.to_json(), indent=2) + "\n").encode())

    @classmethod
    def load(cls, directory: str | Path) -> LocalCluster:
        """Read ``directory/cluster.json``; ConfigError if there is none or it is not ours."""
        directory = Path(directory).resolve()
        path = directory / STATE_FILE
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{directory} holds no local cluster ({STATE_FILE} not found)") from None
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read {path}: {e}") from None
        if not isinstance(raw, dict) or raw.get("version") != FORMAT_VERSION:
            raise ConfigError(f"{path} is not a waltz local cluster file (version {FORMAT_VERSION})")
        try:
            return cls(
                directory=directory,
                cluster_root=str(raw["cluster_root"]),
                cluster_name=str(raw["cluster_name"]),
                num_partitions=int(raw["num_partitions"]),
                groups=int(raw["groups"]),
                zookeepers=[ProcessRecord.from_json(z) for z in raw.get("zookeepers", [raw["zookeeper"]])],
                storages=[ProcessRecord.from_json(s) for s in raw["storages"]],
                servers=[ProcessRecord.from_json(s) for s in raw["servers"]],
                state=str(raw.get("state", "running")),
                # Files that predate the key were made with 6000 ms.
                zk_session_timeout_ms=int(raw.get("zk_session_timeout_ms", 6000)),
                tls=bool(raw.get("tls", False)),
                zk_tls=bool(raw.get("zk_tls", False)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{path} is damaged: {e!r}") from None
