"""Retention on a real cluster (issue 26): the grace holds a trim back (nothing deleted, reads below it work,
the operator sees it pending and can cancel it); a retention policy set with ``waltz cluster retention`` is
applied by the owning server, which sets a pending trim point that keeps the last N transactions; when the
grace ends every replica records it and deletes the segments below it, and ``waltz_storage_disk_bytes``
shows the space returned. Bad input gets one clear line and changes nothing."""

from __future__ import annotations

import asyncio
import os
import urllib.request
from pathlib import Path

import pytest

from tests.integration.conftest import ClusterFactory
from tests.integration.raw_client import RawClient
from tests.integration.server_process import free_port, wait_until
from tests.integration.storage_process import StorageProcess
from waltz.cli.main import main as waltz_main
from waltz.cluster.membership import ClusterWatcher
from waltz.cluster.retention import read_retention
from waltz.cluster.trim_points import TrimSource, read_trim_points
from waltz.storage.controlfile import CONTROL_FILE_NAME, read_control_file_with_trims
from waltz.storage.segment import parse_segment_name

pytestmark = [pytest.mark.integration]

RECORDS = 600
KEEP = 100
POLICY_GRACE_MS = 4_000


def first_segment(sp: StorageProcess) -> int:
    names = os.listdir(os.path.join(str(sp.directory), "0"))
    return min(p[0] for p in map(parse_segment_name, names) if p is not None)


def control_trim_point(sp: StorageProcess) -> int:
    return read_control_file_with_trims(os.path.join(sp.directory, CONTROL_FILE_NAME))[2][0]


