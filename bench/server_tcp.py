"""The server's CPU per append with its transport: the append path of ``bench/server_path.py`` over real
sockets on both sides, in one measured process.

``bench/server_path.py`` hands decoded frames to the partition and stubs the storage nodes, so it leaves out
what the transport costs the server: the socket reads and the frame decoding of the client's appends, the
FeedData writes, and the storage requests and answers. This bench keeps all of them:

* this process (the one measured): the server's append path as ``server.py`` runs it (``serve()``,
  ``FramedConnection.serve_payloads``, ``decode_append_fields``, ``Partition.append_nowait`` with
  ``read_ahead``, the feed written by ``ClientConnection``), over a ``StorePartition`` whose replicas are
  three real storage nodes reached through ``TcpReplicaConnector`` (``RpcClient`` on ``FramedConnection``);
  no ZooKeeper (the partition metadata is kept in memory, the nodes trust every session);
* child processes (not measured; under valgrind they are exec'd, so they run natively): three storage nodes
  (``waltz storage run`` on a tmpfs directory, so no fsync is slow) and the public ``AsyncWaltzClient``
  appending 512-byte records (``--phase conc``: 64 coroutines, each waiting for its own ``on_completion``;
  ``seq``: one at a time), after a warm-up of a fixed count. With ``--partitions N`` the cluster has N
  partitions, all served here, and the appends go to them in turn; ``--multi`` lets the appends for several
  partitions share a storage request (``MultiAppendRequest``, as from cluster feature version 3).

Prints the server's CPU per append (process time over the measured appends) and the appends per storage
request. Under ``valgrind --tool=callgrind`` the run is a fixed amount of work: ``bench/instructions.sh``
runs it at N and 3N appends and divides the difference (start-up cancels).

    PYTHONPATH=src .venv/bin/python bench/server_tcp.py --appends 20000
    PYTHONPATH=src .venv/bin/python bench/server_tcp.py --appends 5000 --partitions 256 --multi
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import inspect
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))

from client_cpu import Callbacks, Ctx, StaticDiscovery
from storage_append import KEY, start_node
from waltz import AsyncWaltzClient, ClientConfig, Transaction
from waltz.client.network import NetworkDriver
from waltz.protocol import client_server as cs
from waltz.protocol.framing import MAGIC_CLIENT
from waltz.server.adapters import TcpReplicaConnector
from waltz.server.connection import ClientConnection
from waltz.server.feed_cache import FeedCache
from waltz.server.partition import Partition
from waltz.server.storage_client import AdminClient
from waltz.server.store.store_partition import StorePartition
from waltz.server.transaction_cache import TransactionCache
from waltz.testing.store import MemoryMetadataStore
from waltz.transport import FramedConnection, serve

GENERATION = 1
WARMUP_APPENDS = 1000
APPEND_TYPE = int(cs.MessageType.APPEND_REQUEST)


# ------------------------------------------------------------------------------ the client (a child process)


def _resolve(future: asyncio.Future[bool], ok: bool) -> None:
    if not future.done():
        future.set_result(ok)


class PartitionsDiscovery(StaticDiscovery):
    """``partitions`` partitions, all placed on the server measured."""

    def __init__(self, endpoint: str, partitions: int) -> None:
        super().__init__(endpoint)
        self.num_partitions = partitions
        self.endpoints = dict.fromkeys(range(partitions), (endpoint, 1))


class PartitionsCallbacks(Callbacks):
    """The client's high-water mark of each partition."""

    def __init__(self) -> None:
        super().__init__()
        self.hwms: dict[int, int] = {}

    def client_high_water_mark(self, partition_id: int) -> int:
        return self.hwms.get(partition_id, -1)

    def apply_transaction(self, transaction: Transaction) -> None:
        self.hwms[transaction.partition_id] = transaction.transaction_id


