"""Many client processes against one cluster, fairly: ``bench/client_peer.py``'s ``clients`` phase.

``run(client_yaml, ...)`` starts client processes (this file with ``--child``), each one
:class:`~waltz.AsyncWaltzClient` with ``in_flight`` coroutines appending 512-byte records to partition 0,
each waiting for its own ``on_completion``. First ONE process with ``clients x in_flight`` in flight (the
one-process figure), then ``clients`` processes with ``in_flight`` each: the same total in flight, the same
code, so the two rates compare like for like.

Every child connects and makes one append, then says ``ready`` on stdout; when all are ready the parent
writes ``go START END`` (wall-clock seconds, ``time.time()``) to each child's stdin. A child appends from the
``go`` on and counts the appends acknowledged between START (after a warm-up) and END, so that every child
measures the same window; it answers one JSON line (``count``, its CPU seconds, latencies' p50/p99) and
exits. The parent prints the aggregate rate against the one-process rate and the per-client rates
(min / mean / max; the goal: no client below half the mean).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

READY_TIMEOUT_S = 180.0
"""Time for every child to start, connect and commit its first append (32 interpreters on a busy machine)."""
WARMUP_S = 1.0
START_MARGIN_S = 0.3
"""Between the ``go`` line and the window's start beyond the warm-up: time to write 32 lines."""


@dataclass
class ChildResult:
    count: int
    cpu_s: float
    p50_ms: float
    p99_ms: float


@dataclass
class Run:
    processes: int
    in_flight: int
    seconds: float
    children: list[ChildResult]
    server_cpu_s: float = 0.0
    """CPU of the cluster's processes (``pids``) over the window."""
    server_alone_cpu_s: float = 0.0
    """CPU of the first of ``pids`` (the server) over the window."""
    batches: str = ""
    """Appends per committed batch over the window (the server's histogram), if its HTTP port was given."""

    @property
    def rate(self) -> float:
        return sum(c.count for c in self.children) / self.seconds

    def rates(self) -> list[float]:
        return [c.count / self.seconds for c in self.children]

    def cpu_us_per_op(self) -> float:
        return sum(c.cpu_s for c in self.children) * 1e6 / max(1, sum(c.count for c in self.children))


def _child_command(client_yaml: Path, in_flight: int, mode: str | None, max_concurrent: int) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(client_yaml)]
    cmd += ["--in-flight", str(in_flight), "--max-concurrent", str(max_concurrent)]
    return cmd + (["--mode", mode] if mode else [])


def _read_line(child: subprocess.Popen[str], deadline: float) -> str:
    """The child's next stdout line, or ``""`` if it closed stdout; a RuntimeError past ``deadline``."""
    assert child.stdout is not None
    ready, _, _ = select.select([child.stdout], [], [], max(0.0, deadline - time.monotonic()))
    if not ready:
        raise RuntimeError("a client process did not answer in time")
    return child.stdout.readline()


def measure(
    client_yaml: Path,
    processes: int,
    in_flight: int,
    seconds: float,
    mode: str | None,
    max_concurrent: int,
    pids: list[int] | None = None,
    http_port: int | None = None,
) -> Run:
    """``processes`` children with ``in_flight`` each, over one window of ``seconds``; the CPU of ``pids``
    (the cluster's processes) and the server's batches (its HTTP port) over the same window."""
    from bench.client_peer import batch_histogram, batch_note
    from bench.procstat import total_cpu_s

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    cmd = _child_command(client_yaml, in_flight, mode, max_concurrent)
    children = [
        subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        for _ in range(processes)
    ]
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        for child in children:
            line = _read_line(child, deadline)
            if line.strip() != "ready":
                raise RuntimeError(f"a client process did not get ready ({line.strip()!r})")
        start = time.time() + START_MARGIN_S + WARMUP_S
        for child in children:
            assert child.stdin is not None
            child.stdin.write(f"go {start} {start + seconds}\n")
            child.stdin.flush()
        time.sleep(max(0.0, start - time.time()))
        s0, w0, h0 = total_cpu_s(pids or []), total_cpu_s((pids or [])[:1]), batch_histogram(http_port)
        time.sleep(max(0.0, start + seconds - time.time()))
        s1, w1, h1 = total_cpu_s(pids or []), total_cpu_s((pids or [])[:1]), batch_histogram(http_port)
        results = []
        deadline = time.monotonic() + START_MARGIN_S + WARMUP_S + seconds + 60
        for child in children:
            answer = _read_line(child, deadline)
            if not answer:
                raise RuntimeError(f"a client process exited ({child.wait()}) without its figures")
            results.append(ChildResult(**json.loads(answer)))
        for child in children:
            child.wait(30)
        return Run(processes, in_flight, seconds, results, s1 - s0, w1 - w0, batch_note(h0, h1))
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
            for pipe in (child.stdin, child.stdout):
                if pipe is not None:
                    pipe.close()


