"""The client library's own CPU per committed append, against a fake server that commits everything at once.

``bench/client_peer.py`` measures the client against a real cluster, whose server and storage nodes share
the machine's cores: its client CPU per op moves with their load and with how many appends each read
carries. This bench isolates the client: a fake server in a child process (not measured) answers a mount
with READY and every AppendRequest with the FeedData that commits it (ids 0, 1, 2 ... in arrival order, no
lock checks, nothing stored), one write per read. The client is the public ``AsyncWaltzClient`` over the
real network driver (a static discovery instead of ZooKeeper), running the phases of ``client_peer.py``:

=========  ==================================================================================================
conc       64 coroutines appending, each waiting for its own ``on_completion``
occ64      64 writers, each with a write lock on its own key, each waiting for its own ``on_application``
app64      occ64 without the locks (64 writers, each waiting for its own ``on_application``): occ64 minus
           app64 is what the write locks cost
=========  ==================================================================================================

``--partitions N`` (N > 1) spreads the phase over N partitions instead: N writers, writer ``w`` appending to
partition ``w``, one append in flight on each (every commit then reaches the client as its own feed run).

The application is ``client_peer.py``'s (``bench/client_app.py``): its ``execute``, hooks and
``apply_transaction`` are coroutine functions, which the client's default ``client.callbackMode`` awaits on
its loop (``--plain``: plain functions, which that mode runs on the callback threads and ``--mode inline``
on the loop).

Per phase it prints ops/s and client CPU per op (``time.process_time`` of this process over the measured
seconds). Compare two source trees with the same command and ``PYTHONPATH`` at each tree's ``src``.

    PYTHONPATH=src .venv/bin/python bench/client_cpu.py --seconds 3 --phase conc --phase occ64
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

from prometheus_client import CollectorRegistry

# The repository root (not its src: PYTHONPATH names the tree under test), for bench.client_app.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.client_app import AsyncCallbacks, AsyncCtx, Callbacks, Ctx

from waltz import AsyncWaltzClient, ClientConfig
from waltz.client.network import NetworkDriver
from waltz.protocol import client_server as cs
from waltz.protocol.framing import MAGIC_CLIENT
from waltz.transport import FramedConnection, serve

WARMUP_S = 1.0
WARMUP_OPS = 500


def fake_server(port_out: multiprocessing.connection.Connection) -> None:  # type: ignore[name-defined]
    """The child process: commit every append at once, in arrival order."""

    async def handle(conn: FramedConnection) -> None:
        version = conn.negotiated_version
        next_ids: dict[int, int] = {}  # Per partition.
        append_type = int(cs.MessageType.APPEND_REQUEST)

        def on_payload(payload: bytes) -> None:
            # From the data callback: the answers to one read leave in one write when it returns.
            if payload[0] == append_type:
                request = cs.decode_append_request(payload, version)
                p = request.req_id.partition_id
                next_id = next_ids.get(p, 0)
                conn.send(cs.encode(cs.FeedData(request.req_id, next_id, request.header), version))
                next_ids[p] = next_id + 1
                return
            msg = cs.decode(payload, version)
            if isinstance(msg, cs.MountRequest):
                next_ids[msg.req_id.partition_id] = msg.client_high_water_mark + 1
                conn.send(cs.encode(cs.MountResponse(msg.req_id, cs.PartitionState.READY), version))

        await conn.serve_payloads(on_payload)

    async def main() -> None:
        # A tree from before the one read path served payloads only on callback_reads connections.
        old = {"callback_reads": True} if "callback_reads" in inspect.signature(serve).parameters else {}
        server = await serve(
            "127.0.0.1",
            0,
            handle,
            magic=MAGIC_CLIENT,
            versions=cs.SUPPORTED_VERSIONS,
            hello_text="fake",
            **old,
        )
        port_out.send(server.port)
        await asyncio.Event().wait()

    asyncio.run(main())


class StaticDiscovery:
    """``num_partitions`` partitions, all placed on the fake server."""

    def __init__(self, endpoint: str, num_partitions: int = 1) -> None:
        self.num_partitions = num_partitions
        self.cluster_name = "fake"
        self.endpoints = dict.fromkeys(range(num_partitions), (endpoint, 1))

    async def open(self) -> None:
        pass

    async def new_client_id(self) -> int:
        return 7

    async def updates(self) -> AsyncIterator[dict[int, tuple[str, int]]]:
        yield dict(self.endpoints)
        await asyncio.Event().wait()

    async def close(self) -> None:
        pass


def callgrind(on: bool) -> None:
    """Switch callgrind's counting of this process on or off (run under ``--instr-atstart=no``)."""
    cmd = ["callgrind_control", "-i", "on" if on else "off", str(os.getpid())]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


