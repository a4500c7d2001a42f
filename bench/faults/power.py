"""Power cuts for the fault suite: every storage node's directory and ZooKeeper's data directory on powerfs.

:class:`PowerCuts` puts each storage node's ``storage.directory`` and ZooKeeper's ``dataDir`` (``D/zookeeper/
data``) on a :mod:`bench.faults.powerfs` mount (backing directories in ``D/power/``, the mounts' own output in
``D/logs/powerfs-*.log``). A storage node's mount is made by ``waltz local up`` itself, just before the node
first starts (``UpOptions.before_storage_start``), so everything the node ever writes, its control file and
partition directories included, is under the model. ZooKeeper is restarted on its mount after ``up``, with
its data (the cluster's metadata ``up`` wrote) imported as durable. Logs, configs and ``zoo.cfg`` stay on the
host's filesystem.

ZooKeeper (3.8) never fsyncs its data directory: a transaction log it creates (a new ``log.<zxid>`` after
every start and at roll-over) is fsynced, its directory entry never. Under the strict model a
whole-cluster cut rolls ZooKeeper back to the files whose entries were durable before (sequential znode
counters and partition generations go backwards). So ZooKeeper's mount uses powerfs's ``--journal`` model
(a file's fsync commits every directory entry, as ext4 and XFS do in their default modes) unless
``Options.zk_strict_posix`` asks for the strict one.

Two fault kinds:

* ``power-storage[i]``: storage node ``i`` loses power: kill -9 the node, kill -9 its powerfs (everything not
  durable is dropped), mount again, and after the fault's duration start the node again.
* ``power-cluster``: the whole cluster loses power at once: SIGKILL to every server, storage node and
  ZooKeeper back to back, then every mount is cut; after the duration ZooKeeper, the storage nodes and the
  servers start again, in that order.

The negative control (``Options.fsync_noop``) makes fsync a no-op on the storage nodes' mounts (ZooKeeper's
stays honest, so the cluster's metadata survives and what is lost is the log): a whole-cluster cut must then
be reported as lost acknowledged transactions.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from pathlib import Path

from bench.faults.powerfs import PowerMount, import_tree

from waltz import local
from waltz.local import procs
from waltz.local.state import LocalCluster, ProcessRecord

POWER_KINDS = ("power-storage", "power-cluster")


class PowerCuts:
    """The powerfs mounts of one run, by process name (``storage-0``, ..., ``zookeeper``)."""

    def __init__(
        self,
        directory: Path,
        *,
        fsync_noop: bool = False,
        zk_strict_posix: bool = False,
        start_timeout_s: float = 90.0,
    ) -> None:
        self.directory = directory
        self.fsync_noop = fsync_noop
        self.zk_strict_posix = zk_strict_posix
        self.start_timeout_s = start_timeout_s
        self.mounts: dict[str, PowerMount] = {}

    def _mount(
        self, name: str, data_dir: Path, *, keep: bool, honest: bool = True, journal: bool = False
    ) -> None:
        """Mount a new backing store over a stopped process's ``data_dir``, with its contents if ``keep``."""
        backing = self.directory / "power" / name
        shutil.rmtree(backing, ignore_errors=True)  # from a failed `up` the suite tries again
        if keep:
            import_tree(data_dir, backing)
        for child in data_dir.iterdir():
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
        log = self.directory / "logs" / f"powerfs-{name}.log"
        mount = PowerMount(backing, data_dir, log, fsync_enabled=honest, journal=journal)
        mount.start()
        self.mounts[name] = mount

    def mount_zookeeper(self) -> None:
        """Restart ZooKeeper on a powerfs mount (quickly: the servers' sessions survive a short restart)."""
        cluster = LocalCluster.load(self.directory)
        procs.stop(cluster.zookeeper.process)
        self._mount(
            "zookeeper",
            Path(cluster.zookeeper.data_dir) / "data",
            keep=True,
            journal=not self.zk_strict_posix,
        )
        local.start(self.directory, "zookeeper", 0, self.start_timeout_s)

    def mount_storage(self, rec: ProcessRecord) -> None:
        """Put a storage node's directory on an empty powerfs mount (before the node first starts)."""
        self._mount(f"storage-{rec.index}", Path(rec.data_dir), keep=False, honest=not self.fsync_noop)

    def cut_storage(self, index: int) -> None:
        """Storage node ``index`` loses power (it stays down; :meth:`restore_storage` starts it)."""
        cluster = LocalCluster.load(self.directory)
        rec = cluster.member("storage", index)
        procs.kill(rec.process)
        self.mounts[f"storage-{index}"].cut()

    def restore_storage(self, index: int) -> None:
        local.start(self.directory, "storage", index, self.start_timeout_s)

    def cut_cluster(self) -> None:
        """Every process and every mount loses power at once (they stay down; :meth:`restore_cluster`)."""
        cluster = LocalCluster.load(self.directory)
        victims = [*cluster.servers, *cluster.storages, cluster.zookeeper]
        alive = [rec for rec in victims if procs.is_alive(rec.process)]
        for rec in alive:
            assert rec.pid is not None
            with contextlib.suppress(ProcessLookupError):
                os.kill(rec.pid, signal.SIGKILL)
        for rec in alive:
            procs.kill(rec.process)  # waits until it is gone and reaps it
        for mount in self.mounts.values():
            mount.cut()

    def restore_cluster(self) -> None:
        cluster = LocalCluster.load(self.directory)
        local.start(self.directory, "zookeeper", 0, self.start_timeout_s)
        for rec in cluster.storages:
            local.start(self.directory, "storage", rec.index, self.start_timeout_s)
        for rec in cluster.servers:
            local.start(self.directory, "server", rec.index, self.start_timeout_s)

    def unmount_all(self) -> None:
        """After the cluster was stopped: unmount everything (what is not durable is dropped)."""
        for mount in self.mounts.values():
            mount.stop()
        self.mounts.clear()
