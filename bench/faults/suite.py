"""The black-box fault suite: a real ``waltz local`` cluster, application processes, seeded faults, checks.

One run (:func:`run_seed`), bounded in time, stops everything it started:

1. ``waltz local up`` (3 storage nodes, 2 servers, a few partitions, ZooKeeper session timeout 6 s), then
   every storage node's data port and every server's client port is moved behind a :class:`LinkProxy` that
   keeps the address the cluster knows (storage nodes: restarted on a new port; servers: restarted on a new
   port with ``server.advertisedAddress`` naming the proxy). So every server->storage and client->server link
   goes through a relay the suite can cut.
2. ``apps`` application processes (:mod:`bench.faults.app`) append uniquely tagged transactions under
   contended write locks through the public client library, for the whole fault phase and the recovery
   window after it.
3. The seed picks the fault schedule (printed before the run; :func:`schedule`): kill -9 and SIGSTOP/SIGCONT
   of a storage node, a server or ZooKeeper, two storage nodes down at once, a cut of all links to one storage
   node (server<->storage) or to one server (client<->server), and the owner faults of
   :mod:`bench.faults.owner` (one server cut from ZooKeeper alone, or stopped, past its session); only when
   named in ``kinds``, the power cuts of :mod:`bench.faults.power` (one storage node, or the whole cluster, on
   powerfs mounts). Faults run one after the other, each healed before the next, with a random gap.
4. Checks (:func:`verify`), after the last fault was healed:

   * no partition is stuck: every partition acknowledges a new append within ``stuck_bound_s`` of the heal;
   * no client is stranded: through that quiet period (until every app has had an append acknowledged on every
     partition, at most ``stuck_bound_s``), no app goes without acknowledgements on a partition that
     acknowledges the other apps' appends (:func:`bench.faults.owner.check_stranded`);
   * every transaction an app saw acknowledged is in the log (read through the servers with
     :class:`~waltz.client.reader.LogReader`; if they do not serve it, each partition's longest replica, read
     through the storage nodes' admin ports, and that is a problem too) exactly once, in the partition it was
     sent to, and no tag is in the log twice at all (nothing committed twice);
   * ids are dense: every partition's log is ``0..hwm`` with no gap;
   * every replica (read through each storage node's admin port) holds, below the committed high-water mark,
     byte for byte the records the servers serve; replicas get ``catch_up_bound_s`` to catch up first.

Replay a seed: ``python -m bench.faults --seeds 17`` (the schedule depends only on the seed and the fault
options; the cluster's own timing is not deterministic, so a replay repeats the faults, not every
interleaving).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml
from bench.faults.owner import (
    OWNER_KINDS,
    check_stranded,
    owner_fault_s,
    start_zookeeper_link,
    stranded_pairs,
)
from bench.faults.power import POWER_KINDS, PowerCuts
from bench.faults.proxy import LinkProxy

from waltz import local
from waltz.client.config import ClientConfig
from waltz.client.reader import LogReader
from waltz.cluster import store_metadata as sm
from waltz.cluster import zk as zkutil
from waltz.local import configs, probe, procs
from waltz.local.state import LocalCluster
from waltz.ops.features import raise_features
from waltz.protocol.records import Record
from waltz.server.storage_client import AdminClient

ZK_SESSION_TIMEOUT_MS = 6000
STORAGE_KINDS = ("kill9-storage", "sigstop-storage", "two-storages-down", "cut-server-storage")
SERVER_KINDS = ("kill9-server", "sigstop-server", "cut-client-server")
ZK_KINDS = ("kill9-zookeeper", "sigstop-zookeeper")
ALL_KINDS = STORAGE_KINDS + SERVER_KINDS + ZK_KINDS + OWNER_KINDS
KNOWN_KINDS = ALL_KINDS + POWER_KINDS
"""Every kind ``--kinds`` accepts; the power cuts (:mod:`bench.faults.power`) are drawn only when named."""
READ_CHUNK_RECORDS = 500
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Options:
    """One run's shape (the seed picks the faults)."""

    storages: int = 3
    servers: int = 2
    partitions: int = 4
    apps: int = 3
    fault_phase_s: float = 40.0
    """Faults start within this many seconds of the apps' start (the last one may end a little later)."""
    max_fault_s: float = 6.0
    """Longest single fault (a process down or stopped, a link cut), except the faults that must outlast the
    ZooKeeper session: long ZooKeeper pauses and the owner faults (``bench.faults.owner.owner_fault_s``)."""
    long_zk_pauses: bool = True
    """Allow SIGSTOP of ZooKeeper longer than the session timeout (sessions expire together): half of the
    pauses drawn, and the one pause of an ``each_kind_once`` run. False keeps every pause below it."""
    kinds: tuple[str, ...] = ALL_KINDS
    each_kind_once: bool = False
    """Inject every kind exactly once, in an order the seed picks (the CI run), instead of drawing kinds until
    ``fault_phase_s`` is over."""
    gap_s: tuple[float, float] = (1.0, 4.0)
    """Quiet time between one fault's heal and the next fault (drawn uniformly)."""
    stuck_bound_s: float = 30.0
    catch_up_bound_s: float = 30.0
    start_timeout_s: float = 90.0
    run_bound_s: float = 600.0
    """Hard limit on the whole run, set-up and checks included."""
    apps_grace_s: float = 120.0
    """How long the apps get, after the stuck check, to see their last appends end and exit."""
    fsync_noop: bool = False
    """With a power kind: fsync does nothing on the storage nodes' mounts (the negative control)."""
    zk_strict_posix: bool = False
    """With a power kind: ZooKeeper's mount keeps the strict model (see :mod:`bench.faults.power`)."""
    feature_version: int | None = None
    """Raise the cluster's feature version to this once it serves (None: the newest this release supports,
    as an operator does after an upgrade; 1: leave it, the formats and requests of 0.1.0)."""


