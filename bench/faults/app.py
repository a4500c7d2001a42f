"""One application process of the fault suite: appends uniquely tagged transactions under contended locks.

    python -m bench.faults.app --config D/client.yaml --app 0 --seed 7 --duration-s 30 --out acks-0.jsonl

Through the public client library (:class:`~waltz.client.core.AsyncWaltzClient`, the network driver): every
transaction's data is a tag ``fault:<app>:<n>`` that no other transaction carries, it goes to a partition the
seed picks and takes one write lock out of a small pool per partition, so the apps' transactions conflict and
are executed again (the retry path is exercised as much as the append path). Up to ``--window`` contexts are
outstanding at once.

The output file gets one JSON line per acknowledged transaction (``on_completion(True)``: the client saw its
request id in the feed), written and flushed at once, and a final ``{"summary": ...}`` line with the counts
of contexts that failed for good or were still pending when the app stopped, and the pending tags. The
process submits for ``--duration-s`` seconds (or until ``--stop-file`` exists), then waits up to
``--settle-s`` for its outstanding contexts and exits; it never runs longer than the sum of the two plus its
start-up bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import time
from pathlib import Path
from typing import IO

from waltz.client.config import ClientConfig
from waltz.client.core import AsyncWaltzClient
from waltz.client.locks import PartitionLocalLock
from waltz.errors import ClientError
from waltz.perf.common import MarkCallbacks, ReportingContext, current_marks, network_driver

LOCKS_PER_PARTITION = 3
"""Write locks per partition: few, so concurrent transactions of the apps conflict often."""
START_TIMEOUT_S = 60.0


def tag_of(app: int, n: int) -> str:
    return f"fault:{app}:{n}"


async def run(args: argparse.Namespace, out: IO[str]) -> tuple[dict[str, int], list[str]]:
    rng = random.Random(f"app-{args.seed}-{args.app}")
    config = ClientConfig.from_yaml(args.config)
    async with asyncio.timeout(START_TIMEOUT_S):
        marks, num_partitions = await current_marks(config, network_driver)
        client = AsyncWaltzClient(MarkCallbacks(marks), config)
        await client.start()
    loop = asyncio.get_running_loop()
    counts = {"submitted": 0, "acked": 0, "failed": 0, "pending": 0, "refused": 0}
    outstanding: dict[asyncio.Task[None], str] = {}
    slots = asyncio.Semaphore(args.window)

    async def settle(ctx: ReportingContext, tag: str) -> None:
        try:
            ok, _ = await ctx.done
        except ClientError as e:
            counts["failed"] += 1
            out.write(json.dumps({"failed": tag, "error": repr(e)}) + "\n")
            out.flush()
            return
        finally:
            slots.release()
        if ok:
            counts["acked"] += 1
            out.write(json.dumps({"tag": tag, "partition": ctx.partition, "t": time.time()}) + "\n")
            out.flush()
        else:
            counts["failed"] += 1

    try:
        deadline = time.monotonic() + args.duration_s
        n = 0
        while time.monotonic() < deadline and not (args.stop_file and args.stop_file.exists()):
            await slots.acquire()
            partition = rng.randrange(num_partitions)
            tag = tag_of(args.app, n)
            n += 1
            lock = PartitionLocalLock("fault", rng.randrange(LOCKS_PER_PARTITION))
            ctx = ReportingContext(loop, partition, tag.encode(), lock)
            try:
                await client.submit(ctx)
            except ClientError:
                counts["refused"] += 1
                slots.release()
                continue
            counts["submitted"] += 1
            task = loop.create_task(settle(ctx, tag))
            outstanding[task] = tag
            task.add_done_callback(lambda t: outstanding.pop(t, None))
            await asyncio.sleep(rng.uniform(0, 2 * args.interval_ms) / 1000)
        pending_tags: list[str] = []
        if outstanding:
            _, pending = await asyncio.wait(set(outstanding), timeout=args.settle_s)
            counts["pending"] = len(pending)
            pending_tags = sorted(outstanding[t] for t in pending)
            for task in pending:
                task.cancel()
    finally:
        await client.close()
    return counts, pending_tags


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--app", required=True, type=int)
    parser.add_argument("--seed", required=True, type=int)
    parser.add_argument("--duration-s", type=float, default=30.0)
    parser.add_argument("--settle-s", type=float, default=60.0)
    parser.add_argument("--interval-ms", type=float, default=10.0)
    parser.add_argument("--window", type=int, default=6)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--stop-file", type=Path, default=None, help="stop submitting once this file exists")
    args = parser.parse_args(argv)
    # The client's INFO lines (mounts, reconnects, ZooKeeper state) with times, for the post-mortem of a run.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with args.out.open("w", encoding="utf-8") as out:
        counts, pending_tags = asyncio.run(run(args, out))
        out.write(json.dumps({"summary": counts, "pending_tags": pending_tags}) + "\n")
    print(json.dumps(counts), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
