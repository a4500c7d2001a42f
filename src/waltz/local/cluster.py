"""A whole Waltz cluster on this machine, one OS process per component (the library under ``waltz local``).

:func:`up` starts, in order (the start-up order of docs/deploy.md): ZooKeeper (Debian's package, through
:mod:`waltz.cluster.zkserver`; with ``zookeepers=N`` an ensemble of N members, each with its own data
directory, ``myid`` and quorum and election ports, TLS on the links between them too with ``tls``), the
cluster metadata (``create_cluster``, ``add_storage_node``, ``auto_assign`` per group), the storage processes
(then tells each its partitions through the admin port), and the servers; it returns once every partition has
a server reporting it healthy. Each process listens on loopback ports (free ones, or consecutive ones from
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
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from ssl import SSLContext
from typing import Any

from waltz.cluster import store_metadata as sm
from waltz.cluster import zk as zkutil
from waltz.cluster import zkserver
from waltz.cluster.files import mkdir_durable
from waltz.errors import ClusterError, ConfigError
from waltz.local import certs, configs, probe, procs
from waltz.local.state import (
    CLIENT_CONFIG_FILE,
    DEFAULT_ZK_SESSION_TIMEOUT_MS,
    STATE_FILE,
    LocalCluster,
    ProcessRecord,
)
from waltz.server.storage_client import AdminClient

CLUSTER_ROOT = "/waltz/local"
CLUSTER_NAME = "local"
DEFAULT_START_TIMEOUT_S = 60.0
"""Time allowed for each process to report ready, and for all partitions to be served."""
MAX_STORAGES = 16
MAX_SERVERS = 16
MAX_PARTITIONS = 1024
MAX_ZOOKEEPERS = 7
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
    zookeepers: int = 1
    """1: one standalone ZooKeeper; 3, 5 or 7: an ensemble of that many members on loopback."""
    zk_session_timeout_ms: int = DEFAULT_ZK_SESSION_TIMEOUT_MS
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
        if self.zookeepers not in range(1, MAX_ZOOKEEPERS + 1, 2):
            raise ConfigError(
                f"--zookeepers must be 1 or an odd number up to {MAX_ZOOKEEPERS}, got {self.zookeepers}: "
                "an even ensemble survives no more failures than one member fewer"
            )
        if self.zk_port is not None and self.zk_port + self.zookeepers - 1 > 65535:
            raise ConfigError(f"--zk-port {self.zk_port} leaves no room for {self.zookeepers} ZooKeepers")
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
    if stem == "zookeeper" or (kind == "zookeeper" and index.isdigit()):
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
    """Ports for every process: ``{"zookeeper": [client, ...], "quorum": [quorum, election, ...], "storage":
    [data, admin, http, ...], "server": [...]}``.

    With ``base_port`` they are consecutive from it and each must be free now; otherwise the OS picks.
    ZooKeeper's client ports are ``zk_port``, ``zk_port + 1``, ... with ``zk_port``; an ensemble's quorum and
    election ports are always picked by the OS.
    """
    need = 3 * opts.storages + 2 * opts.servers
    if opts.base_port is not None:
        ports = list(range(opts.base_port, opts.base_port + need))
        if ports[-1] > 65535:
            raise ConfigError(f"--base-port {opts.base_port} leaves no room for {need} ports")
    zk_fixed = [] if opts.zk_port is None else list(range(opts.zk_port, opts.zk_port + opts.zookeepers))
    if opts.base_port is not None:
        if set(zk_fixed) & set(ports):
            raise ConfigError(f"--zk-port {opts.zk_port} falls inside the --base-port range")
    else:
        ports = procs.free_ports(need, exclude=frozenset(zk_fixed))
    ensemble = opts.zookeepers > 1
    extra = procs.free_ports(
        (0 if zk_fixed else opts.zookeepers) + (2 * opts.zookeepers if ensemble else 0),
        exclude=frozenset(ports) | frozenset(zk_fixed),
    )
    zk_ports = zk_fixed or extra[: opts.zookeepers]
    quorum_ports = extra[len(extra) - 2 * opts.zookeepers :] if ensemble else []
    labels = [f"ZooKeeper {i} client port" for i in range(opts.zookeepers)]
    if not ensemble:
        labels = ["ZooKeeper client port"]
    for i in range(opts.zookeepers if ensemble else 0):
        labels += [f"ZooKeeper {i} quorum port", f"ZooKeeper {i} election port"]
    for i in range(opts.storages):
        labels += [f"storage {i} data port", f"storage {i} admin port", f"storage {i} HTTP port"]
    for i in range(opts.servers):
        labels += [f"server {i} client port", f"server {i} HTTP port"]
    for label, port in zip(labels, [*zk_ports, *quorum_ports, *ports], strict=True):
        if procs.port_in_use(port):
            raise ConfigError(f"port {port} ({label}) is already in use on 127.0.0.1")
    return {
        "zookeeper": zk_ports,
        "quorum": quorum_ports,
        "storage": ports[: 3 * opts.storages],
        "server": ports[3 * opts.storages :],
    }


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
    order = [*reversed(cluster.servers), *reversed(cluster.storages), *reversed(cluster.zookeepers)]
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
    for name in (STATE_FILE, CLIENT_CONFIG_FILE, configs.ADMIN_CONFIG_FILE):
        (d / name).unlink(missing_ok=True)
    shutil.rmtree(cluster.tls_dir, ignore_errors=True)


# ------------------------------------------------------------------------------------------------- commands


def _planned(opts: UpOptions, directory: Path, ports: dict[str, list[int]]) -> LocalCluster:
    """The record of the cluster ``up`` is about to start: every process with its ports, files and group."""
    logs = directory / "logs"
    ensemble = len(ports["zookeeper"]) > 1
    zookeepers = [
        ProcessRecord(
            kind="zookeeper",
            index=i,
            port=port,
            http_port=0,
            data_dir=str(directory / (f"zookeeper-{i}" if ensemble else "zookeeper")),
            log=str(logs / (f"zookeeper-{i}.log" if ensemble else "zookeeper.log")),
            quorum_port=ports["quorum"][2 * i] if ensemble else 0,
            election_port=ports["quorum"][2 * i + 1] if ensemble else 0,
        )
        for i, port in enumerate(ports["zookeeper"])
    ]
    cluster = LocalCluster(
        directory=directory,
        cluster_root=CLUSTER_ROOT,
        cluster_name=CLUSTER_NAME,
        num_partitions=opts.partitions,
        groups=opts.group_count,
        zookeepers=zookeepers,
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
    return cluster


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
        cluster = _planned(opts, directory, ports)
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
        certs.make_local_pki(cluster.tls_dir, configs.TLS_NAMES)
    ensemble = f"a {len(cluster.zookeepers)}-member ensemble" if cluster.is_ensemble else "ZooKeeper"
    report(f"starting {ensemble} on {cluster.zk_connect}{' (TLS only)' if cluster.zk_tls else ''}")
    _start_zookeepers(cluster, timeout_s)

    report(
        f"creating cluster {cluster.cluster_name!r} at {cluster.cluster_root}: "
        f"{cluster.num_partitions} partitions"
    )
    configs.make_zk_credentials(cluster)
    client = configs.zk_connect(cluster, 10_000)
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
        configs.write_yaml(Path(rec.config), configs.storage_config(cluster, rec, opts.segment_size_bytes))
    for rec in cluster.servers:
        configs.write_yaml(Path(rec.config), configs.server_config(cluster, rec))

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
            configs.admin_ssl(cluster),
        )
    )
    report(f"starting {len(cluster.servers)} servers")
    for rec in cluster.servers:
        _start_process(rec, timeout_s)
        cluster.save()
    report("waiting until every partition is served")
    _wait_served(cluster, timeout_s)
    configs.write_yaml(cluster.client_config_path, configs.client_config(cluster))
    configs.write_yaml(cluster.directory / configs.ADMIN_CONFIG_FILE, configs.admin_config(cluster))
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


def _zk_server(cluster: LocalCluster, rec: ProcessRecord) -> zkserver.ZooKeeperServer:
    """The launcher of one recorded ZooKeeper: standalone, or ensemble member ``index + 1``."""
    peers = [(z.index + 1, z.quorum_port, z.election_port) for z in cluster.zookeepers]
    return zkserver.ZooKeeperServer(
        rec.data_dir,
        rec.port,
        server_id=rec.index + 1 if cluster.is_ensemble else None,
        peers=peers if cluster.is_ensemble else None,
        tls=configs.zk_server_tls(cluster),
    )


def _start_zookeepers(
    cluster: LocalCluster, timeout_s: float, members: list[ProcessRecord] | None = None
) -> bool:
    """Start ZooKeeper (every member of an ensemble, or just ``members``) with the recorded data directories
    and ports (its data, hence the cluster, survives), and wait until each serves. An ensemble member serves
    only once a majority of the members runs: without one, returns False at once instead of waiting."""
    started: list[tuple[ProcessRecord, zkserver.ZooKeeperServer]] = []
    for rec in cluster.zookeepers if members is None else members:
        # A listener on the port is someone else's (ours is not running); a bind test would also fail on the
        # TIME_WAIT connections a killed ZooKeeper leaves behind, which ZooKeeper's own bind tolerates.
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", rec.port), timeout=1.0):
            raise ClusterError(f"{rec.name}'s port {rec.port} is in use by another process")
        zk = _zk_server(cluster, rec)
        zk.spawn()
        if zk.process is None:
            raise ClusterError(f"{rec.name} did not start")
        rec.set_process(procs.adopt(zk.process))
        cluster.save()
        zk_log = Path(rec.log)
        with contextlib.suppress(OSError):
            zk_log.unlink(missing_ok=True)
            zk_log.symlink_to(zk.log_path)
        started.append((rec, zk))
    running = sum(procs.is_alive(z.process) for z in cluster.zookeepers)
    if 2 * running <= len(cluster.zookeepers):
        return False
    for rec, zk in started:
        zk.wait_serving(timeout_s)
        assert zk.process is not None
        rec.set_process(procs.identify(zk.process.pid))  # The JVM's start time is readable now for sure.
    return True


def kill(directory: str | Path, kind: str, index: int = 0) -> ProcessRecord:
    """SIGKILL one storage node, server or ZooKeeper (``kind="zookeeper"``, ``index`` an ensemble member),
    as in a crash (for drills)."""
    cluster = LocalCluster.load(directory)
    rec = cluster.zookeeper_member(index) if kind == "zookeeper" else cluster.member(kind, index)
    with _locked(cluster.directory):
        if not procs.kill(rec.process):
            raise ClusterError(f"{rec.name} is not running")
        cluster.save()
    return rec


def start(
    directory: str | Path, kind: str, index: int, timeout_s: float = DEFAULT_START_TIMEOUT_S
) -> ProcessRecord:
    """Start a stopped storage node, server or ZooKeeper (``kind="zookeeper"``, ``index`` an ensemble member)
    again, with its config, ports and data. An ensemble member is waited for only if a majority of the
    members then runs (it cannot serve before)."""
    cluster = LocalCluster.load(directory)
    rec = cluster.zookeeper_member(index) if kind == "zookeeper" else cluster.member(kind, index)
    with _locked(cluster.directory):
        if cluster.state == "stopped":
            raise ClusterError(
                f"the cluster in {cluster.directory} is stopped; start it with `waltz local restart`"
            )
        if procs.is_alive(rec.process):
            raise ClusterError(f"{rec.name} is already running (pid {rec.pid})")
        if kind == "zookeeper":
            # Servers and storage nodes reconnect by themselves (within their ZooKeeper session timeout).
            _start_zookeepers(cluster, timeout_s, [rec])
            cluster.save()
            return rec
        if not any(procs.is_alive(z.process) for z in cluster.zookeepers):
            raise ClusterError(
                f"ZooKeeper is not running: start it first with `waltz local start --dir {cluster.directory} "
                "--zookeeper`"
            )
        _start_process(rec, timeout_s)
        cluster.save()
        if kind == "storage" and rec.partitions:
            key = configs.cluster_key(cluster)
            asyncio.run(
                _assign_on_nodes(
                    [(rec.admin_port, rec.partitions)],
                    key,
                    cluster.num_partitions,
                    timeout_s,
                    configs.admin_ssl(cluster),
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
        _start_zookeepers(cluster, timeout_s)
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
