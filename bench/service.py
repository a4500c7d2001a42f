"""The tutorial's asyncio service against a real cluster, with the client's default configuration.

Runs the counter service of ``docs/client.md`` ("An asyncio service": the python block that starts with
``# The counter service``, executed as it stands in the doc, which ``tests/unit/client/test_docs.py`` also
runs): 64 requests at a time, each appending one increment and awaiting its commit, over the partitions
of the cluster, while the service applies every increment (fetching its data). The configuration is the
cluster's ``client.yaml`` as ``waltz local`` writes it: the client's defaults. Prints commits/s (wall clock:
meaningless on a loaded machine), the client's CPU per commit (``time.process_time`` of this process, which
runs only the service and its client, over the measured requests) and the load average.

Without ``--client-config`` it starts a ``waltz local`` cluster (ZooKeeper, 3 storage nodes, 1 server,
``--partitions`` partitions) in a temporary directory and stops it at the end. With ``--client-config`` it
uses a running cluster, and the service starts from the partitions' current high-water marks instead of
replaying the log, so that runs of N and 3N requests under callgrind differ by 2N requests' work only::

    .venv/bin/python bench/service.py --requests 20000
    waltz local up D --servers 1 && for n in 1000 3000; do valgrind --tool=callgrind \\
        --callgrind-out-file=service-$n.cg .venv/bin/python bench/service.py --client-config D/client.yaml \\
        --requests $n --warmup 0; done
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if not os.environ.get("PYTHONPATH"):  # PYTHONPATH=OTHER/src measures another tree's client.
    sys.path.insert(0, str(ROOT / "src"))

from waltz import AsyncWaltzClient, ClientConfig  # noqa: E402
from waltz.client.reader import LogReader  # noqa: E402

DOC = ROOT / "docs" / "client.md"
MARKER = "# The counter service"


def service_code() -> dict[str, Any]:
    """The doc's service block, executed: its namespace (``Counters``, ``serve``, ...)."""
    blocks = re.findall(r"^```python\n(.*?)^```", DOC.read_text(encoding="utf-8"), flags=re.DOTALL | re.M)
    chosen = [b for b in blocks if b.startswith(MARKER)]
    if len(chosen) != 1:
        raise SystemExit(f"{DOC}: expected one python block starting with {MARKER!r}, found {len(chosen)}")
    namespace: dict[str, Any] = {"__name__": "service"}
    exec(compile(chosen[0], str(DOC), "exec"), namespace)
    return namespace


async def current_marks(config: ClientConfig) -> dict[int, int]:
    async with LogReader(config) as reader:
        return {p: await reader.high_water_mark(p) for p in range(reader.num_partitions)}


async def run(config: ClientConfig, args: argparse.Namespace, resume: bool) -> None:
    service = service_code()
    counters = service["Counters"]()
    if resume:
        counters.marks.update(await current_marks(config))
    async with AsyncWaltzClient(counters, config) as client:
        if args.warmup:
            await service["serve"](client, args.warmup, args.concurrency)
            await client.flush_transactions(timeout=60)
        applied_before = sum(counters.values.values())
        cpu0, wall0 = time.process_time(), time.perf_counter()
        await service["serve"](client, args.requests, args.concurrency)
        await client.flush_transactions(timeout=60)  # Every increment applied, too.
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        applied = sum(counters.values.values()) - applied_before
    if applied != args.requests:
        raise SystemExit(f"applied {applied} increments, expected {args.requests}")
    print(
        f"service: {args.requests / wall:,.0f} commits/s, client CPU {cpu / args.requests * 1e6:.1f} us "
        f"per commit ({args.requests} requests, {args.concurrency} at a time, "
        f"{client.num_partitions} partitions, "
        f"{wall:.1f} s; callbackMode {config.callback_mode}, maxConcurrentTransactions "
        f"{config.max_concurrent_transactions})",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=20_000, help="measured requests")
    parser.add_argument("--warmup", type=int, default=2_000, help="requests before the measured ones")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight")
    parser.add_argument("--partitions", type=int, default=4, help="of the cluster this starts")
    parser.add_argument("--client-config", type=Path, help="a running cluster's client.yaml")
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio", help="the doc's: asyncio")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a client config key")
    args = parser.parse_args()
    overrides: dict[str, Any] = {}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = int(value) if value.isdigit() else value
    runner = asyncio.run
    if args.loop == "uvloop":
        import uvloop

        runner = uvloop.run
    print(f"load average at start: {os.getloadavg()}", flush=True)
    if args.client_config is not None:
        runner(run(ClientConfig.from_yaml(args.client_config, overrides), args, resume=True))
    else:
        from waltz.local import cluster as local

        with tempfile.TemporaryDirectory(prefix="waltz-service-") as tmp:
            opts = local.UpOptions(Path(tmp) / "cluster", storages=3, servers=1, partitions=args.partitions)
            cluster = local.up(opts)
            try:
                config = ClientConfig.from_yaml(Path(cluster.directory) / "client.yaml", overrides)
                runner(run(config, args, resume=False))
            finally:
                local.down(cluster.directory, purge=True)
    print(f"load average at end: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
