"""``waltz storage``: run a storage node, and administer one over its admin port."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from waltz.cli import logsetup
from waltz.cli.common import load_cli_config, load_cli_tls
from waltz.config import host_port, parse_partition_ranges
from waltz.errors import ConfigError
from waltz.server.storage_client import AdminClient

T = TypeVar("T")


def register(groups: Any) -> None:
    parser = groups.add_parser("storage", help="run or administer a storage node")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

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
    rm.set_defaults(handler=cmd_remove_partition)
    av = admin_parser("availability", "mark partitions online or offline")
    av.add_argument("-p", "--partition", required=True, metavar="RANGES")
    av.add_argument("--online", required=True, choices=["true", "false"])
    av.set_defaults(handler=cmd_availability)
    mx = admin_parser("max-transaction-id", "print a partition's max transaction id")
    mx.add_argument("-p", "--partition", required=True, type=int)
    mx.set_defaults(handler=cmd_max_transaction_id)


def cmd_run(args: argparse.Namespace) -> int:
    from waltz.storage.config import StorageConfig
    from waltz.storage.node import run_node
    from waltz.transport import run

    config = StorageConfig.load(args.config)

    def ready(node: Any) -> None:
        print(
            json.dumps({"port": node.port, "admin_port": node.admin_port, "http_port": node.http_port}),
            flush=True,
        )

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
    with zk.session(cfg) as client:
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
    async def action(admin: AdminClient, n: int) -> int:
        if not 0 <= args.partition < n:
            raise ConfigError(f"partition {args.partition} out of range: the cluster has {n} partitions")
        return await admin.max_transaction_id(args.partition)

    print(with_admin(args, action))
    sys.stdout.flush()
    return 0
