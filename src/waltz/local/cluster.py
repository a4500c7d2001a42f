"""A whole Waltz cluster on this machine, one OS process per component (the library under ``waltz local``).

:func:`up` starts, in order: ZooKeeper (Debian's package, through :mod:`waltz.cluster.zkserver`), the cluster
metadata (``create_cluster``, ``add_storage_node``, ``auto_assign`` per group), the storage processes (then
tells each its partitions through the admin port), and the servers; it returns once every partition has a
server reporting it healthy. Each process listens on loopback ports (free ones, or consecutive ones from
``base_port``), logs under ``D/logs/``, and is recorded in ``D/cluster.json`` (see :mod:`waltz.local.state`).
``D/client.yaml`` is a client (and CLI) configuration for the cluster.

With ``tls`` (``waltz local up --tls``) a throwaway CA and one certificate each for the storage nodes, the
servers, the clients and the operator (``admin``; for 127.0.0.1/localhost) are made with ``openssl`` in
``D/tls/``, and every link is mutual TLS: storage nodes and servers require client certificates, servers
present theirs to storage nodes, and ``D/client.yaml`` carries ``client.ssl.*``. Storage data and admin ports
accept only the server and admin certificates (``storage.ssl.allowedPeers``): an application's certificate
cannot fence, truncate or unassign anything. ``D/admin.yaml`` is the operator's CLI configuration (``-c``).
ZooKeeper serves TLS only, on its one client port, and requires a client certificate from the same CA (its
own certificate is ``D/tls/zookeeper.pem``); every process reaches it with its role's certificate
(``zookeeper.ssl.*``). On top, digest ACLs (docs/security.md): servers, storage nodes and the operator
authenticate as the cluster identity (``D/tls/zk-cluster.auth``), applications as the client identity
(``D/tls/zk-client.auth``, read-only but for the client-id counter); anonymous sessions see nothing. Only the
HTTP ports (``/health``, ``/metrics``) stay plain TCP.

Guarantees:

* **Nothing left running on failure.** If :func:`up` fails at any step (port in use, ZooKeeper missing, a
  process that dies or never reports ready, partitions not served in time), it stops everything it started,
  removes the data it created (the logs stay, for the post-mortem) and raises a
  :class:`~waltz.errors.WaltzError` whose message says what failed and shows the failing process's log tail.
* **Stops only what it started.** Processes are stopped by recorded pid *and* start time
  (:mod:`waltz.local.procs`), servers first, then storage nodes, then ZooKeeper.
* **One orchestrator at a time per directory.** Commands that change the cluster hold an exclusive
  ``flock`` on ``D/.lock``.

Replication: storage node ``i`` belongs to group ``i % groups``; each group holds one full copy of every
partition, spread round robin over its nodes, so ``groups`` is the replication factor. The default is one
group per storage node: every node holds every partition and the cluster survives losing any minority.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import secrets
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from ssl import SSLContext
from typing import Any

import yaml

from waltz.cluster import store_metadata as sm
from waltz.cluster import zk as zkutil
from waltz.cluster import zkserver
from waltz.cluster.files import mkdir_durable, write_durable
from waltz.cluster.partition_metadata import UNRESOLVED
from waltz.cluster.zkserver import ServerTls
from waltz.errors import ClusterError, ConfigError, WaltzError
from waltz.local import certs, probe, procs
from waltz.local.state import CLIENT_CONFIG_FILE, STATE_FILE, LocalCluster, ProcessRecord
from waltz.server.storage_client import AdminClient
from waltz.tls import TlsConfig

CLUSTER_ROOT = "/waltz/local"
CLUSTER_NAME = "local"
DEFAULT_START_TIMEOUT_S = 60.0
"""Time allowed for each process to report ready, and for all partitions to be served."""
MAX_STORAGES = 16
MAX_SERVERS = 16
MAX_PARTITIONS = 1024
LOCK_FILE = ".lock"

Report = Callable[[str], None]


def _quiet(_: str) -> None:
    return None


@dataclass(frozen=True)
class UpOptions:
    """What :func:`up` starts. ``groups=None``: one group per storage node (full replication)."""

    directory: Path
    storages: int = 3
    servers: int = 2
    partitions: int = 4
    groups: int | None = None
    tls: bool = False
    base_port: int | None = None
    zk_port: int | None = None
    zk_session_timeout_ms: int = 6000
    segment_size_bytes: int = 64 * 1024 * 1024
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S
    before_storage_start: Callable[[ProcessRecord], None] | None = None
    """Called with each storage node's record just before its first start, its data directory made and
    empty (the fault suite mounts a filesystem there: bench/faults/power.py)."""

    def validate(self) -> None:
        if self.tls:
            certs.find_openssl()  # Before anything starts: a missing openssl is a clear ConfigError.
        if not 1 <= self.storages <= MAX_STORAGES:
            raise ConfigError(f"--storages must be between 1 and {MAX_STORAGES}, got {self.storages}")
        if not 1 <= self.servers <= MAX_SERVERS:
            raise ConfigError(f"--servers must be between 1 and {MAX_SERVERS}, got {self.servers}")
        if not 1 <= self.partitions <= MAX_PARTITIONS:
            raise ConfigError(f"--partitions must be between 1 and {MAX_PARTITIONS}, got {self.partitions}")
        if self.groups is not None and not 1 <= self.groups <= self.storages:
            raise ConfigError(
                f"--groups must be between 1 and the number of storage nodes ({self.storages}), "
                f"got {self.groups}: every group needs at least one node"
            )
        for name, port in (("--base-port", self.base_port), ("--zk-port", self.zk_port)):
            if port is not None and not 1024 <= port <= 65535:
                raise ConfigError(f"{name} must be between 1024 and 65535, got {port}")

    @property
    def group_count(self) -> int:
        return self.storages if self.groups is None else self.groups


# ------------------------------------------------------------------------------------------------ helpers


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Hold ``D/.lock`` exclusively; a second orchestrator fails at once instead of interleaving."""
    mkdir_durable(directory)
    with (directory / LOCK_FILE).open("a") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise ClusterError(f"another `waltz local` command is working on {directory}") from None
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _waltz_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "waltz.cli.main", *args]


