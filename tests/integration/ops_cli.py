"""The ``waltz`` command run in the test's process against a :class:`Cluster`, for the integration tests of
the operator tools: a CLI config file for a cluster, ``waltz cluster verify``, the partition-repair steps
(wipe a replica, add the partition back, ``waltz storage recover-partition``), and a client that appended.
"""

from __future__ import annotations

import asyncio
import contextlib
import io

import yaml

from tests.integration.raw_client import RawClient, append_stream
from tests.integration.server_process import Cluster
from tests.integration.storage_process import StorageProcess
from waltz.cli.main import main as waltz_main
from waltz.cluster.membership import ClusterWatcher


async def waltz(*args: str) -> tuple[int, str, str]:
    """Run one ``waltz`` command in this process (in a thread: it runs its own event loop)."""

    def run() -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = waltz_main(list(args))
        return code, out.getvalue(), err.getvalue()

    return await asyncio.to_thread(run)


def cli_config(cluster: Cluster) -> str:
    path = cluster.base / "cli.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        yaml.safe_dump({"zookeeper.connectString": cluster.zk_connect, "cluster.root": cluster.root})
    )
    return str(path)


def admin(sp: StorageProcess) -> str:
    return f"127.0.0.1:{sp.admin_port}"


async def served(cluster: Cluster, client_id: int, count: int) -> RawClient:
    """A mounted client that appended ``count`` transactions (all acknowledged)."""
    watcher = ClusterWatcher(cluster.zk, cluster.root)
    await watcher.__aenter__()
    client = await RawClient(watcher, client_id).start()
    futures = await append_stream(client, count, size_bytes=64)
    await asyncio.wait_for(asyncio.gather(*futures), 30)
    await client.aclose()
    await watcher.__aexit__(None, None, None)
    return client


async def verify_lines(config: str, *extra: str) -> tuple[int, list[str]]:
    code, out, _ = await waltz("cluster", "verify", "-c", config, "--timeout", "5", *extra)
    return code, out.splitlines()


async def remove_partition_data(
    config: str, sp: StorageProcess, partition: int = 0, *, force: bool = False
) -> tuple[int, str, str]:
    """``waltz storage remove-partition -d``: ``partition`` and its data gone from ``sp`` (``--force``: even
    when it leaves fewer good copies than a quorum)."""
    force_arg = ("--force",) if force else ()
    return await waltz(
        "storage", "remove-partition", "-s", admin(sp), "-c", config, "-p", str(partition), "-d", *force_arg
    )


async def add_partition(config: str, *sps: StorageProcess, partition: int = 0) -> None:
    """``waltz storage add-partition`` on each of ``sps``: ``partition`` back, empty."""
    for sp in sps:
        code, _, err = await waltz(
            "storage", "add-partition", "-s", admin(sp), "-c", config, "-p", str(partition)
        )
        assert code == 0, err


async def recover_partition(
    config: str, source: StorageProcess, destination: StorageProcess, *extra: str, partition: int = 0
) -> tuple[int, str, str]:
    """``waltz storage recover-partition``: copy ``partition`` from ``source`` into ``destination``."""
    return await waltz(
        "storage",
        "recover-partition",
        "-c",
        config,
        "-p",
        str(partition),
        "--source",
        Cluster.address(source),
        "--destination",
        Cluster.address(destination),
        *extra,
    )


async def wipe_replicas(config: str, *sps: StorageProcess, partition: int = 0) -> None:
    """``partition``'s data gone from each of ``sps`` (forced: even the last good copies) and the partition
    added back, empty: what ``recover-partition`` is for."""
    for sp in sps:
        code, _, err = await remove_partition_data(config, sp, partition, force=True)
        assert code == 0, err
    await add_partition(config, *sps, partition=partition)
