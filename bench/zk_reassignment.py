"""How long until a dead server's partitions are reassigned, on a real ZooKeeper.

A server process registers (``ClusterMember``) and owns half of the partitions; it is then killed with
SIGKILL (a crash: no close request reaches ZooKeeper). We measure the time from the kill until the surviving
member owns every partition, once per session timeout given. Also measures a clean shutdown (``close``
deletes the descriptor at once). Usage::

    .venv/bin/python -m bench.zk_reassignment [--session-timeout-ms 30000 4000] [--partitions 16]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time

from waltz.cluster import store_metadata as sm
from waltz.cluster import zk as zkutil
from waltz.cluster.membership import ClusterMember
from waltz.cluster.zkserver import ZooKeeperServer

CHILD = """
import asyncio, sys
from waltz.cluster import zk as zkutil
from waltz.cluster.membership import ClusterMember

async def main() -> None:
    client = zkutil.connect(sys.argv[1], session_timeout_ms=int(sys.argv[2]))
    member = ClusterMember(client, sys.argv[3], "victim", 2)
    await member.start()
    await member.wait_for_partitions(lambda p: len(p) > 0, 60)
    print("ready", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def crash_once(connect: str, root: str, n: int, session_timeout_ms: int) -> float:
    client = zkutil.connect(connect, session_timeout_ms=session_timeout_ms)
    try:
        sm.create_cluster(client, root, "bench", n)
        async with ClusterMember(client, root, "survivor", 1) as m1:
            await m1.wait_for_partitions(lambda p: len(p) == n, 30)
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", CHILD, connect, str(session_timeout_ms), root, stdout=subprocess.PIPE
            )
            try:
                assert proc.stdout is not None
                await asyncio.wait_for(proc.stdout.readline(), 60)
                await m1.wait_for_partitions(lambda p: len(p) == n // 2, 30)
                t0 = time.monotonic()
                proc.kill()
                await m1.wait_for_partitions(lambda p: len(p) == n, session_timeout_ms / 1000 + 30)
                return time.monotonic() - t0
            finally:
                if proc.returncode is None:
                    proc.kill()
                await proc.wait()
    finally:
        zkutil.close(client)


async def clean_close_once(connect: str, root: str, n: int) -> float:
    c1 = zkutil.connect(connect)
    c2 = zkutil.connect(connect)
    try:
        sm.create_cluster(c1, root, "bench", n)
        async with ClusterMember(c1, root, "survivor", 1) as m1:
            m2 = ClusterMember(c2, root, "leaver", 2)
            await m2.start()
            await m1.wait_for_partitions(lambda p: len(p) == n // 2, 30)
            t0 = time.monotonic()
            await m2.close()
            await m1.wait_for_partitions(lambda p: len(p) == n, 30)
            return time.monotonic() - t0
    finally:
        zkutil.close(c2)
        zkutil.close(c1)


async def main() -> None:
    parser = argparse.ArgumentParser(description="time to reassign a dead server's partitions")
    parser.add_argument("--session-timeout-ms", type=int, nargs="+", default=[30000, 4000])
    parser.add_argument("--partitions", type=int, default=16)
    args = parser.parse_args()
    with ZooKeeperServer(tempfile.mkdtemp(prefix="waltz-bench-zk-")) as server:
        connect = server.connect_string
        print(f"ZooKeeper 3.8 standalone on {connect} (tickTime {server.tick_time_ms} ms)")
        elapsed = await clean_close_once(connect, "/bench/clean", args.partitions)
        print(f"clean shutdown (descriptor deleted): reassigned in {elapsed * 1000:.0f} ms")
        for timeout_ms in args.session_timeout_ms:
            elapsed = await crash_once(connect, f"/bench/crash{timeout_ms}", args.partitions, timeout_ms)
            print(f"SIGKILL, session timeout {timeout_ms} ms: reassigned in {elapsed * 1000:.0f} ms")


if __name__ == "__main__":
    asyncio.run(main())