def _check_directory(directory: Path) -> None:
    """Refuse a directory that holds a cluster (running or not) or another cluster's data."""
    if (directory / STATE_FILE).exists():
        try:
            existing = LocalCluster.load(directory)
        except ConfigError:
            raise ConfigError(f"{directory} holds an unreadable {STATE_FILE}; choose another --dir") from None
        running = [p.name for p in existing.processes if procs.is_alive(p.process)]
        if running:
            raise ConfigError(
                f"{directory} already holds a running cluster ({', '.join(running)}); "
                f"stop it with `waltz local down --dir {directory}` or choose another --dir"
            )
        raise ConfigError(
            f"{directory} holds a stopped cluster's data; remove it with "
            f"`waltz local down --dir {directory} --purge` or choose another --dir"
        )
    # Anything else must be empty: `up` writes data directories and configs at fixed names, and `down --purge`
    # deletes what `up` created, so it must never adopt a directory that holds someone else's files. The logs
    # of a failed `up` (which removes everything else) and the lock file are ours and may stay.
    others = sorted(
        p.name + ("/" if p.is_dir() else "")
        for p in directory.iterdir()
        if p.name != LOCK_FILE and not (p.name == "logs" and p.is_dir() and _only_our_logs(p))
    )
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise ConfigError(
            f"{directory} is not empty and holds no `waltz local` cluster ({shown}); "
            "choose an empty or new --dir"
        )


def _our_log_name(name: str) -> bool:
    stem, _, ext = name.partition(".")
    kind, _, index = stem.partition("-")
    if stem == "zookeeper":
        return ext == "log"
    return kind in ("storage", "server") and index.isdigit() and ext in ("log", "out")


def _only_our_logs(logs: Path) -> bool:
    return all(p.is_file() or p.is_symlink() for p in logs.iterdir()) and all(
        _our_log_name(p.name) for p in logs.iterdir()
    )


def _check_zookeeper_installed(*, tls: bool) -> None:
    zkserver.classpath(tls=tls)
    zkserver.find_java()


def _allocate_ports(opts: UpOptions) -> dict[str, list[int]]:
    """Ports for every process: ``{"zookeeper": [p], "storage": [data, admin, http, ...], "server": [...]}``.

    With ``base_port`` they are consecutive from it and each must be free now; otherwise the OS picks.
    """
    need = 3 * opts.storages + 2 * opts.servers
    if opts.base_port is not None:
        ports = list(range(opts.base_port, opts.base_port + need))
        if ports[-1] > 65535:
            raise ConfigError(f"--base-port {opts.base_port} leaves no room for {need} ports")
        if opts.zk_port is not None and opts.zk_port in ports:
            raise ConfigError(f"--zk-port {opts.zk_port} falls inside the --base-port range")
    else:
        exclude = frozenset() if opts.zk_port is None else frozenset({opts.zk_port})
        ports = procs.free_ports(need, exclude=exclude)
    zk_port = opts.zk_port if opts.zk_port is not None else procs.free_ports(1, exclude=frozenset(ports))[0]
    labels = ["ZooKeeper client port"]
    for i in range(opts.storages):
        labels += [f"storage {i} data port", f"storage {i} admin port", f"storage {i} HTTP port"]
    for i in range(opts.servers):
        labels += [f"server {i} client port", f"server {i} HTTP port"]
    for label, port in zip(labels, [zk_port, *ports], strict=True):
        if procs.port_in_use(port):
            raise ConfigError(f"port {port} ({label}) is already in use on 127.0.0.1")
    return {
        "zookeeper": [zk_port],
        "storage": ports[: 3 * opts.storages],
        "server": ports[3 * opts.storages :],
    }


