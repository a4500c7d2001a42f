"""Waltz against its peer, NATS JetStream, in one run: the same driver, the same workloads, side by side.

Starts a 3-node JetStream cluster on loopback (``bench/jetstream.py``: ``sync_interval: always``, an R3 file
stream, so every acknowledgement follows an fsync on a quorum), runs the phases against it, stops it; then
starts a ``waltz local`` cluster (ZooKeeper, 3 storage nodes, 1 server, 1 partition) and runs the same phases
through the public :class:`~waltz.AsyncWaltzClient` three times: ``waltz``, the client's default
configuration with the application's callbacks plain functions (which the default ``client.callbackMode``
runs on the callback threads); ``waltz-async``, the default configuration with coroutine callbacks, as
``docs/client.md``'s asyncio service writes them (the client awaits them on its loop); and ``waltz-tuned``
(``bench/client_peer.py``'s fast path: ``client.callbackMode: inline``, plain callbacks on the loop,
``client.maxConcurrentTransactions`` 128). Every record is 512 bytes; the driver (one process, uvloop) is
the same for every system.

=====  =====================================================================================================
phase  what it measures
=====  =====================================================================================================
conc   64 coroutines appending, each waiting for its own acknowledgement (64 outstanding)
seq    one append at a time; p50/p99 latency of submit to acknowledgement
occ64  64 writers, each conditional on its own key. Waltz: a write lock on the key, waiting for
       ``on_application``. JetStream: a publish to the key's subject with
       ``Nats-Expected-Last-Subject-Sequence`` set to the writer's last acknowledged sequence
hot64  64 writers conditional on ONE key; successes/s. Waltz: a write lock on the key (the client retries a
       lost race itself). JetStream: ``Nats-Expected-Last-Subject-Sequence`` with the latest sequence any
       writer has seen (from its own acks and the server's "wrong last sequence: N" answers); a lost race
       is retried at once with the sequence the answer names
=====  =====================================================================================================

Each phase runs a warm-up (``--warmup``, 1 s), then ``--seconds`` (or ``--count`` operations). The load
average is printed before each system and at the end, with the CPU the servers of each system spent per
operation (from ``/proc``): on a shared machine, read the rates against it. The whole comparison takes about
``3 x 4 x (1 + seconds)`` seconds plus the clusters' start-ups.

    .venv/bin/python bench/peer.py                    # every phase, 5 s each
    .venv/bin/python bench/peer.py --seconds 2 --phase conc --phase seq
    .venv/bin/python bench/peer.py --systems waltz,waltz-tuned
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from bench.client_app import PAYLOAD, AsyncCallbacks, AsyncCtx, Callbacks, Ctx  # noqa: E402
from bench.client_peer import cpu_gauge_ms  # noqa: E402
from bench.jetstream import JetStreamCluster  # noqa: E402
from bench.procstat import total_cpu_s  # noqa: E402

from waltz import AsyncWaltzClient, ClientConfig  # noqa: E402
from waltz.local import cluster as local  # noqa: E402

PHASES = ("conc", "seq", "occ64", "hot64")
SYSTEMS = ("jetstream", "waltz", "waltz-async", "waltz-tuned")
TUNED = {"client.callbackMode": "inline", "client.maxConcurrentTransactions": 128}
"""``bench/client_peer.py``'s fast path."""
STREAM = "BENCH"
WRONG_LAST_SEQUENCE = 10071
"""JetStream's error for a failed ``Nats-Expected-Last-Subject-Sequence``: "wrong last sequence: N"."""
WRONG_LAST_SEQUENCE_PENDING = 10164
"""The same without N: a clustered stream's leader answers so while an earlier message on the subject is
still being replicated (even the writer's own, acknowledged a moment before)."""
EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"