def disk_bytes(sp: StorageProcess) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{sp.http_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    line = next(x for x in text.splitlines() if x.startswith("waltz_storage_disk_bytes "))
    return float(line.split()[1])


@pytest.mark.timeout(240)
def test_a_policy_trims_after_the_grace_and_the_disk_comes_back(
    cluster_factory: ClusterFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = cluster_factory(
        storage_config={"storage.segment.size.threshold": 4096, "storage.http.port": 0},
        server_config={"server.retention.checkInterval": 200},
    )
    cli_yaml = tmp_path / "cli.yaml"
    cli_yaml.write_text(f"zookeeper.connectString: {cluster.zk_connect}\ncluster.root: {cluster.root}\n")

    async def cli(*argv: str) -> tuple[int, str, str]:
        code = await asyncio.to_thread(waltz_main, ["cluster", *argv, "-c", str(cli_yaml)])
        out, err = capsys.readouterr()
        return code, out, err

    async def main() -> None:
        for _ in range(3):
            cluster.storage_config["storage.http.port"] = free_port()
            await cluster.add_storage()
        await cluster.add_server()
        # Pending trim points and limits in bytes need feature version 2: a new cluster starts at the newest.
        async with ClusterWatcher(cluster.zk, cluster.root) as watcher:
            writer = await RawClient(watcher, 1).start()
            try:
                futures = [await writer.append(b"record-%04d" % i + b"x" * 80) for i in range(RECORDS)]
                assert await asyncio.gather(*futures) == list(range(RECORDS))
                await check_bad_input()
                await check_a_pending_trim_is_held_back_and_cancelled()
                before = [disk_bytes(sp) for sp in cluster.storages]
                await check_the_policy(before)
                assert await writer.append_and_wait(b"after the trim") == RECORDS
            finally:
                await writer.aclose()
        log = cluster.servers[0].log_text()
        assert "trim point 500 pending, set by the retention policy" in log
        assert "trim point 500 (set by the retention policy at" in log
        assert "is in force now that its grace ended" in log

    async def check_bad_input() -> None:
        cases = [
            (
                ["retention", "set", "--keep-transactions", "0"],
                "the default: --keep-transactions 0 would trim",
            ),
            (["retention", "set", "-p", "7", "--keep-transactions", "5"], "partition 7 does not exist"),
            (["retention", "set", "-p", "0", "--grace-ms", "5"], "the grace (--grace-ms) is cluster-wide"),
            (["retention", "set"], "nothing to change"),
            (["trim", "-p", "7", "--cancel"], "partition 7 does not exist"),
        ]
        for argv, message in cases:
            code, out, err = await cli(*argv)
            assert (code, out) == (1, ""), argv
            assert message in err, (argv, err)
            assert len(err.strip().splitlines()) == 1, err
        assert read_retention(cluster.zk, cluster.root).default.keeps_everything

    async def check_a_pending_trim_is_held_back_and_cancelled() -> None:
        code, out, _ = await cli("retention", "set", "--grace-ms", "600000")
        assert code == 0
        assert "grace: 600000 ms (retention.graceMs)" in out
        assert "default: keep everything" in out
        code, out, _ = await cli("trim", "-p", "0", "--to", "300", "--min-kept", "100")
        assert code == 0
        assert "partition 0: trim point 300 pending, set by an operator; it takes effect at" in out
        entry = read_trim_points(cluster.zk, cluster.root).entry(0)
        assert entry.trim_point == 0
        assert entry.pending is not None
        assert entry.pending.trim_point == 300
        code, out, _ = await cli("retention", "show")
        assert "partition 0: trim point 0, pending 300 (set by an operator at" in out
        # verify names it too, after its verdict: no problem (exit 0), but what the grace's end deletes.
        code, out, _ = await cli("verify", "--timeout", "5")
        ok, pending = out.splitlines()
        assert (code, ok) == (0, "OK: every partition served, replicated and healthy")
        assert pending.startswith("pending trim: partition 0: trim point 0, pending 300 (set by an operator")
        await asyncio.sleep(1)  # the server had time to act on it: it must not have
        for sp in cluster.storages:
            assert control_trim_point(sp) == 0
            assert first_segment(sp) == 0
            async with await cluster.admin(sp) as admin:
                assert (await admin.read_records(0, 5, 1))[0].data.startswith(b"record-0005")
        code, out, _ = await cli("trim", "-p", "0", "--cancel")
        assert (code, out) == (0, "partition 0: pending trim point 300 cancelled (trim point in force: 0)\n")
        assert read_trim_points(cluster.zk, cluster.root).entry(0).pending is None
        code, out, _ = await cli("verify", "--timeout", "5")
        assert (code, out) == (0, "OK: every partition served, replicated and healthy\n")

    async def check_the_policy(before: list[float]) -> None:
        code, out, _ = await cli(
            "retention", "set", "--keep-transactions", str(KEEP), "--grace-ms", str(POLICY_GRACE_MS)
        )
        assert code == 0
        assert f"default: keep the last {KEEP} transactions" in out

        def pending() -> bool:
            p = read_trim_points(cluster.zk, cluster.root).entry(0).pending
            return p is not None and (p.trim_point, p.source) == (RECORDS - KEEP, TrimSource.POLICY)

        await wait_until(pending, 30, "the server to set the policy's trim point")
        # In its grace: no replica has it yet.
        assert [control_trim_point(sp) for sp in cluster.storages] == [0, 0, 0]
        for sp in cluster.storages:
            await wait_until(
                lambda s=sp: control_trim_point(s) == RECORDS - KEEP, 30, f"{sp.name} trim point"
            )
            await wait_until(lambda s=sp: first_segment(s) > 0, 30, f"{sp.name} to delete segments")
            assert first_segment(sp) <= RECORDS - KEEP
        await wait_until(
            lambda: all(disk_bytes(sp) < b - 20_000 for sp, b in zip(cluster.storages, before, strict=True)),
            30,
            "waltz_storage_disk_bytes to show the space returned",
        )

    asyncio.run(main())


def segment_bytes(sp: StorageProcess) -> dict[int, int]:
    """First id -> bytes of the data and index files of each segment of partition 0."""
    directory = os.path.join(str(sp.directory), "0")
    out: dict[int, int] = {}
    for name in os.listdir(directory):
        parsed = parse_segment_name(name)
        if parsed is not None:
            out[parsed[0]] = out.get(parsed[0], 0) + os.path.getsize(os.path.join(directory, name))
    return out


def _oldest_kept(sizes: dict[int, int], keep_bytes: int) -> int:
    """The first id of the oldest of the newest segments (by ``sizes``) that hold ``keep_bytes`` together."""
    firsts, total = sorted(sizes), 0
    while total < keep_bytes:
        total += sizes[firsts.pop()]
    return max(sizes) if not firsts else min(f for f in sizes if f > firsts[-1])


@pytest.mark.timeout(180)
def test_a_limit_in_bytes_keeps_the_newest_segments_that_hold_them(
    cluster_factory: ClusterFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = cluster_factory(
        storage_config={"storage.segment.size.threshold": 4096},
        server_config={"server.retention.checkInterval": 200},
    )
    cli_yaml = tmp_path / "cli.yaml"
    cli_yaml.write_text(f"zookeeper.connectString: {cluster.zk_connect}\ncluster.root: {cluster.root}\n")
    keep_bytes = 20_000

    async def main() -> None:
        await cluster.start(storages=3, servers=1)
        async with ClusterWatcher(cluster.zk, cluster.root) as watcher:
            writer = await RawClient(watcher, 1).start()
            try:
                futures = [await writer.append(b"record-%04d" % i + b"x" * 80) for i in range(RECORDS)]
                assert await asyncio.gather(*futures) == list(range(RECORDS))
            finally:
                await writer.aclose()
        # Each node rolls its segments where its own write groups fell, so boundaries may differ by node;
        # the policy measures the replica it asks (the first that answers).
        before = {sp.name: segment_bytes(sp) for sp in cluster.storages}
        for argv in (["--grace-ms", "0"], ["-p", "0", "--keep-bytes", str(keep_bytes)]):
            code = await asyncio.to_thread(
                waltz_main, ["cluster", "retention", "set", "-c", str(cli_yaml), *argv]
            )
            assert code == 0
        out, _ = capsys.readouterr()
        assert f"partition 0: keep the newest segments holding {keep_bytes} bytes" in out
        candidates = {_oldest_kept(sizes, keep_bytes) for sizes in before.values()}
        await wait_until(
            lambda: read_trim_points(cluster.zk, cluster.root).of(0) in candidates,
            30,
            f"the policy to trim to one of {sorted(candidates)}",
        )
        point = read_trim_points(cluster.zk, cluster.root).of(0)
        for sp in cluster.storages:
            # What lies wholly below the trim point goes; the segment holding it stays.
            holding = max(f for f in before[sp.name] if f <= point)
            await wait_until(
                lambda s=sp, h=holding: first_segment(s) == h, 30, f"{sp.name} to delete segments"
            )
            assert sum(segment_bytes(sp).values()) >= keep_bytes
        # No grace: the policy's trim point was in force at once (one line on the owning server).
        assert f"partition 0: trim point raised from 0 to {point}" in cluster.servers[0].log_text()

    asyncio.run(main())