TLS_NAMES = ("storage", "server", "client", "admin", "zookeeper")
"""One certificate per role in ``D/tls/``: ``<name>.pem`` and ``<name>-key.pem``, plus ``ca.pem``."""
STORAGE_PEERS = ("waltz server", "waltz admin")
"""Certificate common names (``waltz <role>``, see ``certs``) allowed on storage data and admin ports."""
ADMIN_CONFIG_FILE = "admin.yaml"
ZK_CLUSTER_AUTH = "zk-cluster.auth"
ZK_CLIENT_AUTH = "zk-client.auth"


def _zk_auth_files(cluster: LocalCluster) -> tuple[Path, Path] | None:
    """The cluster's and the applications' ZooKeeper credential files (only with TLS)."""
    if not cluster.tls:
        return None
    return cluster.tls_dir / ZK_CLUSTER_AUTH, cluster.tls_dir / ZK_CLIENT_AUTH


def _make_zk_credentials(cluster: LocalCluster) -> None:
    files = _zk_auth_files(cluster)
    if files is None:
        return
    cluster.tls_dir.mkdir(parents=True, exist_ok=True)
    for path, user in zip(files, ("waltz", "client"), strict=True):
        path.touch(mode=0o600)
        path.chmod(0o600)
        path.write_text(f"{user}:{secrets.token_urlsafe(24)}\n", encoding="ascii")


def _zk_keys(cluster: LocalCluster, *, identity: str, cert: str) -> dict[str, Any]:
    """How a process reaches ZooKeeper: ``zookeeper.ssl.*`` with the certificate of role ``cert`` (when
    ZooKeeper serves TLS), ``zookeeper.authFile`` (and, for the cluster identity, ``aclReaders``); nothing
    without TLS."""
    files = _zk_auth_files(cluster)
    if files is None:
        return {}
    keys: dict[str, Any] = {}
    if cluster.zk_tls:
        keys["zookeeper.ssl.enabled"] = True
        keys.update(_tls_keys(cluster, zkutil.ZK_SSL_PREFIX, cert))
    cluster_file, client_file = files
    if identity == "client":
        return {**keys, "zookeeper.authFile": str(client_file)}
    reader = zkutil.digest_id(zkutil.read_auth_file(str(client_file)))
    return {**keys, "zookeeper.authFile": str(cluster_file), "zookeeper.aclReaders": reader}


def _zk_connect(cluster: LocalCluster, connect_timeout_ms: int) -> Any:
    """The orchestrator's ZooKeeper session: the operator's certificate, the cluster identity (with TLS)."""
    keys = _zk_keys(cluster, identity="cluster", cert="admin")
    auth = zkutil.ZkAuth.from_config(keys, str(cluster.tls_dir)) if keys else None
    return zkutil.connect(
        cluster.zk_connect, session_timeout_ms=10_000, connect_timeout_ms=connect_timeout_ms, auth=auth
    )


def _zk_server_tls(cluster: LocalCluster) -> ServerTls | None:
    if not cluster.zk_tls:
        return None
    d = cluster.tls_dir
    return ServerTls(d / "zookeeper.pem", d / "zookeeper-key.pem", d / "ca.pem")


def _tls_keys(cluster: LocalCluster, prefix: str, name: str) -> dict[str, Any]:
    """``<prefix>certFile/keyFile/caFile`` for role ``name`` (mutual TLS), or nothing without TLS."""
    if not cluster.tls:
        return {}
    d = cluster.tls_dir
    return {
        f"{prefix}certFile": str(d / f"{name}.pem"),
        f"{prefix}keyFile": str(d / f"{name}-key.pem"),
        f"{prefix}caFile": str(d / "ca.pem"),
    }


def _admin_ssl(cluster: LocalCluster) -> SSLContext | None:
    """The context this orchestrator uses towards the storage admin ports (the client certificate)."""
    keys = _tls_keys(cluster, "ssl.", "admin")
    return TlsConfig.from_config(keys, "ssl.", role="connect", source=str(cluster.tls_dir)).client_context()


def _storage_config(cluster: LocalCluster, rec: ProcessRecord, segment_size_bytes: int) -> dict[str, Any]:
    return {
        "storage.host": procs.LOOPBACK,
        "storage.port": rec.port,
        "storage.admin.port": rec.admin_port,
        "storage.http.port": rec.http_port,
        "storage.directory": rec.data_dir,
        "storage.segment.size.threshold": segment_size_bytes,
        "zookeeper.connectString": cluster.zk_connect,
        "zookeeper.sessionTimeout": cluster.zk_session_timeout_ms,
        "cluster.root": cluster.cluster_root,
        **_tls_keys(cluster, "storage.ssl.", "storage"),
        **({"storage.ssl.allowedPeers": ",".join(STORAGE_PEERS)} if cluster.tls else {}),
        **_zk_keys(cluster, identity="cluster", cert="storage"),
    }