@dataclass(frozen=True)
class Fault:
    at_s: float
    kind: str
    targets: tuple[int, ...]
    duration_s: float

    def describe(self) -> str:
        who = ",".join(str(t) for t in self.targets)
        return f"t+{self.at_s:5.1f}s {self.kind}[{who}] for {self.duration_s:.1f}s"


def schedule(seed: int, opts: Options) -> list[Fault]:
    """The faults of one seed, in time order, each healed before the next starts."""
    rng = random.Random(seed)
    faults: list[Fault] = []
    t = rng.uniform(2.0, 4.0)
    session_s = ZK_SESSION_TIMEOUT_MS / 1000
    order = rng.sample(opts.kinds, len(opts.kinds)) if opts.each_kind_once else []
    while order if opts.each_kind_once else t < opts.fault_phase_s:
        kind = order.pop() if opts.each_kind_once else rng.choice(opts.kinds)
        duration = rng.uniform(1.0, opts.max_fault_s)
        if kind == "two-storages-down":
            targets = tuple(sorted(rng.sample(range(opts.storages), 2)))
        elif kind in STORAGE_KINDS:
            targets = (rng.randrange(opts.storages),)
        elif kind in SERVER_KINDS or kind in OWNER_KINDS:
            targets = (rng.randrange(opts.servers),)
        elif kind == "power-storage":
            targets = (rng.randrange(opts.storages),)
        else:
            targets = (0,)
        if kind == "sigstop-zookeeper":
            if opts.long_zk_pauses and (opts.each_kind_once or rng.random() < 0.5):
                duration = rng.uniform(session_s + 1, session_s + 4)
            else:
                # Shorter than the session timeout: no session may expire.
                duration = rng.uniform(1.0, min(opts.max_fault_s, 0.7 * session_s))
        elif kind in OWNER_KINDS:
            duration = owner_fault_s(rng, session_s)
        faults.append(Fault(round(t, 2), kind, targets, round(duration, 2)))
        t += duration + rng.uniform(*opts.gap_s)
    return faults


