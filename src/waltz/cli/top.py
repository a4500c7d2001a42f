"""``waltz top``: a live view of a cluster, refreshed every second (the data: :mod:`waltz.ops.top`).

``rich`` is imported here, lazily, and nowhere in the servers, storage nodes or the client library: only the
commands that draw use it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

from waltz.cli.common import load_cli_config, load_cli_tls

_HEALTH_STYLE = {"ok": "green", "degraded": "yellow", "unhealthy": "red", "unserved": "bold red"}
_REPLICA_STYLE = {
    "ok": "green",
    "behind": "yellow",
    "offline": "red",
    "unassigned": "red",
    "down": "bold red",
}


def register(groups: Any) -> None:
    p = groups.add_parser("top", help="live view of a cluster: partitions, replicas, processes")
    p.add_argument(
        "-c",
        "--cli-config-path",
        required=True,
        metavar="FILE",
        help="CLI or client YAML (zookeeper.*, cluster.root, and ssl.* or client.ssl.* for TLS)",
    )
    p.add_argument(
        "--once", action="store_true", help="print one frame and exit (also when not on a terminal)"
    )
    p.add_argument("--interval", type=float, default=1.0, metavar="S", help="seconds between frames (1)")
    p.add_argument("--timeout", type=float, default=2.0, metavar="S", help="time allowed per process (2)")
    p.set_defaults(handler=cmd_top)


def cmd_top(args: argparse.Namespace) -> int:
    from waltz.cluster import zk
    from waltz.ops.top import TopSnapshot, gather

    cfg = load_cli_config(args.cli_config_path)
    ssl = load_cli_tls(args.cli_config_path).client_context(args.cli_config_path)
    interval_s = max(0.2, args.interval)
    once = args.once or not sys.stdout.isatty()

    with zk.session(cfg, str(args.cli_config_path)) as client:

        async def snapshot(previous: TopSnapshot | None) -> TopSnapshot:
            return await gather(
                client, cfg["cluster.root"], ssl=ssl, previous=previous, timeout_s=args.timeout
            )

        if once:
            # Two reads a short moment apart, so the frame shows append rates too.
            first = asyncio.run(snapshot(None))
            time.sleep(min(interval_s, 1.0))
            frame = asyncio.run(snapshot(first))
            print_frame(frame)
            return 0 if frame.healthy else 1
        return _live(snapshot, interval_s)


def _live(snapshot: Any, interval_s: float) -> int:
    from rich.live import Live

    async def loop() -> None:
        previous = await snapshot(None)
        with Live(render(previous), auto_refresh=False, screen=False) as live:
            while True:
                await asyncio.sleep(interval_s)
                previous = await snapshot(previous)
                live.update(render(previous), refresh=True)

    try:
        asyncio.run(loop())
    except KeyboardInterrupt:
        pass
    return 0


def print_frame(frame: Any) -> None:
    """Print one frame on stdout (plain text when stdout is not a terminal)."""
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        # Off a terminal rich assumes 80 columns; a frame in a file or a pipe should not wrap its columns.
        console = Console(width=160)
    console.print(render(frame))


def render(frame: Any) -> Any:
    """The frame as rich renderables: a header line, the partitions table, the processes table."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    problems = sum(1 for p in frame.partitions if p.health != "ok")
    down = sum(1 for p in frame.processes if not p.alive)
    header = Text.assemble(
        (f"waltz top — cluster {frame.cluster} ({frame.root}) ", "bold"),
        (time.strftime("%H:%M:%S"), "dim"),
        "  ",
        (f"{len(frame.partitions)} partitions, {problems} not ok", "green" if not problems else "yellow"),
        "; ",
        (f"{len(frame.processes)} processes, {down} down", "green" if not down else "red"),
    )
    parts = Table(title="partitions", title_justify="left", expand=False)
    for column, justify in (
        ("partition", "right"),
        ("health", "left"),
        ("owner", "left"),
        ("generation", "right"),
        ("high-water mark", "right"),
        ("appends/s", "right"),
        ("replicas (state lag)", "left"),
    ):
        parts.add_column(column, justify=justify, no_wrap=column in ("owner", "replicas (state lag)"))  # type: ignore[arg-type]
    for p in frame.partitions:
        replicas = Text()
        for i, r in enumerate(p.replicas):
            if i:
                replicas.append("\n")
            lag = "" if r.lag < 0 else f" {r.lag}"
            replicas.append(f"{r.storage} {r.state}{lag}", _REPLICA_STYLE.get(r.state, ""))
        parts.add_row(
            str(p.partition),
            Text(p.health, _HEALTH_STYLE.get(p.health, "")),
            p.owner,
            str(p.generation),
            "?" if p.high_water_mark is None else str(p.high_water_mark),
            "-" if p.append_rate is None else f"{p.append_rate:,.0f}",
            replicas,
        )
    procs = Table(title="processes", title_justify="left")
    for column in ("kind", "address", "alive", "detail"):
        procs.add_column(column, no_wrap=column == "address")
    for proc in frame.processes:
        procs.add_row(
            proc.kind,
            proc.address,
            Text("up", "green") if proc.alive else Text("DOWN", "bold red"),
            proc.detail,
        )
    return Group(header, parts, procs)