def _server_config(cluster: LocalCluster, rec: ProcessRecord) -> dict[str, Any]:
    return {
        "server.host": procs.LOOPBACK,
        "server.port": rec.port,
        "server.http.port": rec.http_port,
        "zookeeper.connectString": cluster.zk_connect,
        # Short sessions: a killed server's partitions move to a live one within seconds, not 30 s.
        "zookeeper.sessionTimeout": cluster.zk_session_timeout_ms,
        "cluster.root": cluster.cluster_root,
        # Reconnect to a restarted storage node quickly.
        "storage.initialRetryInterval": 50,
        "storage.maxRetryInterval": 1000,
        "storage.rpcTimeout": 5000,
        **_tls_keys(cluster, "server.ssl.", "server"),
        **_zk_keys(cluster, identity="cluster", cert="server"),
    }


def _client_config(cluster: LocalCluster) -> dict[str, Any]:
    return {
        "zookeeper": {"connectString": cluster.zk_connect, "sessionTimeout": 30000},
        "cluster": {"root": cluster.cluster_root},
        **_tls_keys(cluster, "client.ssl.", "client"),
        **_zk_keys(cluster, identity="client", cert="client"),
    }


def _admin_config(cluster: LocalCluster) -> dict[str, Any]:
    """The operator's CLI configuration (``waltz cluster|storage ... -c D/admin.yaml``)."""
    return {
        "zookeeper.connectString": cluster.zk_connect,
        "cluster.root": cluster.cluster_root,
        **_tls_keys(cluster, "ssl.", "admin"),
        **_zk_keys(cluster, identity="cluster", cert="admin"),
    }


def _write_yaml(path: Path, values: dict[str, Any]) -> None:
    write_durable(path, yaml.safe_dump(values, sort_keys=True).encode("utf-8"))


async def _assign_on_nodes(
    targets: list[tuple[int, list[int]]],
    key: Any,
    num_partitions: int,
    timeout_s: float,
    ssl: SSLContext | None = None,
) -> None:
    """Tell each storage node (by admin port) which partitions it holds (idempotent)."""
    for admin_port, partitions in targets:
        async with asyncio.timeout(timeout_s):
            admin = await AdminClient.connect(procs.LOOPBACK, admin_port, key, num_partitions, ssl=ssl)
            async with admin:
                if partitions:
                    await admin.set_assigned(partitions, True)


def _cluster_key(cluster: LocalCluster) -> Any:
    client = _zk_connect(cluster, 5_000)
    try:
        return sm.read_store_params(client, cluster.cluster_root).cluster_key
    finally:
        zkutil.close(client)


def _start_process(rec: ProcessRecord, timeout_s: float) -> None:
    """Spawn a storage node or server from its config file and wait for its ready line."""
    verb = "storage" if rec.kind == "storage" else "server"
    proc = procs.spawn_detached(
        _waltz_command(verb, "run", "--config", rec.config), stdout=Path(rec.stdout), stderr=Path(rec.log)
    )
    rec.set_process(proc)
    ready = procs.wait_ready_line(proc, Path(rec.stdout), Path(rec.log), rec.name, timeout_s)
    if rec.kind == "server":
        rec.server_id = int(ready.get("server_id", -1))


def _wait_served(cluster: LocalCluster, timeout_s: float) -> None:
    """Wait until every partition is reported healthy by some server; fail early if a process dies."""
    wanted = set(range(cluster.num_partitions))
    deadline = time.monotonic() + timeout_s
    served: set[int] = set()
    while True:
        for rec in [*cluster.storages, *cluster.servers]:
            if not procs.is_alive(rec.process):
                raise procs.ProcessStartError(
                    f"{rec.name} exited while the cluster was starting; {rec.log}:\n"
                    f"{procs.log_tail(Path(rec.log))}"
                )
        served = set()
        for rec in cluster.servers:
            served |= probe.served_partitions(rec.http_port)
        if wanted <= served:
            return
        if time.monotonic() > deadline:
            missing = sm.format_ranges(sorted(wanted - served))
            raise ClusterError(
                f"partitions {missing} were not served within {timeout_s:g} s; see the logs in "
                f"{cluster.directory / 'logs'}"
            )
        time.sleep(0.2)


def _teardown(cluster: LocalCluster) -> list[str]:
    """Stop every recorded process: servers, then storage nodes, then ZooKeeper. Returns what was running."""
    order = [*reversed(cluster.servers), *reversed(cluster.storages), cluster.zookeeper]
    return [rec.name for rec in order if procs.stop(rec.process)]


def _remove_data(cluster: LocalCluster) -> None:
    """After a failed ``up``: remove everything but the logs, so the directory can be used again."""
    d = cluster.directory
    for rec in cluster.processes:
        if rec.data_dir:
            shutil.rmtree(rec.data_dir, ignore_errors=True)
        if rec.config:
            Path(rec.config).unlink(missing_ok=True)
        if rec.stdout:
            Path(rec.stdout).unlink(missing_ok=True)
    for name in (STATE_FILE, CLIENT_CONFIG_FILE, ADMIN_CONFIG_FILE):
        (d / name).unlink(missing_ok=True)
    shutil.rmtree(cluster.tls_dir, ignore_errors=True)


