"""``waltz server``: run a Waltz server, list what it serves, change its preferred partitions."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from ssl import SSLContext
from typing import Any

from waltz.cli import logsetup
from waltz.cli.common import load_cli_tls
from waltz.config import parse_partition_ranges
from waltz.errors import RemoteProtocolError
from waltz.ops.servers import admin_req_id, query
from waltz.protocol import client_server as cs
from waltz.protocol.records import ReqId


def register(groups: Any) -> None:
    parser = groups.add_parser("server", help="run or query a Waltz server")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    run = sub.add_parser("run", help="run a Waltz server")
    run.add_argument("--config", required=True, metavar="FILE", help="server YAML config")
    logsetup.add_arguments(run, default_level="INFO")
    run.set_defaults(handler=cmd_run)

    ls = sub.add_parser("list", help="partitions a server owns, their health, and its storage connectivity")
    ls.add_argument("-s", "--server", required=True, metavar="HOST:PORT", help="the server's client port")
    ls.set_defaults(handler=cmd_list)
    parsers = [ls]
    for name, add in (("add-preferred-partition", True), ("remove-preferred-partition", False)):
        p = sub.add_parser(name, help=f"{'add' if add else 'remove'} preferred partitions of a server")
        p.add_argument("-s", "--server", required=True, metavar="HOST:PORT")
        p.add_argument("-p", "--partition", required=True, metavar="RANGES", help="e.g. 0-3,7")
        p.set_defaults(handler=cmd_preferred, add=add)
        parsers.append(p)
    for p in parsers:
        p.add_argument(
            "-c",
            "--cli-config-path",
            metavar="FILE",
            help="CLI or client YAML; its ssl.* (or client.ssl.*) keys make the connection TLS",
        )


def cmd_run(args: argparse.Namespace) -> int:
    from waltz.runtime import run
    from waltz.server.config import ServerConfig
    from waltz.server.startup import run_server

    config = ServerConfig.load(args.config)

    def ready(server: Any) -> None:
        print(
            json.dumps({"port": server.port, "http_port": server.http_port, "server_id": server.server_id}),
            flush=True,
        )

    profile_path = os.environ.get("WALTZ_PROFILE")
    if not profile_path:
        run(run_server(config, ready=ready))
        return 0
    # For finding where the server's CPU goes (bench/append_e2e.py --profile-server): a cProfile of the event
    # loop's thread, written when the server stops. It counts the thread's CPU time, not the wall clock: on a
    # busy host a socket write that wakes a peer often loses the CPU to it, which is not the server's cost.
    import cProfile
    import time

    profiler = cProfile.Profile(time.thread_time)
    try:
        profiler.runcall(run, run_server(config, ready=ready))
    finally:
        profiler.dump_stats(profile_path)
    return 0


def _rid(seq: int) -> ReqId:
    return admin_req_id(seq)


def _ssl(args: argparse.Namespace) -> SSLContext | None:
    return load_cli_tls(args.cli_config_path).client_context(args.cli_config_path or "")


def cmd_list(args: argparse.Namespace) -> int:
    answers = asyncio.run(
        query(
            args.server,
            [
                cs.ServerPartitionsAssignmentRequest(_rid(1)),
                cs.ServerPartitionsHealthStatRequest(_rid(2)),
                cs.CheckStorageConnectivityRequest(_rid(3)),
            ],
            ssl=_ssl(args),
        )
    )
    assignment, health, connectivity = answers
    if not (
        isinstance(assignment, cs.ServerPartitionsAssignmentResponse)
        and isinstance(health, cs.ServerPartitionsHealthStatResponse)
        and isinstance(connectivity, cs.CheckStorageConnectivityResponse)
    ):
        raise RemoteProtocolError(f"unexpected answers from {args.server}")
    healthy = dict(health.partition_health)
    print(f"partitions: {','.join(map(str, assignment.partition_ids)) or '-'}")
    for pid in assignment.partition_ids:
        print(f"  partition {pid}: {'healthy' if healthy.get(pid) else 'UNHEALTHY'}")
    print("storage connectivity:")
    for storage, ok in connectivity.storage_connectivity:
        print(f"  {storage}: {'reachable' if ok else 'UNREACHABLE'}")
    return 0


def cmd_preferred(args: argparse.Namespace) -> int:
    ids = tuple(parse_partition_ranges(args.partition))
    req: cs.Message = (
        cs.AddPreferredPartitionRequest(_rid(1), ids)
        if args.add
        else cs.RemovePreferredPartitionRequest(_rid(1), ids)
    )
    (answer,) = asyncio.run(query(args.server, [req], ssl=_ssl(args)))
    ok = getattr(answer, "result", False)
    if not ok:
        print(f"waltz: error: {args.server} refused the change (partition out of range?)")
        return 1
    return 0