async def run_phase(
    client: AsyncWaltzClient,
    phase: str,
    seconds: float,
    count: int | None,
    toggle: bool = False,
    ctx_type: type[Ctx] = Ctx,
    inline: bool = False,
    partitions: int = 1,
) -> str:
    """``phase`` for ``seconds`` after a warm-up of WARMUP_S, or (``count`` given) for ``count``
    operations after WARMUP_OPS: a fixed amount of work, for an instruction count under
    ``valgrind --tool=callgrind``. ``partitions`` > 1: one writer per partition instead of 64 on one."""
    loop = asyncio.get_running_loop()
    done_ops = 0
    stop = False
    finished = loop.create_future()
    warm = asyncio.Event()

    async def one(lock: int | None, wait_apply: bool, partition: int) -> bool:
        future: asyncio.Future[bool] = loop.create_future()

        def done(ok: bool) -> None:
            if not future.done():
                future.set_result(ok)

        await client.submit(ctx_type(loop, inline, done, lock, wait_apply, partition=partition))
        return await future

    async def worker(w: int) -> None:
        nonlocal done_ops, stop
        lock = w + 1 if phase == "occ64" else None
        wait_apply = phase in ("occ64", "app64")
        partition = w if partitions > 1 else 0
        while not stop:
            if await one(lock, wait_apply, partition):
                done_ops += 1
                if done_ops == WARMUP_OPS:
                    warm.set()
                if count is not None and done_ops >= WARMUP_OPS + count and not finished.done():
                    stop = True
                    finished.set_result(None)

    tasks = [asyncio.create_task(worker(w)) for w in range(partitions if partitions > 1 else 64)]
    if count is None:
        await asyncio.sleep(WARMUP_S)
    else:
        await warm.wait()
    if toggle:
        callgrind(True)  # the loop waits meanwhile: no append is half counted
    n0, c0, t0 = done_ops, time.process_time(), time.perf_counter()
    if count is None:
        await asyncio.sleep(seconds)
    else:
        await finished
    c1, t1 = time.process_time(), time.perf_counter()
    if toggle:
        callgrind(False)
    n = done_ops - n0
    stop = True
    await asyncio.wait(tasks, timeout=30)
    return f"{phase:6} {n / (t1 - t0):9.0f} ops/s  client {(c1 - c0) * 1e6 / max(n, 1):6.2f} us/op  ({n} ops)"


async def main_async(args: argparse.Namespace, endpoint: str) -> None:
    config = ClientConfig(max_concurrent_transactions=128, callback_mode=args.mode)
    callbacks, ctx_type = (Callbacks(), Ctx) if args.plain else (AsyncCallbacks(), AsyncCtx)
    discovery = StaticDiscovery(endpoint, args.partitions)
    driver = NetworkDriver(config, discovery=discovery)  # type: ignore[arg-type]
    # --metrics: the client's Prometheus metrics on (waltz.client.metrics), in a registry nobody scrapes.
    # (Not passed without it: a tree from before the client's metrics runs this bench too.)
    metrics = {"metrics_registry": CollectorRegistry()} if args.metrics else {}
    inline = args.mode == "inline"  # plain hooks on the loop; else on the callback threads
    async with AsyncWaltzClient(callbacks, config, driver=driver, **metrics) as client:
        for phase in args.phase:
            result = await run_phase(
                client,
                phase,
                args.seconds,
                args.count,
                args.callgrind_toggle,
                ctx_type,
                inline,
                args.partitions,
            )
            print(result, flush=True)
        await client.flush_transactions(30)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=("auto", "inline", "threads"), default="auto")
    parser.add_argument("--plain", action="store_true", help="plain-function callbacks (inline: the loop)")
    parser.add_argument(
        "--phase", action="append", choices=("conc", "occ64", "app64"), help="default: conc, occ64"
    )
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--count", type=int, help="measure this many operations instead of --seconds")
    parser.add_argument(
        "--callgrind-toggle",
        action="store_true",
        help="count instructions of the measured operations only (run valgrind with --instr-atstart=no)",
    )
    parser.add_argument("--metrics", action="store_true", help="with the client's metrics_registry")
    parser.add_argument(
        "--partitions",
        type=int,
        default=1,
        help="spread over this many partitions, one append in flight on each",
    )
    args = parser.parse_args()
    args.phase = args.phase or ["conc", "occ64"]
    print(f"load average at start: {os.getloadavg()}", flush=True)
    ours, theirs = multiprocessing.Pipe()
    child = multiprocessing.get_context("spawn").Process(target=fake_server, args=(theirs,), daemon=True)
    child.start()
    try:
        port = ours.recv()
        import uvloop

        uvloop.run(main_async(args, f"127.0.0.1:{port}"))
    finally:
        child.terminate()
        child.join()
    print(f"load average at end: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
