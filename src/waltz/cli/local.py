"""``waltz local``: run a whole cluster on this machine (a thin layer over :mod:`waltz.local`).

``up`` starts ZooKeeper, storage nodes and servers as separate processes and writes ``D/cluster.json`` and
``D/client.yaml``; ``status`` shows processes, partition owners, high-water marks and replica states; ``down``
stops everything by pid (``--purge`` deletes what ``up`` created); ``restart`` stops and starts it all again;
``kill`` and ``start`` crash and restart one storage node, server or ZooKeeper for fault drills.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from waltz import local


def register(groups: Any) -> None:
    parser = groups.add_parser("local", help="run a whole cluster on this machine")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def with_dir(name: str, help_text: str) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = sub.add_parser(name, help=help_text)
        p.add_argument("--dir", required=True, type=Path, metavar="D", help="the cluster's directory")
        return p

    _register_up(
        with_dir("up", "start ZooKeeper, storage nodes and servers; wait until every partition is served")
    )

    st = with_dir("status", "processes, partition owners, high-water marks, replica states")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.set_defaults(handler=cmd_status)

    dn = with_dir("down", "stop everything `up` started (servers, storage nodes, ZooKeeper)")
    dn.add_argument(
        "--purge",
        action="store_true",
        help="also delete what `up` created (data, configs, logs); the directory too if nothing else is left",
    )
    dn.set_defaults(handler=cmd_down)

    rs = with_dir("restart", "stop what runs, then start the whole cluster again with its data")
    rs.add_argument("--timeout", type=float, default=60.0, metavar="S", help="start timeout in seconds")
    rs.set_defaults(handler=cmd_restart)

    for name, help_text in (
        ("kill", "SIGKILL one storage node, server or ZooKeeper (a crash, for fault drills)"),
        ("start", "start a killed storage node, server or ZooKeeper again"),
    ):
        p = with_dir(name, help_text)
        which = p.add_mutually_exclusive_group(required=True)
        which.add_argument("--storage", type=int, metavar="I", help="storage node index (0-based)")
        which.add_argument("--server", type=int, metavar="I", help="server index (0-based)")
        which.add_argument(
            "--zookeeper",
            type=int,
            nargs="?",
            const=0,
            metavar="I",
            help="the cluster's ZooKeeper (I: an ensemble member, 0-based; default 0)",
        )
        p.set_defaults(handler=cmd_kill if name == "kill" else cmd_start)


def _register_up(up: argparse.ArgumentParser) -> None:
    up.add_argument("--storages", type=int, default=3, metavar="N", help="storage nodes (default 3)")
    up.add_argument("--servers", type=int, default=2, metavar="N", help="servers (default 2)")
    up.add_argument("--partitions", type=int, default=4, metavar="N", help="partitions (default 4)")
    up.add_argument(
        "--groups",
        type=int,
        default=None,
        metavar="G",
        help="replica groups: each holds a full copy of every partition (default: one per storage node)",
    )
    up.add_argument(
        "--tls",
        action="store_true",
        help="mutual TLS on every link, ZooKeeper's too, with a throwaway CA and certificates in D/tls "
        "(needs openssl)",
    )
    up.add_argument(
        "--base-port", type=int, default=None, metavar="P", help="use ports P, P+1, ... (default: free)"
    )
    up.add_argument(
        "--zk-port", type=int, default=None, metavar="P", help="ZooKeeper client port (default: free)"
    )
    up.add_argument(
        "--zookeepers",
        type=int,
        default=1,
        metavar="N",
        help="ZooKeeper processes: 1 (default) standalone, or 3, 5 or 7 as one ensemble (client ports "
        "--zk-port, --zk-port+1, ...)",
    )
    up.add_argument(
        "--zk-session-timeout-ms",
        type=int,
        default=local.DEFAULT_ZK_SESSION_TIMEOUT_MS,
        metavar="MS",
        help=f"servers' and storage nodes' ZooKeeper session timeout (default "
        f"{local.DEFAULT_ZK_SESSION_TIMEOUT_MS}: a killed server's partitions move within 3 s)",
    )
    up.add_argument("--timeout", type=float, default=60.0, metavar="S", help="start timeout in seconds")
    up.set_defaults(handler=cmd_up)


def _quiet_kazoo(args: argparse.Namespace) -> None:
    if not getattr(args, "verbose", False):
        # kazoo logs each failed connection attempt as a warning; the commands report outcomes themselves.
        logging.getLogger("kazoo").setLevel(logging.ERROR)


def cmd_up(args: argparse.Namespace) -> int:
    _quiet_kazoo(args)
    opts = local.UpOptions(
        directory=args.dir,
        storages=args.storages,
        servers=args.servers,
        partitions=args.partitions,
        groups=args.groups,
        tls=args.tls,
        base_port=args.base_port,
        zk_port=args.zk_port,
        zookeepers=args.zookeepers,
        zk_session_timeout_ms=args.zk_session_timeout_ms,
        start_timeout_s=args.timeout,
    )
    cluster = local.up(opts, report=lambda line: print(line, file=sys.stderr, flush=True))
    print(local.overview.render_up(cluster))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    _quiet_kazoo(args)
    result = local.status(args.dir)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(local.overview.render_status(result))
    running = all(p.running for p in result.processes)
    return 0 if running and result.all_served else 3


def cmd_down(args: argparse.Namespace) -> int:
    stopped = local.down(args.dir, purge=args.purge)
    print(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")
    if args.purge and args.dir.exists():
        kept = sorted(p.name for p in args.dir.iterdir())
        print(f"kept {args.dir}: it holds files `waltz local up` did not create ({', '.join(kept)})")
    return 0


def cmd_restart(args: argparse.Namespace) -> int:
    _quiet_kazoo(args)
    cluster = local.restart(
        args.dir, report=lambda line: print(line, file=sys.stderr, flush=True), timeout_s=args.timeout
    )
    print(local.overview.render_up(cluster))
    return 0


def _which(args: argparse.Namespace) -> tuple[str, int]:
    if args.zookeeper is not None:
        return "zookeeper", args.zookeeper
    return ("storage", args.storage) if args.storage is not None else ("server", args.server)


def cmd_kill(args: argparse.Namespace) -> int:
    kind, index = _which(args)
    rec = local.kill(args.dir, kind, index)
    print(f"killed {rec.name} (pid {rec.pid})")
    return 0


def cmd_start(args: argparse.Namespace) -> int:
    _quiet_kazoo(args)
    kind, index = _which(args)
    rec = local.start(args.dir, kind, index)
    print(f"started {rec.name} (pid {rec.pid}, port {rec.port})")
    return 0