@dataclass
class Result:
    seed: int
    ok: bool
    faults: list[str]
    problems: list[str] = field(default_factory=list)
    acked: int = 0
    log_records: dict[int, int] = field(default_factory=dict)
    app_counts: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    """Facts that are not failures: contexts a client gave up on, and whether they committed."""
    resume_s: float | None = None
    """Seconds from the last heal until every partition acknowledged a new append."""
    elapsed_s: float = 0.0
    directory: str = ""

    def summary(self) -> str:
        verdict = "PASS" if self.ok else "FAIL"
        resume = "-" if self.resume_s is None else f"{self.resume_s:.1f}s"
        line = (
            f"seed {self.seed}: {verdict} in {self.elapsed_s:.0f}s, {len(self.faults)} faults, "
            f"{self.acked} acknowledged, log {self.log_records}, appends resumed after {resume}, "
            f"apps {self.app_counts}"
        )
        return "\n  ".join([line, *self.problems, *(f"note: {n}" for n in self.notes)])


Report = Callable[[str], None]


def _print(text: str) -> None:
    print(text, flush=True)


class Harness:
    """The cluster, its proxies and the apps of one run; :meth:`aclose` stops all of them."""

    def __init__(self, directory: Path, seed: int, opts: Options, report: Report) -> None:
        self.directory = directory
        self.seed = seed
        self.opts = opts
        self.report = report
        self.storage_proxies: list[LinkProxy] = []
        self.server_proxies: list[LinkProxy] = []
        self.zookeeper_links: list[LinkProxy] = []
        """Each server's own link to ZooKeeper (see bench.faults.owner)."""
        self.apps: list[subprocess.Popen[bytes]] = []
        self.stopped_pids: set[int] = set()
        self.cluster_up = False
        self.t0 = time.monotonic()
        self.stop_file = directory / "stop-apps"
        self.failed_tags: dict[str, str] = {}
        """Contexts whose client gave up with an error (the outcome of their last append may be unknown)."""
        self.notes: list[str] = []
        self.power = (
            PowerCuts(
                directory,
                fsync_noop=opts.fsync_noop,
                zk_strict_posix=opts.zk_strict_posix,
                start_timeout_s=opts.start_timeout_s,
            )
            if set(opts.kinds) & set(POWER_KINDS)
            else None
        )
        """The powerfs mounts, when the run cuts power."""
        self.pending_tags: list[str] = []
        """Contexts an app still waited for when it gave up: neither committed nor failed long after the
        cluster healed (a request dropped without an answer, or a commit the client missed)."""

    def log(self, text: str) -> None:
        self.report(f"[seed {self.seed} {time.monotonic() - self.t0:6.1f}s] {text}")

    def cluster(self) -> LocalCluster:
        return LocalCluster.load(self.directory)

    # -- set-up --------------------------------------------------------------------------------------------

    async def start_cluster(self) -> None:
        opts = self.opts
        up = local.UpOptions(
            directory=self.directory,
            storages=opts.storages,
            servers=opts.servers,
            partitions=opts.partitions,
            zk_session_timeout_ms=ZK_SESSION_TIMEOUT_MS,
            start_timeout_s=opts.start_timeout_s,
            before_storage_start=None if self.power is None else self.power.mount_storage,
        )
        self.cluster_up = True
        for attempt in range(3):
            try:
                await asyncio.to_thread(local.up, up)
                break
            except procs.ProcessStartError as e:
                # A free port taken by another process between `up` choosing it and a node binding it (the
                # machine is shared): `up` cleaned up after itself, so try again with new ports.
                if "Address already in use" not in str(e) or attempt == 2:
                    raise
                if self.power is not None:
                    await asyncio.to_thread(self.power.unmount_all)
                self.log("a port was taken during start-up; starting the cluster again")
        if self.power is not None:
            await asyncio.to_thread(self.power.mount_zookeeper)
        cluster = self.cluster()
        # Move every listener behind a proxy on the address the rest of the cluster already knows.
        for rec in cluster.storages:
            real = procs.free_ports(1)[0]
            await asyncio.to_thread(procs.stop, rec.process)
            _edit_yaml(Path(rec.config), {"storage.port": real})
            self.storage_proxies.append(await LinkProxy.start(rec.name, rec.port, real))
            await asyncio.to_thread(local.start, self.directory, "storage", rec.index, opts.start_timeout_s)
        for rec in cluster.servers:
            real = procs.free_ports(1)[0]
            await asyncio.to_thread(procs.stop, rec.process)
            zookeeper_link = await start_zookeeper_link(rec.name, cluster.zookeeper.port)
            self.zookeeper_links.append(zookeeper_link)
            _edit_yaml(
                Path(rec.config),
                {
                    "server.port": real,
                    "server.advertisedAddress": f"{procs.LOOPBACK}:{rec.port}",
                    "zookeeper.connectString": zookeeper_link.endpoint,
                },
            )
            self.server_proxies.append(await LinkProxy.start(rec.name, rec.port, real))
            await asyncio.to_thread(local.start, self.directory, "server", rec.index, opts.start_timeout_s)
        await self.wait_served(opts.start_timeout_s)
        if opts.feature_version != 1:
            old, new = await asyncio.to_thread(self.raise_features, opts.feature_version)
            self.log(f"feature version raised from {old} to {new}")
        self.log("cluster up, every link behind a proxy")

    def raise_features(self, target: int | None) -> tuple[int, int]:
        cluster = self.cluster()
        client = configs.zk_connect(cluster, 10_000)
        try:
            return raise_features(client, cluster.cluster_root, target, configs.admin_ssl(cluster))
        finally:
            zkutil.close(client)

    async def wait_served(self, timeout_s: float) -> None:
        wanted = set(range(self.opts.partitions))
        deadline = time.monotonic() + timeout_s
        while True:
            served: set[int] = set()
            for rec in self.cluster().servers:
                served |= await asyncio.to_thread(probe.served_partitions, rec.http_port)
            if wanted <= served:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"partitions {sorted(wanted - served)} not served within {timeout_s:g}s")
            await asyncio.sleep(0.5)

    def start_apps(self, duration_s: float) -> None:
        for i in range(self.opts.apps):
            out = self.directory / f"acks-{i}.jsonl"
            cmd = [
                sys.executable,
                "-m",
                "bench.faults.app",
                "--config",
                str(self.directory / "client.yaml"),
                "--app",
                str(i),
                "--seed",
                str(self.seed),
                "--duration-s",
                f"{duration_s:.1f}",
                "--out",
                str(out),
                "--stop-file",
                str(self.stop_file),
            ]
            with (self.directory / "logs" / f"app-{i}.log").open("ab") as log:
                self.apps.append(
                    subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=_app_env())
                )

    # -- faults --------------------------------------------------------------------------------------------

    async def inject(self, fault: Fault) -> None:
        kind, targets, duration = fault.kind, fault.targets, fault.duration_s
        self.log(f"inject {fault.describe()}")
        if kind in ("kill9-storage", "two-storages-down"):
            await self._kill_for("storage", targets, duration)
        elif kind == "kill9-server":
            await self._kill_for("server", targets, duration)
        elif kind in ("sigstop-storage", "sigstop-server", "sigstop-zookeeper"):
            cluster = self.cluster()
            rec = (
                cluster.zookeeper
                if kind == "sigstop-zookeeper"
                else cluster.member(kind.removeprefix("sigstop-"), targets[0])
            )
            await self._pause_for(rec.pid, duration)
        elif kind == "zombie-server":
            await self._pause_for(self.cluster().member("server", targets[0]).pid, duration)
        elif kind == "kill9-zookeeper":
            await self._kill_for("zookeeper", targets, duration)
        elif kind == "cut-server-storage":
            await self._cut_for(self.storage_proxies[targets[0]], duration)
        elif kind == "cut-client-server":
            await self._cut_for(self.server_proxies[targets[0]], duration)
        elif kind in POWER_KINDS:
            await self._power_cut(kind, targets, duration)
        elif kind == "cut-server-zookeeper":
            await self._cut_for(self.zookeeper_links[targets[0]], duration)
        else:
            raise ValueError(f"unknown fault {kind}")
        self.log(f"healed {kind}{list(targets)}")

    async def _pause_for(self, pid: int | None, duration_s: float) -> None:
        assert pid is not None
        self._signal(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(duration_s)
        finally:
            self._signal(pid, signal.SIGCONT)

    def _signal(self, pid: int, sig: signal.Signals) -> None:
        if sig == signal.SIGSTOP:
            self.stopped_pids.add(pid)
        else:
            self.stopped_pids.discard(pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)

    async def _kill_for(self, kind: str, targets: tuple[int, ...], duration_s: float) -> None:
        for index in targets:
            await asyncio.to_thread(local.kill, self.directory, kind, index)
        await asyncio.sleep(duration_s)
        for index in targets:
            await asyncio.to_thread(local.start, self.directory, kind, index, self.opts.start_timeout_s)

    async def _power_cut(self, kind: str, targets: tuple[int, ...], duration_s: float) -> None:
        assert self.power is not None
        if kind == "power-storage":
            await asyncio.to_thread(self.power.cut_storage, targets[0])
            await asyncio.sleep(duration_s)
            await asyncio.to_thread(self.power.restore_storage, targets[0])
        else:
            await asyncio.to_thread(self.power.cut_cluster)
            await asyncio.sleep(duration_s)
            await asyncio.to_thread(self.power.restore_cluster)

    @staticmethod
    async def _cut_for(proxy: LinkProxy, duration_s: float) -> None:
        proxy.cut()
        try:
            await asyncio.sleep(duration_s)
        finally:
            proxy.restore()

    # -- checks --------------------------------------------------------------------------------------------

    def read_acks(self) -> tuple[dict[str, tuple[int, float]], dict[str, int], list[str]]:
        """({tag: (partition, ack time)}, summed app counts, problems) from the apps' output files."""
        acks: dict[str, tuple[int, float]] = {}
        counts: dict[str, int] = {}
        problems: list[str] = []
        for i in range(self.opts.apps):
            path = self.directory / f"acks-{i}.jsonl"
            if not path.exists():
                problems.append(f"app {i} wrote no output")
                continue
            for line in path.read_text(encoding="utf-8").splitlines():
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)
                except ValueError:
                    continue  # A line cut short by a killed app.
                if "failed" in value:
                    self.failed_tags[value["failed"]] = value["error"]
                    continue
                if "summary" in value:
                    for k, v in value["summary"].items():
                        counts[k] = counts.get(k, 0) + int(v)
                    self.pending_tags += value.get("pending_tags", [])
                    continue
                if value["tag"] in acks:
                    problems.append(f"app {i} acknowledged {value['tag']} twice")
                acks[value["tag"]] = (int(value["partition"]), float(value["t"]))
        return acks, counts, problems

    async def wait_apps_appending(self, timeout_s: float) -> None:
        """Wait until every app has had an append acknowledged, so that the first fault hits a running
        workload (clients mounted, appends in flight) rather than clients still starting up."""
        deadline = time.monotonic() + timeout_s
        while True:
            started = {
                i
                for i in range(self.opts.apps)
                if (path := self.directory / f"acks-{i}.jsonl").exists() and path.stat().st_size > 0
            }
            if len(started) == self.opts.apps:
                return
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.opts.apps)) - started)
                raise RuntimeError(f"apps {missing} acknowledged nothing within {timeout_s:g}s")
            await asyncio.sleep(0.2)

    async def wait_progress(self, healed_at: float) -> tuple[float | None, list[str]]:
        """Seconds after ``healed_at`` (wall clock) until every partition acknowledged an append, and the
        problems of the quiet period after it: a partition that acknowledged nothing (stuck), an app that got
        nothing on a partition that acknowledged others' appends (stranded). The quiet period lasts until
        every app has had an append acknowledged on every partition, at most ``stuck_bound_s``."""
        opts = self.opts
        deadline = time.monotonic() + opts.stuck_bound_s
        while True:
            acks, _, _ = self.read_acks()
            first: dict[int, float] = {}
            for partition, t in acks.values():
                if t > healed_at and (partition not in first or t < first[partition]):
                    first[partition] = t
            resume_s = max(first.values()) - healed_at if len(first) == opts.partitions else None
            done = stranded_pairs(acks, healed_at, opts.apps, opts.partitions) == 0
            if done or time.monotonic() > deadline or all(app.poll() is not None for app in self.apps):
                break
            await asyncio.sleep(0.5)
        problems = check_stranded(acks, healed_at, opts.apps, opts.partitions)
        stuck = sorted(set(range(opts.partitions)) - set(first))
        if stuck:
            bound = f"{opts.stuck_bound_s:g}s"
            problems.insert(
                0, f"stuck: partitions {stuck} acknowledged no append within {bound} of the last heal"
            )
        return resume_s, problems

    async def wait_apps(self, timeout_s: float) -> list[str]:
        problems = []
        deadline = time.monotonic() + timeout_s
        for i, app in enumerate(self.apps):
            while app.poll() is None and time.monotonic() < deadline:  # noqa: ASYNC110 - polling a child
                await asyncio.sleep(0.2)
            if app.poll() is None:
                problems.append(f"app {i} did not finish within its bound; killed")
                app.kill()
                await asyncio.to_thread(app.wait)
            elif app.returncode != 0:
                problems.append(f"app {i} exited with {app.returncode}; see logs/app-{i}.log")
        return problems

    async def verify(self, acks: dict[str, tuple[int, float]]) -> tuple[dict[int, int], list[str]]:
        problems: list[str] = []
        config = ClientConfig.from_yaml(self.directory / "client.yaml")
        logs: dict[int, list[Record]] = {}
        try:
            async with asyncio.timeout(120), LogReader(config) as reader:
                for p in range(self.opts.partitions):
                    hwm = await reader.high_water_mark(p)
                    logs[p] = [r async for r in reader.read(p, 0, hwm)]
        except Exception as e:  # noqa: BLE001 - reported; the replicas still tell what was kept
            # A partition no server serves (every replica damaged, say) still has a verdict: what the
            # longest replica holds is the most the cluster kept.
            problems.append(f"the log could not be read through the servers ({e!r}); checked the replicas")
            logs = await self.read_replicas()
        acked = {tag: partition for tag, (partition, _) in acks.items()}
        problems += check_log(logs, acked, self.pending_tags)
        committed = {r.data.decode("utf-8", "replace") for records in logs.values() for r in records}
        for tag, error in sorted(self.failed_tags.items()):
            where = "committed" if tag in committed else "not in the log"
            self.notes.append(f"{tag}: its client gave up ({error}); {where}")
        problems += await self.verify_replicas({p: len(r) - 1 for p, r in logs.items()}, logs)
        return {p: len(r) for p, r in logs.items()}, problems

    def _cluster_key(self) -> uuid.UUID:
        cluster = self.cluster()
        client = zkutil.connect(cluster.zk_connect, session_timeout_ms=10_000, connect_timeout_ms=10_000)
        try:
            return sm.read_store_params(client, cluster.cluster_root).cluster_key
        finally:
            zkutil.close(client)

    async def read_replicas(self) -> dict[int, list[Record]]:
        """Each partition's longest replica, read through the storage nodes' admin ports (a replica that
        cannot be read counts as empty)."""
        cluster = self.cluster()
        key = self._cluster_key()
        logs: dict[int, list[Record]] = {p: [] for p in range(self.opts.partitions)}
        for rec in cluster.storages:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(60):
                    admin = await AdminClient.connect(
                        procs.LOOPBACK, rec.admin_port, key, self.opts.partitions
                    )
                    async with admin:
                        for p in rec.partitions:
                            records = await self._read_replica(admin, p)
                            if len(records) > len(logs[p]):
                                logs[p] = records
        return logs

    @staticmethod
    async def _read_replica(admin: AdminClient, partition: int) -> list[Record]:
        held = await admin.max_transaction_id(partition)
        records: list[Record] = []
        while len(records) <= held:
            chunk = await admin.read_records(partition, len(records), READ_CHUNK_RECORDS)
            if not chunk:
                break
            records += chunk
        return records

    async def verify_replicas(self, hwms: dict[int, int], logs: dict[int, list[Record]]) -> list[str]:
        cluster = self.cluster()
        key = self._cluster_key()
        problems: list[str] = []
        for rec in cluster.storages:
            async with asyncio.timeout(self.opts.catch_up_bound_s + 60):
                admin = await AdminClient.connect(procs.LOOPBACK, rec.admin_port, key, self.opts.partitions)
                async with admin:
                    for p in rec.partitions:
                        problems += await self._compare_replica(admin, rec.name, p, hwms[p], logs[p])
        return problems

    async def _compare_replica(
        self, admin: AdminClient, name: str, partition: int, hwm: int, log: list[Record]
    ) -> list[str]:
        deadline = time.monotonic() + self.opts.catch_up_bound_s
        # Polled: the storage node has no way to announce that it caught up.
        while (held := await admin.max_transaction_id(partition)) < hwm and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.5)
        problems = []
        if held < hwm:
            problems.append(
                f"{name} partition {partition}: holds up to {held}, below the high-water mark {hwm}, "
                f"{self.opts.catch_up_bound_s:g}s after the run"
            )
        next_id = 0
        while next_id <= min(held, hwm):
            chunk = await admin.read_records(partition, next_id, min(READ_CHUNK_RECORDS, hwm - next_id + 1))
            if not chunk:
                problems.append(f"{name} partition {partition}: no record {next_id} (max id {held})")
                break
            for record in chunk:
                if record.transaction_id > hwm:
                    break
                if record != log[record.transaction_id]:
                    problems.append(
                        f"{name} partition {partition}: record {record.transaction_id} differs from the "
                        f"committed one ({record.data!r} vs {log[record.transaction_id].data!r})"
                    )
                    return problems
            next_id = chunk[-1].transaction_id + 1
        return problems

    # -- teardown ------------------------------------------------------------------------------------------

    async def aclose(self) -> None:
        for pid in list(self.stopped_pids):
            self._signal(pid, signal.SIGCONT)
        for app in self.apps:
            if app.poll() is None:
                app.kill()
            await asyncio.to_thread(app.wait)
        if self.cluster_up and (self.directory / "cluster.json").exists():
            # A `waltz local start` abandoned by the run's time limit may still hold the cluster's lock in its
            # thread (threads cannot be cancelled): try again until it is done, within its own bound.
            deadline = time.monotonic() + self.opts.start_timeout_s + 30
            while True:
                try:
                    await asyncio.to_thread(local.down, self.directory)
                    break
                except Exception as e:  # noqa: BLE001 - reported, and retried until the deadline
                    if time.monotonic() > deadline:
                        self.log(f"could not stop the cluster: {e!r}; see {self.directory}/cluster.json")
                        break
                    await asyncio.sleep(1.0)
        if self.power is not None:
            await asyncio.to_thread(self.power.unmount_all)
        for proxy in [*self.storage_proxies, *self.server_proxies, *self.zookeeper_links]:
            await proxy.aclose()