@dataclass
class Result:
    system: str
    phase: str
    ops: int
    seconds: float
    latencies_s: list[float]
    server_cpu_s: float

    @property
    def rate(self) -> float:
        return self.ops / self.seconds if self.seconds else 0.0

    def percentile_ms(self, q: float) -> float:
        lat = sorted(self.latencies_s)
        if not lat:
            return float("nan")
        if q == 0.5:
            return statistics.median(lat) * 1000
        return lat[min(len(lat) - 1, int(len(lat) * q))] * 1000

    def line(self) -> str:
        return (
            f"{self.system:12} {self.phase:6} {self.rate:9.0f} ops/s  p50 {self.percentile_ms(0.5):7.2f} ms  "
            f"p99 {self.percentile_ms(0.99):7.2f} ms  "
            f"servers {self.server_cpu_s * 1e6 / max(self.ops, 1):6.0f} us/op  "
            f"({self.ops} ops in {self.seconds:.1f} s)"
        )


Op = Callable[[int], Awaitable[bool]]
"""One operation of worker ``w``: True when it succeeded (counted), False when it failed."""


async def drive(system: str, phase: str, n: int, op: Op, args: argparse.Namespace, pids: list[int]) -> Result:
    """``n`` coroutines each running ``op(worker)`` in a loop: a warm-up, then ``--seconds`` measured."""
    loop = asyncio.get_running_loop()
    latencies: list[float] = []
    count = 0
    measuring = stop = False
    deadline = loop.time() + args.warmup + args.seconds

    async def worker(w: int) -> None:
        nonlocal count, stop
        while not stop:
            t0 = time.perf_counter()
            ok = await op(w)
            if measuring and ok:
                latencies.append(time.perf_counter() - t0)
                count += 1
                if count >= args.count or loop.time() > deadline:
                    stop = True

    tasks = [asyncio.create_task(worker(w)) for w in range(n)]
    await asyncio.sleep(args.warmup)
    measuring = True
    s0, t0 = total_cpu_s(pids), time.perf_counter()
    while not stop and not any(t.done() for t in tasks):
        await asyncio.sleep(0.05)
        if loop.time() > deadline + 30:
            stop = True  # A stuck phase ends (and says so through its count).
    elapsed = time.perf_counter() - t0
    s1 = total_cpu_s(pids)
    stop = True
    await asyncio.wait(tasks, timeout=30)
    for t in tasks:
        if t.done() and t.exception() is not None:
            raise RuntimeError(f"{system} {phase} failed") from t.exception()
    result = Result(system, phase, count, elapsed, latencies, s1 - s0)
    print(result.line(), flush=True)
    return result


# ------------------------------------------------------------------------------------------------ JetStream