# ------------------------------------------------------------------------------------------------- commands


def up(opts: UpOptions, report: Report = _quiet) -> LocalCluster:
    """Start a local cluster in ``opts.directory``; see the module docstring for the order and guarantees."""
    opts.validate()
    directory = opts.directory.resolve()
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"{directory} exists and is not a directory")
    if directory.exists():
        _check_directory(directory)
    _check_zookeeper_installed(tls=opts.tls)
    ports = _allocate_ports(opts)
    logs = directory / "logs"
    with _locked(directory):
        _check_directory(directory)  # Again, under the lock: another `up` may have just finished.
        logs.mkdir(parents=True, exist_ok=True)
        zk_port = ports["zookeeper"][0]
        cluster = LocalCluster(
            directory=directory,
            cluster_root=CLUSTER_ROOT,
            cluster_name=CLUSTER_NAME,
            num_partitions=opts.partitions,
            groups=opts.group_count,
            zookeeper=ProcessRecord(
                kind="zookeeper",
                index=0,
                port=zk_port,
                http_port=0,
                data_dir=str(directory / "zookeeper"),
                log=str(logs / "zookeeper.log"),
            ),
            zk_session_timeout_ms=opts.zk_session_timeout_ms,
            tls=opts.tls,
            zk_tls=opts.tls,
        )
        sp = ports["storage"]
        for i in range(opts.storages):
            cluster.storages.append(
                ProcessRecord(
                    kind="storage",
                    index=i,
                    port=sp[3 * i],
                    admin_port=sp[3 * i + 1],
                    http_port=sp[3 * i + 2],
                    group=i % opts.group_count,
                    data_dir=str(directory / f"storage-{i}"),
                    config=str(directory / f"storage-{i}.yaml"),
                    log=str(logs / f"storage-{i}.log"),
                    stdout=str(logs / f"storage-{i}.out"),
                )
            )
        vp = ports["server"]
        for i in range(opts.servers):
            cluster.servers.append(
                ProcessRecord(
                    kind="server",
                    index=i,
                    port=vp[2 * i],
                    http_port=vp[2 * i + 1],
                    data_dir="",
                    config=str(directory / f"server-{i}.yaml"),
                    log=str(logs / f"server-{i}.log"),
                    stdout=str(logs / f"server-{i}.out"),
                )
            )
        cluster.save()
        try:
            _bring_up(cluster, opts, report)
        except BaseException:
            _teardown(cluster)
            _remove_data(cluster)
            raise
        return cluster


def _bring_up(cluster: LocalCluster, opts: UpOptions, report: Report) -> None:
    timeout_s = opts.start_timeout_s
    if cluster.tls:
        # Before ZooKeeper: with TLS it serves its port with one of these certificates.
        report(f"making a throwaway CA and certificates in {cluster.tls_dir}")
        certs.make_local_pki(cluster.tls_dir, TLS_NAMES)
    report(f"starting ZooKeeper on {cluster.zk_connect}{' (TLS only)' if cluster.zk_tls else ''}")
    _start_zookeeper(cluster, timeout_s)

    report(
        f"creating cluster {cluster.cluster_name!r} at {cluster.cluster_root}: "
        f"{cluster.num_partitions} partitions"
    )
    _make_zk_credentials(cluster)
    client = _zk_connect(cluster, 10_000)
    try:
        store = sm.create_cluster(client, cluster.cluster_root, cluster.cluster_name, cluster.num_partitions)
        for rec in cluster.storages:
            sm.add_storage_node(client, cluster.cluster_root, rec.address, rec.group, rec.admin_port)
        for group in range(cluster.groups):
            assigned = sm.auto_assign(client, cluster.cluster_root, group)
            for rec in cluster.storages:
                if rec.address in assigned:
                    rec.partitions = sorted(assigned[rec.address])
    finally:
        zkutil.close(client)
    cluster.save()

    for rec in cluster.storages:
        mkdir_durable(rec.data_dir)  # its entry durable before the node writes its control file inside
        _write_yaml(Path(rec.config), _storage_config(cluster, rec, opts.segment_size_bytes))
    for rec in cluster.servers:
        _write_yaml(Path(rec.config), _server_config(cluster, rec))

    report(f"starting {len(cluster.storages)} storage nodes")
    for rec in cluster.storages:
        if opts.before_storage_start is not None:
            opts.before_storage_start(rec)
        _start_process(rec, timeout_s)
        cluster.save()
    asyncio.run(
        _assign_on_nodes(
            [(r.admin_port, r.partitions) for r in cluster.storages],
            store.cluster_key,
            cluster.num_partitions,
            timeout_s,
            _admin_ssl(cluster),
        )
    )
    report(f"starting {len(cluster.servers)} servers")
    for rec in cluster.servers:
        _start_process(rec, timeout_s)
        cluster.save()
    report("waiting until every partition is served")
    _wait_served(cluster, timeout_s)
    _write_yaml(cluster.client_config_path, _client_config(cluster))
    _write_yaml(cluster.directory / ADMIN_CONFIG_FILE, _admin_config(cluster))
    cluster.state = "running"
    cluster.save()