class PartitionCtx(Ctx):
    """An append to ``partition``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, done: Callable[[bool], None], partition: int) -> None:
        super().__init__(loop, True, done, partition=partition)


def load(
    endpoint: str, phase: str, appends: int, partitions: int, done: multiprocessing.connection.Connection
) -> None:
    """The child process: WARMUP_APPENDS, then ``appends`` more (to the partitions in turn), then a word on
    ``done``."""

    async def main() -> None:
        config = ClientConfig(max_concurrent_transactions=128, callback_mode="inline")
        discovery = PartitionsDiscovery(endpoint, partitions)
        driver = NetworkDriver(config, discovery=discovery)  # type: ignore[arg-type]
        loop = asyncio.get_running_loop()
        total = WARMUP_APPENDS + appends
        issued = count = 0

        async def worker() -> None:
            nonlocal issued, count
            while issued < total:  # exactly ``total`` appends, however many workers
                issued += 1
                future: asyncio.Future[bool] = loop.create_future()
                await client.submit(
                    PartitionCtx(loop, functools.partial(_resolve, future), issued % partitions)
                )
                if await future:
                    count += 1
                else:
                    issued -= 1

        async with AsyncWaltzClient(PartitionsCallbacks(), config, driver=driver) as client:
            await asyncio.gather(*(worker() for _ in range(64 if phase == "conc" else 1)))
        done.send(count)

    uvloop.run(main())


# ----------------------------------------------------------------------------- the server (this process)


async def serve_client(
    conn: FramedConnection, parts: list[Partition], tasks: set[asyncio.Task[None]]
) -> None:
    """A client connection as ``WaltzServer._serve_client`` serves it."""
    peer = ClientConnection(conn, 1024, 4 * 1024 * 1024)
    version = conn.negotiated_version
    decode_append = cs.decode_append_fields

    def on_payload(payload: bytes) -> object:
        if payload[0] == APPEND_TYPE:
            msg = decode_append(payload, version)
            part = parts[msg.req_id.partition_id]
            if part.append_nowait(peer, msg, conn.read_ahead):
                return None
            return part.append(peer, msg)  # no room in the queue: wait (reading pauses meanwhile)
        msg = cs.decode(payload, version)
        part = parts[msg.req_id.partition_id]
        if peer.client_id is None:
            peer.client_id = msg.req_id.client_id
        if isinstance(msg, cs.FeedRequest):
            part.feed_request(peer, msg)
        elif isinstance(msg, cs.MountRequest):
            peer.mounts[msg.req_id.partition_id] = msg.req_id
            task = asyncio.create_task(part.mount(peer, msg))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        else:
            print(f"unexpected {type(msg).__name__} from the client", file=sys.stderr)
        return None

    try:
        await conn.serve_payloads(on_payload)  # type: ignore[arg-type]
    finally:
        for part in parts:
            part.disconnect(peer)


def callgrind(args: argparse.Namespace, on: bool) -> None:
    """With ``--callgrind-toggle`` (under ``valgrind --tool=callgrind --instr-atstart=no``): count from the
    client's connection to its last append only, so the start-up's variable work does not blur the figure."""
    if args.callgrind_toggle:
        cmd = ["callgrind_control", "-i", "on" if on else "off", str(os.getpid())]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


async def assign(admin_ports: list[int], partitions: int) -> None:
    for port in admin_ports:
        admin = await AdminClient.connect("127.0.0.1", port, KEY, partitions)
        try:
            await admin.set_assigned(list(range(partitions)), True)
        finally:
            await admin.aclose()


def quiet_store_config() -> dict[str, object]:
    """No idle probes during the run: each replica session's probe timer fires about once a second of wall
    time, and under valgrind (where the run lasts many seconds) 256 partitions' 768 timers cost more
    instructions than the appends themselves, in proportion to the machine's speed. A tree without
    StoreConfig's probe settings runs with its defaults."""
    try:
        from waltz.server.store.support import StoreConfig

        hour_ms = 3_600_000
        return {"config": StoreConfig(idle_probe_interval_ms=hour_ms, idle_probe_max_interval_ms=hour_ms)}
    except (ImportError, TypeError):
        return {}