def run(
    client_yaml: Path,
    clients: int = 32,
    in_flight: int = 8,
    seconds: float = 5.0,
    mode: str | None = None,
    max_concurrent: int | None = 128,
    pids: list[int] | None = None,
    http_port: int | None = None,
) -> tuple[Run, Run]:
    """The one-process figure, then ``clients`` processes; each printed as it ends. ``pids``: the cluster's
    processes, whose CPU per append is printed; ``http_port``: the server's, for its appends per batch.
    ``max_concurrent`` (None: none asked for) is raised to each process's appends in flight."""
    total = clients * in_flight
    one = measure(client_yaml, 1, total, seconds, mode, max(max_concurrent or 0, total), pids, http_port)
    print(describe(one), flush=True)
    many = measure(
        client_yaml, clients, in_flight, seconds, mode, max(max_concurrent or 0, in_flight), pids, http_port
    )
    print(describe(many), flush=True)
    print(verdict(one, many), flush=True)
    return one, many


def describe(run: Run) -> str:
    p50 = statistics.median(c.p50_ms for c in run.children)
    p99 = max(c.p99_ms for c in run.children)
    ops = max(1, sum(c.count for c in run.children))
    text = (
        f"clients {run.processes:3} x {run.in_flight:3} in flight: {run.rate:8.0f} appends/s  "
        f"p50 {p50:.2f} ms "
        f"(median of processes)  p99 {p99:.2f} ms (worst process)  client CPU {run.cpu_us_per_op():.0f} us/op"
        f"  servers {run.server_cpu_s * 1e6 / ops:.0f} us/op "
        f"(the server alone {run.server_alone_cpu_s * 1e6 / ops:.0f})"
    )
    if run.processes > 1:
        rates = run.rates()
        text += (
            f"; per process min {min(rates):.0f} / mean {statistics.mean(rates):.0f} / max {max(rates):.0f}"
            f" appends/s"
        )
    return text + (f"; {run.batches}" if run.batches else "")


def verdict(one: Run, many: Run) -> str:
    rates = many.rates()
    mean = statistics.mean(rates)
    fairness = min(rates) / mean if mean else 0.0
    return (
        f"clients: {many.processes} processes / one process = {many.rate / max(one.rate, 1e-9):.2f}x "
        f"(goal >= 1); slowest process / mean = {fairness:.2f} (goal >= 0.5)"
    )


# ------------------------------------------------------------------------------------------------ the child


async def _child(args: argparse.Namespace) -> dict[str, Any]:
    from bench.client_app import Callbacks, Ctx

    from waltz import AsyncWaltzClient, ClientConfig

    # 32 interpreters starting at once on a busy machine mount slowly: wait as long as the parent does.
    overrides: dict[str, Any] = {
        "client.maxConcurrentTransactions": args.max_concurrent,
        "client.mountTimeout": int(READY_TIMEOUT_S * 1000),
    }
    if args.mode:
        overrides["client.callbackMode"] = args.mode
    config = ClientConfig.from_yaml(Path(args.client_yaml), overrides)
    inline = config.callback_mode == "inline"
    loop = asyncio.get_running_loop()
    async with AsyncWaltzClient(Callbacks(), config) as client:

        async def one() -> bool:
            future: asyncio.Future[bool] = loop.create_future()

            def done(ok: bool) -> None:
                if not future.done():
                    future.set_result(ok)

            await client.submit(Ctx(loop, inline, done))
            return await future

        await one()  # Connected and mounted.
        print("ready", flush=True)
        line = await loop.run_in_executor(None, sys.stdin.readline)
        _, start_s, end_s = line.split()
        start, end = float(start_s), float(end_s)
        latencies: list[float] = []
        cpu0 = 0.0

        async def worker() -> None:
            nonlocal cpu0
            while True:
                t0 = time.time()
                ok = await one()
                t1 = time.time()
                if t1 >= end:
                    return
                if ok and t1 >= start:
                    if not latencies:  # The window's first append: CPU from here on.
                        cpu0 = time.process_time()
                    latencies.append(t1 - t0)

        await asyncio.gather(*(worker() for _ in range(args.in_flight)))
        cpu1 = time.process_time()
        await client.flush_transactions(30)
    latencies.sort()
    return {
        "count": len(latencies),
        "cpu_s": cpu1 - cpu0 if cpu0 else 0.0,
        "p50_ms": statistics.median(latencies) * 1000 if latencies else float("nan"),
        "p99_ms": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1000 if latencies else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="a client process of the clients phase (see the docstring)")
    parser.add_argument("--child", dest="client_yaml", required=True, help="the cluster's client.yaml")
    parser.add_argument("--in-flight", type=int, default=8)
    parser.add_argument("--max-concurrent", type=int, default=128)
    parser.add_argument("--mode", choices=("inline", "threads", "auto"))
    args = parser.parse_args()
    import uvloop

    result = uvloop.run(_child(args))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
