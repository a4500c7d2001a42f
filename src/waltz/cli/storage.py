"""``waltz storage``: run a storage node, and administer one over its admin port."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from waltz.cli import logsetup
from waltz.cli.common import add_cli_config_arg, load_cli_config, load_cli_tls
from waltz.cluster.store_metadata import format_ranges
from waltz.config import host_port, parse_partition_ranges
from waltz.errors import ConfigError
from waltz.ops import checks
from waltz.ops.progress import PartitionCopyProgress
from waltz.ops.recover import recover_partition
from waltz.ops.view import ClusterView, read_view
from waltz.server.storage_client import AdminClient

T = TypeVar("T")

PROFILE_ENV = "WALTZ_STORAGE_PROFILE"
"""Dev aid: with this set to PREFIX, ``storage run`` writes a cProfile of the node to PREFIX.<pid> when it
stops."""


def register(groups: Any) -> None:
    parser = groups.add_parser("storage", help="run or administer a storage node")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    _add_run(sub)
    _add_admin_commands(sub)
    _add_repair_commands(sub)


def _add_run(sub: Any) -> None:
    """``waltz storage run``."""
    run = sub.add_parser("run", help="run a storage node")
    run.add_argument("--config", required=True, metavar="FILE", help="storage YAML config")
    logsetup.add_arguments(run, default_level="INFO")
    run.add_argument(
        "--event-loop",
        choices=["auto", "uvloop", "asyncio"],
        default="auto",
        help="event loop: uvloop when installed (auto, the default), or the standard asyncio loop",
    )
    run.set_defaults(handler=cmd_run)


def _add_admin_commands(sub: Any) -> None:
    """The commands that ask or tell one node through its admin port."""

    def admin_parser(name: str, help_text: str) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = sub.add_parser(name, help=help_text)
        p.add_argument("-s", "--storage", required=True, metavar="HOST:ADMIN_PORT", help="admin address")
        ident = p.add_argument_group("cluster identity (from ZooKeeper with -c, or given directly)")
        ident.add_argument(
            "-c",
            "--cli-config-path",
            metavar="FILE",
            help="YAML with zookeeper.* and cluster.root, and ssl.* (or client.ssl.*) for TLS",
        )
        ident.add_argument("--cluster-key", metavar="UUID")
        ident.add_argument("--num-partitions", type=int, metavar="N")
        return p

    ls = admin_parser("list", "list the node's partitions: session, low-water marks, flags")
    ls.set_defaults(handler=cmd_list)
    add = admin_parser("add-partition", "assign partitions to the node")
    add.add_argument("-p", "--partition", required=True, metavar="RANGES", help="e.g. 0-6,7")
    add.set_defaults(handler=cmd_add_partition)
    rm = admin_parser("remove-partition", "unassign partitions from the node")
    rm.add_argument("-p", "--partition", required=True, metavar="RANGES")
    rm.add_argument("-d", "--delete-storage-files", action="store_true", help="also delete segment files")
    rm.add_argument(
        "--force",
        action="store_true",
        help="with -d: delete even if fewer than a quorum of good copies would remain (or without -c)",
    )
    rm.set_defaults(handler=cmd_remove_partition)
    av = admin_parser("availability", "mark partitions online or offline")
    av.add_argument("-p", "--partition", required=True, metavar="RANGES")
    av.add_argument("--online", required=True, choices=["true", "false"])
    av.set_defaults(handler=cmd_availability)
    mx = sub.add_parser(
        "max-transaction-id",
        help="print a partition's max transaction id (from a running node, or --offline from its files)",
    )
    mx.add_argument("-s", "--storage", metavar="HOST:ADMIN_PORT", help="admin address of a running node")
    mx.add_argument("-c", "--cli-config-path", metavar="FILE", help="YAML with zookeeper.*, cluster.root")
    mx.add_argument("--cluster-key", metavar="UUID")
    mx.add_argument("--num-partitions", type=int, metavar="N")
    mx.add_argument(
        "--offline",
        metavar="DIR",
        type=Path,
        help="read the segment files of storage directory DIR instead (the node may be stopped)",
    )
    mx.add_argument("-p", "--partition", required=True, type=int)
    mx.set_defaults(handler=cmd_max_transaction_id)


def _add_repair_commands(sub: Any) -> None:
    """The repair tools, which read the cluster from ZooKeeper and work on several nodes."""

    def zk_parser(name: str, help_text: str) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = sub.add_parser(name, help=help_text, description=help_text)
        add_cli_config_arg(p)
        p.add_argument(
            "--timeout", type=float, default=10.0, metavar="S", help="time limit per node (default 10 s)"
        )
        return p

    rc = zk_parser(
        "recover-partition",
        "copy a partition into a replica (taken offline meanwhile) from a healthy replica, batch by batch",
    )
    rc.add_argument("-p", "--partition", required=True, type=int)
    rc.add_argument(
        "--source", required=True, metavar="HOST:PORT", help="storage node to copy from (data port)"
    )
    rc.add_argument(
        "--destination", required=True, metavar="HOST:PORT", help="storage node to rebuild (data port)"
    )
    rc.add_argument(
        "--batch-size", type=int, default=500, metavar="N", help="records per batch (default 500)"
    )
    rc.add_argument("--leave-offline", action="store_true", help="do not bring the destination back online")
    rc.add_argument(
        "--untrusted-source",
        action="store_true",
        help="copy from a source recovery would not trust (restored, or not a replica in ZooKeeper)",
    )
    rc.add_argument(
        "--shorten-destination",
        action="store_true",
        help="cut a destination that holds more than the source gives (loses its extra records)",
    )
    rc.add_argument("--force", action="store_true", help=argparse.SUPPRESS)
    rc.set_defaults(handler=cmd_recover_partition)

    sp = zk_parser("sync-partitions", "make each storage node's assigned partitions equal ZooKeeper's")
    sp.add_argument("--dry-run", action="store_true", help="only print what would change")
    sp.set_defaults(handler=cmd_sync_partitions)

    va = zk_parser("validate", "open the data and admin port of every storage node in ZooKeeper")
    va.set_defaults(handler=cmd_validate)


def cmd_run(args: argparse.Namespace) -> int:
    from waltz.runtime import run
    from waltz.storage.config import StorageConfig
    from waltz.storage.startup import run_node

    config = StorageConfig.load(args.config)

    def ready(node: Any) -> None:
        print(
            json.dumps({"port": node.port, "admin_port": node.admin_port, "http_port": node.http_port}),
            flush=True,
        )

    def go() -> None:
        if args.event_loop == "asyncio":
            asyncio.run(run_node(config, ready=ready))
        elif args.event_loop == "uvloop":
            try:
                import uvloop
            except ImportError:
                raise ConfigError("--event-loop uvloop: uvloop is not installed") from None
            uvloop.run(run_node(config, ready=ready))
        else:
            run(run_node(config, ready=ready))

    profile_prefix = os.environ.get(PROFILE_ENV)
    if not profile_prefix:
        go()
        return 0
    # For finding where a node's CPU goes under a real load (several nodes share the variable, so each writes
    # PREFIX.<pid>). It counts the loop thread's CPU time, not the wall clock: on a busy host a socket write
    # that wakes a peer often loses the CPU to it, which is not the node's cost.
    import cProfile
    import time

    profiler = cProfile.Profile(time.thread_time)
    try:
        profiler.runcall(go)
    finally:
        profiler.dump_stats(f"{profile_prefix}.{os.getpid()}")
    return 0


def cluster_identity(args: argparse.Namespace) -> tuple[uuid.UUID, int]:
    """The key and partition count to open an admin connection with."""
    if args.cluster_key or args.num_partitions is not None:
        if not (args.cluster_key and args.num_partitions):
            raise ConfigError("give both --cluster-key and --num-partitions")
        try:
            return uuid.UUID(args.cluster_key), int(args.num_partitions)
        except ValueError:
            raise ConfigError(f"--cluster-key is not a UUID: {args.cluster_key!r}") from None
    if not args.cli_config_path:
        raise ConfigError("give -c/--cli-config-path (ZooKeeper) or --cluster-key and --num-partitions")
    from waltz.cluster import zk
    from waltz.cluster.store_metadata import read_store_params

    cfg = load_cli_config(args.cli_config_path)
    with zk.session(cfg, str(args.cli_config_path)) as client:
        params = read_store_params(client, cfg["cluster.root"])
    return params.cluster_key, params.num_partitions


def with_admin(args: argparse.Namespace, action: Callable[[AdminClient, int], Awaitable[T]]) -> T:
    host, port = host_port(args.storage)
    key, num_partitions = cluster_identity(args)
    ssl = load_cli_tls(args.cli_config_path).client_context(args.cli_config_path or "")

    async def go() -> T:
        async with await AdminClient.connect(host, port, key, num_partitions, ssl=ssl) as admin:
            return await action(admin, num_partitions)

    return asyncio.run(go())


def cmd_list(args: argparse.Namespace) -> int:
    async def action(admin: AdminClient, n: int) -> str:
        return await admin.metrics_json()

    data = json.loads(with_admin(args, action))
    print(f"{'partition':>9} {'session':>8} {'lwm':>10} {'local-lwm':>10} {'max-id':>10} available")
    for pid, p in sorted(data["partitions"].items(), key=lambda kv: int(kv[0])):
        print(
            f"{pid:>9} {p['sessionId']:>8} {p['lowWaterMark']:>10} {p['localLowWaterMark']:>10} "
            f"{p['maxTransactionId']:>10} {str(p['available']).lower()}"
        )
    return 0


def cmd_add_partition(args: argparse.Namespace) -> int:
    async def action(admin: AdminClient, n: int) -> None:
        await admin.set_assigned(parse_partition_ranges(args.partition, n), True)

    with_admin(args, action)
    return 0


def cmd_remove_partition(args: argparse.Namespace) -> int:
    if args.delete_storage_files and not args.force:
        # Deleting files is the one admin action that can lose committed transactions for good: check that
        # a quorum of good copies survives (this needs ZooKeeper's assignment).
        if not args.cli_config_path:
            raise ConfigError(
                "-d needs -c/--cli-config-path to check that a quorum of good copies remains "
                "(or --force to delete without the check)"
            )
        view = _view(args)
        storage = view.storage_for_admin(args.storage)
        ids = parse_partition_ranges(args.partition, view.num_partitions)
        problems = asyncio.run(checks.deletion_problems(view, storage, ids))
        if problems:
            for problem in problems:
                print(f"waltz: refused: {problem}", file=sys.stderr)
            print(
                "waltz: nothing was deleted; recover the other replicas first "
                "(waltz storage recover-partition), or give --force",
                file=sys.stderr,
            )
            return 1

    async def action(admin: AdminClient, n: int) -> None:
        ids = parse_partition_ranges(args.partition, n)
        await admin.set_assigned(ids, False, delete_files=args.delete_storage_files)

    with_admin(args, action)
    return 0


def cmd_availability(args: argparse.Namespace) -> int:
    async def action(admin: AdminClient, n: int) -> None:
        await admin.set_available(parse_partition_ranges(args.partition, n), args.online == "true")

    with_admin(args, action)
    return 0


def cmd_max_transaction_id(args: argparse.Namespace) -> int:
    if args.offline is not None:
        from waltz.cli.disk import offline_max_transaction_id

        print(offline_max_transaction_id(args.offline, args.partition))
        return 0
    if not args.storage:
        raise ConfigError("give -s/--storage HOST:ADMIN_PORT, or --offline DIR")

    async def action(admin: AdminClient, n: int) -> int:
        if not 0 <= args.partition < n:
            raise ConfigError(f"partition {args.partition} out of range: the cluster has {n} partitions")
        return await admin.max_transaction_id(args.partition)

    print(with_admin(args, action))
    sys.stdout.flush()
    return 0


# ------------------------------------------------------------------------------------------- repair tools


def _view(args: argparse.Namespace) -> ClusterView:
    """The cluster's ZooKeeper metadata, and the TLS settings of the ``-c`` file to reach its nodes."""
    from waltz.cluster import zk

    if not getattr(args, "verbose", False):
        # kazoo logs each failed connection attempt as a warning; the tools report outcomes themselves.
        logging.getLogger("kazoo").setLevel(logging.ERROR)
    cfg = load_cli_config(args.cli_config_path)
    ssl = load_cli_tls(args.cli_config_path).client_context(args.cli_config_path)
    with zk.session(cfg, str(args.cli_config_path)) as client:
        return read_view(client, cfg["cluster.root"], ssl)