def check_log(
    logs: dict[int, list[Record]], acked: dict[str, int], unresolved: Sequence[str] = ()
) -> list[str]:
    """Problems with the committed logs (``{partition: records from id 0}``) given the acknowledged tags
    (``{tag: partition}``): ids not dense, a tag committed twice, an acknowledged tag missing or misplaced;
    and every ``unresolved`` tag (a context its app never saw end), saying whether it was committed."""
    problems: list[str] = []
    where: dict[str, list[tuple[int, int]]] = {}
    for p, records in sorted(logs.items()):
        for expected, record in enumerate(records):
            if record.transaction_id != expected:
                problems.append(f"partition {p}: id {record.transaction_id} where {expected} belongs")
                break
        for record in records:
            tag = record.data.decode("utf-8", "replace")
            where.setdefault(tag, []).append((p, record.transaction_id))
    for tag, places in where.items():
        if len(places) > 1:
            problems.append(f"committed twice: {tag} at {places}")
    for tag, partition in sorted(acked.items()):
        places = where.get(tag, [])
        if not places:
            problems.append(f"acknowledged but not in the log: {tag} (partition {partition})")
        elif places[0][0] != partition:
            problems.append(f"{tag} sent to partition {partition} but committed in {places[0][0]}")
    for tag in unresolved:
        found = f"committed at {where[tag]}" if tag in where else "not in the log"
        problems.append(f"unresolved: {tag} neither committed nor failed for its client ({found})")
    return problems