def down(directory: str | Path, *, purge: bool = False) -> list[str]:
    """Stop every process of the cluster in ``directory`` (servers, storage nodes, ZooKeeper), by pid.

    Returns the names of the processes that were running. ``purge`` also deletes what ``up`` created (see
    :func:`purge`).
    """
    cluster = LocalCluster.load(directory)
    with _locked(cluster.directory):
        stopped = _teardown(cluster)
        cluster.state = "stopped"
        cluster.save()
    if purge:
        _purge(cluster)
    return stopped


def _purge(cluster: LocalCluster) -> list[Path]:
    """Delete exactly what ``up`` created: each process's data directory, config, output and log, the TLS
    files, ``client.yaml``, ``cluster.json`` and the lock; then ``logs/`` and the directory itself if nothing
    else is left in them. Returns what was left (files someone else put there)."""
    d = cluster.directory
    _remove_data(cluster)
    for rec in cluster.processes:
        if rec.log:
            Path(rec.log).unlink(missing_ok=True)
    (d / LOCK_FILE).unlink(missing_ok=True)
    for empty in (d / "logs", d):
        with contextlib.suppress(OSError):  # not empty (or already gone): keep it
            empty.rmdir()
    return sorted(d.rglob("*")) if d.exists() else []


def _start_zookeeper(cluster: LocalCluster, timeout_s: float) -> None:
    """Start ZooKeeper with the recorded data directory and port (its data, hence the cluster, survives)."""
    zk_rec = cluster.zookeeper
    # A listener on the port is someone else's (ours is not running); a bind test would also fail on the
    # TIME_WAIT connections a killed ZooKeeper leaves behind, which ZooKeeper's own bind tolerates.
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", zk_rec.port), timeout=1.0):
        raise ClusterError(f"ZooKeeper's port {zk_rec.port} is in use by another process")
    zk = zkserver.ZooKeeperServer(zk_rec.data_dir, zk_rec.port, tls=_zk_server_tls(cluster))
    zk.spawn()
    if zk.process is None:
        raise ClusterError("ZooKeeper did not start")
    zk_rec.set_process(procs.adopt(zk.process))
    cluster.save()
    zk_log = Path(zk_rec.log)
    with contextlib.suppress(OSError):
        zk_log.unlink(missing_ok=True)
        zk_log.symlink_to(zk.log_path)
    zk.wait_serving(timeout_s)
    zk_rec.set_process(procs.identify(zk.process.pid))  # The JVM's start time is readable now for sure.


def kill(directory: str | Path, kind: str, index: int = 0) -> ProcessRecord:
    """SIGKILL one storage node, server or ZooKeeper (``kind="zookeeper"``), as in a crash (for drills)."""
    cluster = LocalCluster.load(directory)
    rec = cluster.zookeeper if kind == "zookeeper" else cluster.member(kind, index)
    with _locked(cluster.directory):
        if not procs.kill(rec.process):
            raise ClusterError(f"{rec.name} is not running")
        cluster.save()
    return rec


def start(
    directory: str | Path, kind: str, index: int, timeout_s: float = DEFAULT_START_TIMEOUT_S
) -> ProcessRecord:
    """Start a stopped storage node, server or ZooKeeper (``kind="zookeeper"``) again, with its config, ports
    and data."""
    cluster = LocalCluster.load(directory)
    rec = cluster.zookeeper if kind == "zookeeper" else cluster.member(kind, index)
    with _locked(cluster.directory):
        if cluster.state == "stopped":
            raise ClusterError(
                f"the cluster in {cluster.directory} is stopped; start it with `waltz local restart`"
            )
        if procs.is_alive(rec.process):
            raise ClusterError(f"{rec.name} is already running (pid {rec.pid})")
        if kind == "zookeeper":
            # Servers and storage nodes reconnect by themselves (within their ZooKeeper session timeout).
            _start_zookeeper(cluster, timeout_s)
            cluster.save()
            return rec
        if not procs.is_alive(cluster.zookeeper.process):
            raise ClusterError(
                f"ZooKeeper is not running: start it first with `waltz local start --dir {cluster.directory} "
                "--zookeeper`"
            )
        _start_process(rec, timeout_s)
        cluster.save()
        if kind == "storage" and rec.partitions:
            key = _cluster_key(cluster)
            asyncio.run(
                _assign_on_nodes(
                    [(rec.admin_port, rec.partitions)],
                    key,
                    cluster.num_partitions,
                    timeout_s,
                    _admin_ssl(cluster),
                )
            )
    return rec


