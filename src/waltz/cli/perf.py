"""``waltz perf producer|consumer``: throughput and latency of a cluster (a thin layer over
:mod:`waltz.perf.producer`). ``-c`` is a client YAML (``D/client.yaml`` from ``waltz local up``); ``--mock N``
runs against an in-memory MockDriver with N partitions instead, to try the tool without a cluster."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

from waltz.client.config import ClientConfig
from waltz.errors import ConfigError
from waltz.perf.common import DriverFactory, PerfResult, ProgressLine, network_driver
from waltz.perf.producer import ConsumerOptions, ProducerOptions, run_consumers, run_producers

T = TypeVar("T")


def register(groups: Any) -> None:
    parser = groups.add_parser("perf", help="measure append and read throughput and latency")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    prod = sub.add_parser("producer", help="clients append transactions; throughput, retries, latency")
    add_client_args(prod)
    prod.add_argument("--txn-size", type=int, default=512, metavar="BYTES", help="transaction size (512)")
    prod.add_argument("--txns-per-client", type=int, required=True, metavar="N")
    prod.add_argument("--clients", type=int, default=1, metavar="C", help="concurrent clients (1)")
    prod.add_argument("--interval-ms", type=float, default=0.0, metavar="MS", help="pause between submits")
    prod.add_argument(
        "--lock-pool-size",
        type=int,
        default=0,
        metavar="K",
        help="write lock on a random id < K (0: no locks)",
    )
    prod.add_argument("--partitions", type=int, default=None, metavar="P", help="use partitions 0..P-1")
    prod.add_argument(
        "--max-in-flight",
        type=int,
        default=None,
        metavar="N",
        help="appends in flight per partition and client (client.maxConcurrentTransactions; default: config)",
    )
    prod.add_argument("--json", action="store_true", help="print one JSON object")
    prod.set_defaults(handler=cmd_producer)

    cons = sub.add_parser("consumer", help="append N transactions, then time clients reading them")
    add_client_args(cons)
    cons.add_argument("--txn-size", type=int, default=512, metavar="BYTES")
    cons.add_argument("--num-txns", type=int, required=True, metavar="N")
    cons.add_argument("--clients", type=int, default=1, metavar="C", help="consumers, each reads all (1)")
    cons.add_argument("--partitions", type=int, default=None, metavar="P")
    cons.add_argument("--json", action="store_true")
    cons.set_defaults(handler=cmd_consumer)


def add_client_args(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "-c", "--client-config", metavar="FILE", help="client YAML (zookeeper.*, cluster.root)"
    )
    where.add_argument("--mock", type=int, metavar="PARTITIONS", help="in-memory MockDriver, no cluster")


def client_setup(args: argparse.Namespace) -> tuple[ClientConfig, DriverFactory]:
    """The client config and driver factory selected by ``-c`` or ``--mock``."""
    if not getattr(args, "verbose", False):
        logging.getLogger("kazoo").setLevel(logging.ERROR)
    if args.mock is not None:
        from waltz.testing import MockCluster, MockDriver

        if args.mock < 1:
            raise ConfigError(f"--mock needs a positive partition count, got {args.mock}")
        cluster = MockCluster(args.mock)
        return ClientConfig(), lambda: MockDriver(cluster=cluster)
    return ClientConfig.from_yaml(args.client_config), network_driver


def _print(result: PerfResult, as_json: bool) -> int:
    print(json.dumps(result.to_json()) if as_json else result.render())
    return 1 if result.failed else 0


def cmd_producer(args: argparse.Namespace) -> int:
    config, drivers = client_setup(args)
    opts = ProducerOptions(
        txn_size_bytes=args.txn_size,
        txns_per_client=args.txns_per_client,
        clients=args.clients,
        interval_ms=args.interval_ms,
        lock_pool_size=args.lock_pool_size,
        partitions=args.partitions,
        max_in_flight=args.max_in_flight,
    )
    with progress_line(not args.json) as show:
        result = run_on_fast_loop(run_producers(config, opts, drivers, show_progress=show))
    return _print(result, args.json)


def cmd_consumer(args: argparse.Namespace) -> int:
    config, drivers = client_setup(args)
    opts = ConsumerOptions(
        txn_size_bytes=args.txn_size, num_txns=args.num_txns, clients=args.clients, partitions=args.partitions
    )
    with progress_line(not args.json) as show:
        result = run_on_fast_loop(run_consumers(config, opts, drivers, show_progress=show))
    return _print(result, args.json)


@contextlib.contextmanager
def progress_line(wanted: bool) -> Iterator[ProgressLine | None]:
    """A live line on stderr (rich), refreshed by the tool twice a second; None when not wanted or when
    stderr is not a terminal (logs and pipes get the final report only)."""
    if not wanted or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.live import Live

    with Live(console=Console(stderr=True), transient=True, auto_refresh=False) as live:
        yield lambda line: live.update(line, refresh=True)


def run_on_fast_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run a tool on uvloop when it is installed (the loop an asyncio application would pick for speed)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