def _app_env() -> dict[str, str]:
    """The apps import ``bench.faults.app`` from this checkout, whatever the caller's working directory."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def _edit_yaml(path: Path, changes: dict[str, Any]) -> None:
    values = yaml.safe_load(path.read_text(encoding="utf-8"))
    values.update(changes)
    path.write_text(yaml.safe_dump(values, sort_keys=True), encoding="utf-8")


async def _run(harness: Harness, faults: list[Fault], result: Result) -> None:
    opts = harness.opts
    await harness.start_cluster()
    planned_end = max((f.at_s + f.duration_s for f in faults), default=0.0)
    # The apps append through the faults and the recovery window after them, until the stop file appears; the
    # duration is only their own upper bound (fault injection takes longer than planned on a loaded machine).
    harness.start_apps(2 * planned_end + opts.stuck_bound_s + 120)
    await harness.wait_apps_appending(opts.start_timeout_s)
    harness.log("every app is appending; faults start")
    start = time.monotonic()
    for fault in faults:
        await asyncio.sleep(max(0.0, start + fault.at_s - time.monotonic()))
        await harness.inject(fault)
    healed_at = time.time()
    harness.log("every fault healed; waiting for every partition to acknowledge an append")
    result.resume_s, problems = await harness.wait_progress(healed_at)
    result.problems += problems
    harness.stop_file.touch()
    result.problems += await harness.wait_apps(opts.stuck_bound_s + 5 + opts.apps_grace_s)
    acks, result.app_counts, problems = harness.read_acks()
    result.problems += problems
    result.acked = len(acks)
    harness.log(f"apps done: {result.app_counts}; checking the log and every replica")
    result.log_records, problems = await harness.verify(acks)
    result.problems += problems
    result.notes += harness.notes


async def run_seed_async(
    seed: int, opts: Options, directory: Path, report: Report = _print, keep: bool = False
) -> Result:
    faults = schedule(seed, opts)
    result = Result(seed, False, [f.describe() for f in faults], directory=str(directory))
    report(f"seed {seed}: {len(faults)} faults\n  " + "\n  ".join(result.faults))
    harness = Harness(directory, seed, opts, report)
    started = time.monotonic()
    try:
        async with asyncio.timeout(opts.run_bound_s):
            await _run(harness, faults, result)
    except TimeoutError:
        result.problems.append(f"the run exceeded its bound of {opts.run_bound_s:g}s")
    except Exception as e:  # noqa: BLE001 - any failure of the run is a finding, reported with the seed
        result.problems.append(f"the run failed: {e!r}")
    finally:
        await harness.aclose()
    result.elapsed_s = time.monotonic() - started
    result.ok = not result.problems
    if result.ok and not keep:
        shutil.rmtree(directory, ignore_errors=True)
    return result


def run_seed(
    seed: int, opts: Options, directory: Path, report: Report = _print, keep: bool = False
) -> Result:
    """One bounded run (see the module docstring); a passing run's directory is removed unless ``keep``."""
    return asyncio.run(run_seed_async(seed, opts, directory, report, keep))


def result_json(result: Result, opts: Options) -> str:
    return json.dumps({**asdict(result), "options": asdict(opts)}, sort_keys=True)