def cmd_recover_partition(args: argparse.Namespace) -> int:
    # rich is imported here, not at the top: every `waltz` command imports this module.
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    if args.force:
        raise ConfigError(
            "recover-partition has no --force: say which risk to take, --untrusted-source (copy from a "
            "replica recovery would not trust) and/or --shorten-destination (cut a longer destination)"
        )
    view = _view(args)
    with Progress(
        TextColumn("partition {task.fields[partition]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("records, next id {task.fields[next_id]}, {task.fields[rate]:.0f} records/s"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=False,
    ) as bar:
        task = bar.add_task("copy", total=None, partition=args.partition, next_id="?", rate=0.0)

        def progress(p: PartitionCopyProgress) -> None:
            bar.update(task, total=p.total, completed=p.done, next_id=p.next_id, rate=p.records_per_s)

        result = asyncio.run(
            recover_partition(
                view,
                args.partition,
                args.source,
                args.destination,
                batch_records=args.batch_size,
                untrusted_source=args.untrusted_source,
                shorten_destination=args.shorten_destination,
                leave_offline=args.leave_offline,
                progress=progress,
            )
        )
    kind = f", recovery will count it as {result.destination_class.value}" if result.destination_class else ""
    print(
        f"partition {result.partition}: copied {result.copied} records from {result.source} to "
        f"{result.destination} in {result.elapsed_s:.1f} s; it holds {result.trim_point}..{result.target}"
        f"{' (trimmed below)' if result.trim_point else ''} with session "
        f"{result.session_id}{kind}; {'online' if result.online else 'left offline'}"
    )
    return 0


def cmd_sync_partitions(args: argparse.Namespace) -> int:
    view = _view(args)
    changes = asyncio.run(checks.sync_partitions(view, dry_run=args.dry_run, timeout_s=args.timeout))
    failed = 0
    verb = "would " if args.dry_run else ""
    for c in changes:
        if c.error is not None:
            failed += 1
            print(f"{c.storage}: unreachable: {c.error}")
            continue
        if c.added:
            print(f"{c.storage}: {verb}assign {format_ranges(c.added)}")
        if c.removed:
            print(f"{c.storage}: {verb}unassign {format_ranges(c.removed)} (files kept)")
    if not changes:
        print("every storage node holds exactly the partitions ZooKeeper assigns it")
    return 1 if failed else 0


def cmd_validate(args: argparse.Namespace) -> int:
    view = _view(args)
    results = asyncio.run(checks.validate_storages(view, timeout_s=args.timeout))
    for r in results:
        state = "ok" if r.error is None else f"FAILED: {r.error}"
        print(f"{r.storage} {r.port} port {r.address}: {state}")
    if not results:
        print("ZooKeeper lists no storage nodes")
    return 1 if any(r.error for r in results) else 0