async def run(args: argparse.Namespace, ports: list[int]) -> float:
    storages = [f"127.0.0.1:{port}" for port in ports]
    connector = TcpReplicaConnector(KEY, args.partitions)
    if args.multi:
        connector.allow_multi_append(True)
    metadata, transaction_cache = MemoryMetadataStore(), TransactionCache()
    feed_cache = FeedCache(num_partitions=args.partitions)
    parts = []
    quiet = quiet_store_config()
    for p in range(args.partitions):
        store = StorePartition(p, GENERATION, storages, connector=connector, metadata_store=metadata, **quiet)
        parts.append(Partition(p, store, feed_cache=feed_cache, transaction_cache=transaction_cache))
    for part in parts:
        await part.start()
    for part in parts:
        await part.wait_ready()
    tasks: set[asyncio.Task[None]] = set()
    # A tree from before the one read path served payloads only on callback_reads connections.
    old = {"callback_reads": True} if "callback_reads" in inspect.signature(serve).parameters else {}
    server = await serve(
        "127.0.0.1",
        0,
        lambda conn: serve_client(conn, parts, tasks),
        magic=MAGIC_CLIENT,
        versions=cs.SUPPORTED_VERSIONS,
        hello_text="bench",
        **old,
    )
    ours, theirs = multiprocessing.Pipe()
    ctx = multiprocessing.get_context("spawn")  # exec'd: not traced by valgrind
    endpoint = f"127.0.0.1:{server.port}"
    child = ctx.Process(target=load, args=(endpoint, args.phase, args.appends, args.partitions, theirs))
    child.start()
    loop = asyncio.get_running_loop()
    finished: asyncio.Future[None] = loop.create_future()
    # Woken by the pipe, not by polling: the run does the same work whatever it lasts.
    loop.add_reader(ours.fileno(), lambda: finished.done() or finished.set_result(None))
    callgrind(args, True)
    started = time.process_time()
    try:
        await finished
        elapsed = time.process_time() - started
        callgrind(args, False)
        try:
            appended = ours.recv()
        except EOFError:  # the client failed (its traceback is on stderr)
            appended = 0
        if appended != WARMUP_APPENDS + args.appends:
            raise SystemExit(f"the client appended {appended} of {WARMUP_APPENDS + args.appends}")
    finally:
        loop.remove_reader(ours.fileno())
        child.join(30)
        if child.is_alive():
            child.kill()
        server.close()
        await server.wait_closed()
        # Storage requests that carried several partitions' appends (a tree without them has none).
        multi = sum(getattr(c, "multi_requests", 0) for c in connector._clients.values())
        print(f"multi-append requests: {multi}", flush=True)
        for part in parts:
            await part.close()
        await connector.aclose()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--appends", type=int, default=20_000, help="measured appends (after the warm-up)")
    parser.add_argument("--phase", choices=("conc", "seq"), default="conc")
    parser.add_argument("--partitions", type=int, default=1, help="partitions, appended to in turn")
    parser.add_argument(
        "--multi", action="store_true", help="appends for several partitions may share a storage request"
    )
    parser.add_argument(
        "--callgrind-toggle",
        action="store_true",
        help="switch callgrind's counting on for the appends only (run valgrind with --instr-atstart=no)",
    )
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    args = parser.parse_args()
    try:
        from waltz.runtime import tune_gc
    except ImportError:  # a tree from before waltz.runtime
        from waltz.transport import tune_gc  # type: ignore[attr-defined,no-redef]

    tune_gc()  # as `waltz server run` does
    # Stopped with SIGTERM, this process still stops its storage nodes (the finally below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    root = Path(tempfile.mkdtemp(prefix="waltz-server-tcp-", dir=args.dir))
    nodes = []
    try:
        for i in range(3):
            (root / f"s{i}").mkdir()
            nodes.append(start_node(root / f"s{i}", "uvloop", partitions=args.partitions))
        uvloop.run(assign([admin for _, _, admin in nodes], args.partitions))
        cpu_s = uvloop.run(run(args, [port for _, port, _ in nodes]))
        total = args.appends + WARMUP_APPENDS
        print(
            f"{args.phase}: server CPU {cpu_s * 1e6 / total:.1f} us/append ({total} appends with the warm-up)"
        )
    finally:
        for proc, _, _ in nodes:
            proc.terminate()
        for proc, _, _ in nodes:
            proc.wait(30)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