def restart(
    directory: str | Path, report: Report = _quiet, timeout_s: float = DEFAULT_START_TIMEOUT_S
) -> LocalCluster:
    """Stop whatever runs of the cluster in ``directory``, then start all of it again with its recorded
    configs, ports and data (ZooKeeper, storage nodes, servers), and wait until every partition is served.
    Also starts a cluster stopped by ``down`` (without ``--purge``)."""
    cluster = LocalCluster.load(directory)
    with _locked(cluster.directory):
        stopped = _teardown(cluster)
        if stopped:
            report(f"stopped {', '.join(stopped)}")
        cluster.state = "starting"
        cluster.save()
        report(f"starting ZooKeeper on {cluster.zk_connect}")
        _start_zookeeper(cluster, timeout_s)
        cluster.save()
        report(f"starting {len(cluster.storages)} storage nodes")
        for rec in cluster.storages:
            _start_process(rec, timeout_s)
            cluster.save()
        report(f"starting {len(cluster.servers)} servers")
        for rec in cluster.servers:
            _start_process(rec, timeout_s)
            cluster.save()
        report("waiting until every partition is served")
        _wait_served(cluster, timeout_s)
        cluster.state = "running"
        cluster.save()
    return cluster


# --------------------------------------------------------------------------------------------------- status


@dataclass
class PartitionStatus:
    partition: int
    owner: str = "-"
    generation: int = -1
    healthy: bool = False
    high_water_mark: int | None = None
    replicas: dict[str, str] = field(default_factory=dict)


@dataclass
class ProcessStatus:
    name: str
    pid: int | None
    running: bool
    ports: str
    detail: str = ""


@dataclass
class ClusterStatus:
    directory: Path
    processes: list[ProcessStatus]
    partitions: list[PartitionStatus]
    zookeeper_ok: bool
    errors: list[str] = field(default_factory=list)
    tls: bool = False

    @property
    def all_served(self) -> bool:
        return bool(self.partitions) and all(p.healthy for p in self.partitions)

    def to_json(self) -> dict[str, Any]:
        return {
            "directory": str(self.directory),
            "zookeeper_ok": self.zookeeper_ok,
            "tls": self.tls,
            "processes": [vars(p) for p in self.processes],
            "partitions": [vars(p) for p in self.partitions],
            "errors": self.errors,
        }


def status(directory: str | Path) -> ClusterStatus:
    """Processes, partition owners, high-water marks and replica states of the cluster in ``directory``."""
    cluster = LocalCluster.load(directory)
    rows: list[ProcessStatus] = []
    for rec in cluster.processes:
        alive = procs.is_alive(rec.process)
        if rec.kind == "zookeeper":
            ports = f"{'TLS ' if cluster.zk_tls else ''}client {rec.port}"
            detail = rec.data_dir
        elif rec.kind == "storage":
            ports = f"data {rec.port}, admin {rec.admin_port}, http {rec.http_port}"
            detail = f"group {rec.group}, partitions {sm.format_ranges(rec.partitions) or '-'}"
        else:
            ports, detail = f"client {rec.port}, http {rec.http_port}", f"server id {rec.server_id}"
        rows.append(ProcessStatus(rec.name, rec.pid, alive, ports, detail))
    result = ClusterStatus(
        cluster.directory,
        rows,
        [PartitionStatus(p) for p in range(cluster.num_partitions)],
        zookeeper_ok=False,
        tls=cluster.tls,
    )
    by_id = {s.server_id: s for s in cluster.servers}
    hwm: dict[int, float] = {}
    healthy: set[int] = set()
    for rec in cluster.servers:
        if procs.is_alive(rec.process):
            healthy |= probe.served_partitions(rec.http_port)  # also refreshes the gauges read below
            hwm.update(probe.partition_gauges(rec.http_port, "waltz_server_high_water_mark"))
    # Why a process is unhealthy, in its own words (a partition that takes no appends, a failed task...).
    for rec in [*cluster.servers, *cluster.storages]:
        if rec.http_port and procs.is_alive(rec.process):
            result.errors.extend(f"{rec.name}: {problem}" for problem in probe.problems(rec.http_port))
    for p in result.partitions:
        p.healthy = p.partition in healthy
        if p.partition in hwm:
            p.high_water_mark = int(hwm[p.partition])
    if procs.is_alive(cluster.zookeeper.process):
        try:
            _zk_status(cluster, result, by_id)
            result.zookeeper_ok = True
        except WaltzError as e:
            result.errors.append(f"ZooKeeper: {e}")
    else:
        result.errors.append("ZooKeeper is not running")
    try:
        asyncio.run(_storage_status(cluster, result))
    except WaltzError as e:
        result.errors.append(f"storage: {e}")
    return result


def _zk_status(cluster: LocalCluster, result: ClusterStatus, by_id: dict[int, ProcessRecord]) -> None:
    client = _zk_connect(cluster, 3_000)
    try:
        info = sm.describe_cluster(client, cluster.cluster_root)
    finally:
        zkutil.close(client)
    live = {d.server_id for d in info.servers.values()}
    for server_id, parts in info.assignment.servers.items():
        rec = by_id.get(server_id)
        name = rec.name if rec is not None else f"server id {server_id}"
        if server_id not in live:
            name += " (not live)"
        for pid, generation in parts.items():
            if 0 <= pid < len(result.partitions):
                result.partitions[pid].owner = name
                result.partitions[pid].generation = generation
    storage_names = {s.address: s.name for s in cluster.storages}
    for pid, meta in info.partitions.items():
        if not 0 <= pid < len(result.partitions):
            continue
        for storage, state in meta.replicas.items():
            closing = state.closing_high_water_mark
            shown = "open" if closing == UNRESOLVED else f"closed at {closing}"
            result.partitions[pid].replicas[storage_names.get(storage, storage)] = (
                f"session {state.session_id} {shown}"
            )