async def jetstream_phases(cluster: JetStreamCluster, args: argparse.Namespace) -> list[Result]:
    import nats
    from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError

    nc = await nats.connect(servers=cluster.urls())
    js = nc.jetstream()
    deadline = time.monotonic() + 30
    while True:  # The cluster elects its meta leader first.
        try:
            await js.add_stream(name=STREAM, subjects=["bench.>"], num_replicas=3, storage="file")
            break
        except (ServiceUnavailableError, TimeoutError, nats.errors.TimeoutError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
    # Publish straight to the stream's leader (as a Waltz client talks to its partition's server).
    leader = None
    while leader is None and time.monotonic() < deadline:
        info = await js.stream_info(STREAM)
        leader = info.cluster.leader if info.cluster else None
        if leader is None:
            await asyncio.sleep(0.1)
    await nc.close()
    nc = await nats.connect(servers=[cluster.url_of(leader)] if leader else cluster.urls())
    js = nc.jetstream(timeout=30)
    print(f"jetstream: stream {STREAM} R3, leader {leader}", flush=True)
    pids = cluster.pids()

    async def publish(w: int) -> bool:
        await js.publish("bench.a", PAYLOAD, stream=STREAM)
        return True

    last_of_key: dict[int, int] = {}
    rejected = Counter[int]()

    async def conditional(w: int) -> bool:
        while True:  # The writer's own key: a rejection can only be "pending" (10164); try again.
            try:
                ack = await js.publish(
                    f"bench.k{w}",
                    PAYLOAD,
                    stream=STREAM,
                    headers={EXPECTED_LAST_SUBJECT_SEQ: str(last_of_key[w])},
                )
            except APIError as e:
                if e.err_code != WRONG_LAST_SEQUENCE_PENDING:
                    raise
                rejected[e.err_code] += 1
                continue
            last_of_key[w] = ack.seq
            return True

    hot = [0]

    async def hot_increment(w: int) -> bool:
        while True:  # Until this writer's increment lands (a Waltz client retries a lost race itself).
            try:
                ack = await js.publish(
                    "bench.hot", PAYLOAD, stream=STREAM, headers={EXPECTED_LAST_SUBJECT_SEQ: str(hot[0])}
                )
            except APIError as e:
                if e.err_code not in (WRONG_LAST_SEQUENCE, WRONG_LAST_SEQUENCE_PENDING):
                    raise
                rejected[e.err_code] += 1
                found = re.search(r"(\d+)\s*$", e.description or "")
                if found is None:  # Read the subject's last sequence, as an application would.
                    try:
                        hot[0] = max(hot[0], (await js.get_last_msg(STREAM, "bench.hot")).seq)
                    except NotFoundError:
                        pass  # The first message is still being replicated.
                else:
                    hot[0] = max(hot[0], int(found.group(1)))
                continue
            hot[0] = max(hot[0], ack.seq)
            return True

    ops: dict[str, tuple[int, Op]] = {
        "conc": (64, publish),
        "seq": (1, publish),
        "occ64": (64, conditional),
        "hot64": (64, hot_increment),
    }
    results = []
    try:
        for phase in args.phase:
            if phase == "occ64":
                last_of_key.update(dict.fromkeys(range(64), 0))  # 0: no message on the subject yet
            n, op = ops[phase]
            rejected.clear()
            results.append(await drive("jetstream", phase, n, op, args, pids))
            if rejected:
                print(f"jetstream {phase}: rejected publishes by error code {dict(rejected)}", flush=True)
            cluster.check_alive()
    finally:
        await nc.close()
    return results


# ------------------------------------------------------------------------------------------------ Waltz


async def waltz_phases(
    system: str, config: ClientConfig, args: argparse.Namespace, pids: list[int]
) -> list[Result]:
    loop = asyncio.get_running_loop()
    inline = config.callback_mode == "inline"
    coroutines = system == "waltz-async"
    context = AsyncCtx if coroutines else Ctx

    async with AsyncWaltzClient(AsyncCallbacks() if coroutines else Callbacks(), config) as client:

        async def one(lock: int | None = None, wait_apply: bool = False, header: int = 0) -> bool:
            future: asyncio.Future[bool] = loop.create_future()

            def done(ok: bool) -> None:
                if not future.done():
                    future.set_result(ok)

            await client.submit(context(loop, inline, done, lock, wait_apply, header))
            return await future

        ops: dict[str, tuple[int, Op]] = {
            "conc": (64, lambda w: one()),
            "seq": (1, lambda w: one()),
            "occ64": (64, lambda w: one(lock=w + 1, wait_apply=True)),
            "hot64": (64, lambda w: one(lock=1_000_000, wait_apply=True, header=1)),
        }
        results = []
        for phase in args.phase:
            n, op = ops[phase]
            results.append(await drive(system, phase, n, op, args, pids))
        await client.flush_transactions(30)
    return results


def run_waltz(args: argparse.Namespace, tmp: Path) -> list[Result]:
    import uvloop

    results: list[Result] = []
    cluster = local.up(local.UpOptions(directory=tmp / "waltz", storages=3, servers=1, partitions=1))
    try:
        pids = [r.pid for r in [*cluster.servers, *cluster.storages] if r.pid is not None]
        client_yaml = Path(cluster.directory) / "client.yaml"
        for system in ("waltz", "waltz-async", "waltz-tuned"):
            if system not in args.systems:
                continue
            overrides: dict[str, Any] = TUNED if system == "waltz-tuned" else {}
            config = ClientConfig.from_yaml(client_yaml, overrides)
            print(
                f"{system}: client.callbackMode {config.callback_mode}, client.maxConcurrentTransactions "
                f"{config.max_concurrent_transactions}; load average {os.getloadavg()}",
                flush=True,
            )
            results += uvloop.run(waltz_phases(system, config, args, pids))
    finally:
        local.down(cluster.directory, purge=True)
    return results


def run_jetstream(args: argparse.Namespace, tmp: Path) -> list[Result]:
    import uvloop

    cluster = JetStreamCluster(tmp / "jetstream")
    try:
        cluster.start()
        print(f"jetstream: 3 nodes on loopback; load average {os.getloadavg()}", flush=True)
        return uvloop.run(jetstream_phases(cluster, args))
    finally:
        cluster.stop()


# ------------------------------------------------------------------------------------------------ report


def table(results: list[Result]) -> str:
    """Side by side: a row per phase and figure, a column per system, then each Waltz column / JetStream."""
    by = {(r.system, r.phase): r for r in results}
    systems = [s for s in SYSTEMS if any(r.system == s for r in results)]
    phases = [p for p in PHASES if any(r.phase == p for r in results)]
    rows: list[tuple[str, Callable[[Result], float], bool]] = []
    for phase in phases:
        rows.append((f"{phase} ops/s", lambda r: r.rate, True))
        if phase == "seq":
            rows.append(("seq p50 ms", lambda r: r.percentile_ms(0.5), False))
            rows.append(("seq p99 ms", lambda r: r.percentile_ms(0.99), False))
    ratio_of = [s for s in systems if s != "jetstream"] if "jetstream" in systems else []
    head = f"{'':14}" + "".join(f"{s:>13}" for s in systems) + "".join(f"{s + '/js':>17}" for s in ratio_of)
    lines = [head]
    for label, figure, is_rate in rows:
        phase = label.split()[0]
        cells = [by.get((s, phase)) for s in systems]
        fmt = "{:13.0f}" if is_rate else "{:13.2f}"
        line = f"{label:14}" + "".join(fmt.format(figure(c)) if c else f"{'-':>13}" for c in cells)
        js = by.get(("jetstream", phase))
        for s in ratio_of:
            r = by.get((s, phase))
            line += f"{figure(r) / figure(js):16.2f}x" if r and js and figure(js) else f"{'-':>17}"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Result]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--phase", action="append", choices=PHASES, help="repeatable; default: all")
    parser.add_argument(
        "--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}"
    )
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per phase at most")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds before each phase's measure")
    parser.add_argument("--count", type=int, default=1_000_000, help="operations per phase at most")
    args = parser.parse_args(argv)
    args.phase = args.phase or list(PHASES)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(args.systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown system(s) {', '.join(sorted(unknown))}; choose from {', '.join(SYSTEMS)}")
    print(f"python {sys.version.split()[0]}; {os.cpu_count()} cpus", flush=True)
    print(f"load average at start: {os.getloadavg()}; cpu gauge {cpu_gauge_ms():.0f} ms", flush=True)
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="waltz-peer-") as tmp:
        if "jetstream" in args.systems:
            results += run_jetstream(args, Path(tmp))
        if {"waltz", "waltz-async", "waltz-tuned"} & set(args.systems):
            results += run_waltz(args, Path(tmp))
    print(f"load average at end: {os.getloadavg()}; cpu gauge {cpu_gauge_ms():.0f} ms", flush=True)
    print(table(results), flush=True)
    return results


if __name__ == "__main__":
    main()