async def _storage_status(cluster: LocalCluster, result: ClusterStatus) -> None:
    live = [s for s in cluster.storages if procs.is_alive(s.process)]
    if not live:
        return
    key = await asyncio.to_thread(_cluster_key, cluster) if result.zookeeper_ok else None
    ssl = _admin_ssl(cluster)
    for rec in cluster.storages:
        if rec not in live:
            for p in rec.partitions:
                result.partitions[p].replicas.setdefault(rec.name, "")
                result.partitions[p].replicas[rec.name] = (
                    f"{result.partitions[p].replicas[rec.name]}; DOWN".lstrip("; ")
                )
            continue
        if key is None:
            continue
        try:
            async with asyncio.timeout(5):
                admin = await AdminClient.connect(
                    procs.LOOPBACK, rec.admin_port, key, cluster.num_partitions, ssl=ssl
                )
                async with admin:
                    data = json.loads(await admin.metrics_json())
        except (WaltzError, OSError, TimeoutError) as e:
            result.errors.append(f"{rec.name}: admin port did not answer: {e!r}")
            continue
        for pid_s, p in data.get("partitions", {}).items():
            pid = int(pid_s)
            if not 0 <= pid < len(result.partitions):
                continue
            prefix = result.partitions[pid].replicas.get(rec.name, "")
            state = (
                f"max id {p['maxTransactionId']}, lwm {p['lowWaterMark']}, "
                f"{'available' if p['available'] else 'UNAVAILABLE'}"
            )
            result.partitions[pid].replicas[rec.name] = f"{prefix}; {state}".lstrip("; ")


def _tls_line(cluster: LocalCluster) -> str:
    if not cluster.tls:
        return "TLS: off"
    return (
        f"TLS: mutual, on every storage, server and client link; CA and certificates in {cluster.tls_dir}\n"
        f"ZooKeeper: {'TLS only, client certificates required, and ' if cluster.zk_tls else ''}digest ACLs "
        f"(credentials in {cluster.tls_dir}); operator config: {cluster.directory / ADMIN_CONFIG_FILE}"
    )


def render_status(st: ClusterStatus) -> str:
    lines = [
        f"cluster in {st.directory} ({'mutual TLS' if st.tls else 'plain TCP'})",
        "",
        f"{'process':<11} {'pid':>8}  {'state':<8} ports / details",
    ]
    for p in st.processes:
        state = "running" if p.running else "DOWN"
        lines.append(
            f"{p.name:<11} {p.pid if p.pid is not None else '-':>8}  {state:<8} {p.ports}; {p.detail}"
        )
    lines += ["", f"{'partition':>9}  {'owner':<12} {'gen':>4} {'served':<7} {'hwm':>8}  replicas"]
    for part in st.partitions:
        hwm = "-" if part.high_water_mark is None else str(part.high_water_mark)
        gen = "-" if part.generation < 0 else str(part.generation)
        lines.append(
            f"{part.partition:>9}  {part.owner:<12} {gen:>4} {'yes' if part.healthy else 'NO':<7} {hwm:>8}"
        )
        for name, state in sorted(part.replicas.items()):
            lines.append(f"{'':>44}{name}: {state}")
    for err in st.errors:
        lines.append(f"warning: {err}")
    return "\n".join(lines)


def render_up(cluster: LocalCluster) -> str:
    lines = [f"{'process':<11} {'pid':>8}  {'port':>6} {'admin':>6} {'http':>6}  data / details"]
    for rec in cluster.processes:
        admin = str(rec.admin_port) if rec.admin_port else "-"
        http = str(rec.http_port) if rec.http_port else "-"
        if rec.kind == "storage":
            detail = f"{rec.data_dir} (group {rec.group}, partitions {sm.format_ranges(rec.partitions)})"
        elif rec.kind == "server":
            detail = f"server id {rec.server_id}"
        else:
            detail = rec.data_dir
        lines.append(f"{rec.name:<11} {rec.pid or '-':>8}  {rec.port:>6} {admin:>6} {http:>6}  {detail}")
    lines += [
        "",
        f"ZooKeeper: {cluster.zk_connect}, cluster root {cluster.cluster_root}, "
        f"{cluster.num_partitions} partitions, {cluster.groups} replica group(s)",
        _tls_line(cluster),
        f"client config: {cluster.client_config_path}",
        f"logs: {cluster.directory / 'logs'}",
        f"stop with: waltz local down --dir {cluster.directory}",
    ]
    return "\n".join(lines)
