"""Hostile peers against real server and storage processes: each holds only bounded memory and slots.

Each test starts real processes, plays a misbehaving peer over raw sockets (a peer that asks and never
reads, a flood of connections that complete the hello, idle connections, garbage repeated hundreds of times,
endless config and certificate files), measures the target process (its resident set from
``/proc/<pid>/status``) and checks that a well-behaved client's transactions go through meanwhile. The
figures they print are the ones in docs/BENCHMARKS.md ("Hostile peers").

The flood comes from 127.0.0.2 (all of 127/8 is loopback on Linux), so the per-source limit can tell it
from the good client on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import resource
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from tests.integration.conftest import ClusterFactory
from tests.integration.raw_client import RawClient, append_stream
from tests.integration.raw_storage import FramedSocket
from tests.integration.storage_process import DEFAULT_KEY, StorageProcess
from waltz.cluster.membership import ClusterWatcher
from waltz.protocol import client_server as cs
from waltz.protocol import storage as st
from waltz.protocol.framing import MAGIC_CLIENT, MAGIC_HELLO, MAGIC_STORAGE, encode_frame, encode_hello
from waltz.protocol.records import Record, ReqId
from waltz.server.storage_client import AdminClient, StorageClient
from waltz.transport import open_connection

pytestmark = pytest.mark.integration

T = TypeVar("T")
MiB = 1024 * 1024
FLOOD_SOURCE = "127.0.0.2"
NUM_PARTITIONS = 2


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    """``VmRSS`` (resident now) or ``VmHWM`` (peak resident) of a process, in bytes."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


class RssSampler:
    """Samples a process's resident set every ``interval_s`` in a task; :attr:`peak` is the largest seen."""

    def __init__(self, pid: int, interval_s: float = 0.05) -> None:
        self.pid = pid
        self.baseline = rss_bytes(pid)
        self.peak = self.baseline
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> RssSampler:
        self._task = asyncio.create_task(self._sample())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.peak = max(self.peak, rss_bytes(self.pid))

    async def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, rss_bytes(self.pid))
            await asyncio.sleep(self._interval_s)

    @property
    def growth(self) -> int:
        return self.peak - self.baseline


class RawPeer(FramedSocket):
    """A blocking socket that completes the hello, then sends frames and reads only when told to."""

    def __init__(
        self, port: int, *, source: str = "127.0.0.1", rcvbuf: int | None = None, timeout_s: float = 10.0
    ) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:
            # Set before connecting, so the advertised window stays small: the peer truly reads nothing.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.bind((source, 0))
        sock.settimeout(timeout_s)
        sock.connect(("127.0.0.1", port))
        super().__init__(sock)

    def hello(self, versions: tuple[int, ...]) -> int:
        """Exchange hellos; the version the other side will speak (the highest both know)."""
        self.sock.sendall(encode_frame(MAGIC_HELLO, 0, encode_hello(versions, "hostile test peer")))
        payload = self.read_payload()
        (n,) = struct.unpack_from(">i", payload)
        theirs = struct.unpack_from(f">{n}h", payload, 4)
        self.version = max(set(theirs) & set(versions))
        return self.version

    def send(self, magic: int, *payloads: bytes) -> None:
        """Send ``payloads`` as frames in one write (a pipelining peer's requests arrive together)."""
        self.sock.sendall(b"".join(encode_frame(magic, self.version, p) for p in payloads))


def flood(port: int, versions: tuple[int, ...], count: int) -> tuple[list[RawPeer], int]:
    """Open ``count`` connections from FLOOD_SOURCE that complete the hello; (kept open, refused)."""
    kept: list[RawPeer] = []
    refused = 0
    for _ in range(count):
        peer = RawPeer(port, source=FLOOD_SOURCE, timeout_s=5.0)
        try:
            peer.hello(versions)
            kept.append(peer)
        except (OSError, struct.error):
            refused += 1
            peer.close()
    return kept, refused


def log_lines(text: str, needle: str) -> int:
    return sum(1 for line in text.splitlines() if needle in line)


def records(first: int, n: int, size: int) -> list[Record]:
    return [
        Record.build(i, ReqId(7 << 32, i), 0, i.to_bytes(8, "big") * (size // 8))
        for i in range(first, first + n)
    ]


# ------------------------------------------------------------------------------ a peer that never reads


@pytest.mark.timeout(120)
def test_server_peer_that_asks_for_ranges_and_never_reads_holds_bounded_memory(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory()

    async def main() -> None:
        await cluster.start(storages=1, servers=1)
        server = cluster.servers[0]
        async with ClusterWatcher(cluster.zk, cluster.root) as watcher:
            writer = await RawClient(watcher, 1, keep_data=False, keep_latencies=False).start()
            try:
                # 40 MiB of committed data: every range request below asks for all of it.
                for f in await append_stream(writer, 640, size_bytes=64 * 1024):
                    await asyncio.wait_for(f, 60)
                other = await RawClient(watcher, 2, keep_data=False).start()
                try:
                    peer = RawPeer(server.port, rcvbuf=4096)
                    version = await asyncio.to_thread(peer.hello, cs.SUPPORTED_VERSIONS)

                    def ask() -> None:
                        requests = [
                            cs.TransactionRangeRequest(ReqId.of(99, writer.generation, 0, seq), 0, 10_000)
                            for seq in range(100)
                        ]
                        peer.send(MAGIC_CLIENT, *(cs.encode(r, version) for r in requests))

                    # The server relays each range from the storage node: both must stay bounded.
                    storage_rss = RssSampler(cluster.storages[0].pid)
                    async with RssSampler(server.pid) as rss, storage_rss:
                        asking = asyncio.create_task(asyncio.to_thread(ask))
                        # Another client's transactions go through meanwhile.
                        started = time.monotonic()
                        futures = await append_stream(other, 300)
                        acked = [await asyncio.wait_for(f, 30) for f in futures]
                        elapsed_s = time.monotonic() - started
                        await asyncio.sleep(max(0.0, 6.0 - elapsed_s))  # let the server do its worst
                    print(
                        f"server RSS {rss.baseline / MiB:.0f} MiB -> peak {rss.peak / MiB:.0f} MiB "
                        f"(+{rss.growth / MiB:.0f} MiB), storage RSS +{storage_rss.growth / MiB:.0f} MiB, "
                        f"with 100 unread range requests of 40 MiB each; 300 appends of another client in "
                        f"{elapsed_s:.2f} s"
                    )
                    assert len(set(acked)) == 300
                    assert elapsed_s < 15  # ~30 s before the bounds: its appends queued behind the reads
                    assert rss.growth < 160 * MiB
                    assert storage_rss.growth < 160 * MiB
                    peer.close()
                    asking.cancel()
                    await asyncio.gather(asking, return_exceptions=True)
                finally:
                    await other.aclose()
            finally:
                await writer.aclose()
        assert "Traceback" not in server.log_text()

    run(main())


@pytest.mark.timeout(60)
def test_a_feed_or_mount_from_below_minus_one_closes_that_connection_only(
    cluster_factory: ClusterFactory,
) -> None:
    # Such a feed started at ids that never exist: the server polled the store for them every 10 ms for as
    # long as the connection lived. The codec refuses the request now, like any malformed message.
    cluster = cluster_factory()

    def mount(rid: ReqId, hwm: int) -> bytes:
        # Built by hand: the codec refuses to encode it.
        return bytes([cs.MessageType.MOUNT_REQUEST]) + struct.pack(">QQqq", rid.msb, rid.lsb, hwm, 1)

    async def main() -> None:
        await cluster.start(storages=1, servers=1)
        server = cluster.servers[0]
        async with ClusterWatcher(cluster.zk, cluster.root) as watcher:
            client = await RawClient(watcher, 1).start()
            try:
                await asyncio.wait_for(await client.append(b"before"), 30)
                rid = ReqId.of(98, client.generation, 0, 0)
                feeder = RawPeer(server.port)
                mounter = RawPeer(server.port)
                try:
                    for peer in (feeder, mounter):
                        await asyncio.to_thread(peer.hello, cs.SUPPORTED_VERSIONS)
                    # A proper mount first, then a FeedRequest from far below the log.
                    feeder.send(MAGIC_CLIENT, mount(rid, -1))
                    bad_feed = bytes([cs.MessageType.FEED_REQUEST]) + struct.pack(
                        ">QQq", rid.msb, rid.lsb, -(10**15)
                    )
                    feeder.send(MAGIC_CLIENT, bad_feed)
                    mounter.send(MAGIC_CLIENT, mount(ReqId.of(97, client.generation, 0, 0), -(10**15)))
                    assert await asyncio.to_thread(feeder.closed_by_peer, 5.0)
                    assert await asyncio.to_thread(mounter.closed_by_peer, 5.0)
                finally:
                    feeder.close()
                    mounter.close()
                # The good client goes on, on its own connection.
                await asyncio.wait_for(await client.append(b"after"), 30)
            finally:
                await client.aclose()
        text = server.log_text()
        assert log_lines(text, "client high-water mark -1000000000000000 is below -1") >= 1
        assert "Traceback" not in text

    run(main())


@pytest.mark.timeout(120)
def test_storage_peer_that_asks_for_runs_and_never_reads_holds_bounded_memory(tmp_path: Path) -> None:
    async def main(node: StorageProcess) -> None:
        async with (
            await AdminClient.connect("127.0.0.1", node.admin_port, DEFAULT_KEY, NUM_PARTITIONS) as admin,
            await StorageClient.connect("127.0.0.1", node.port, DEFAULT_KEY, NUM_PARTITIONS) as client,
        ):
            await admin.set_assigned([0, 1], True)
            for first in range(0, 640, 16):  # 40 MiB in partition 0
                await client.append(0, 0, records(first, 16, 64 * 1024))
            peer = RawPeer(node.port, rcvbuf=4096)
            await asyncio.to_thread(peer.hello, st.STORAGE_VERSIONS)

            def ask() -> None:
                peer.send(MAGIC_STORAGE, st.encode(st.OpenRequest(-1, 0, -1, DEFAULT_KEY, NUM_PARTITIONS)))
                runs = [st.RecordRunRequest(0, seq, 0, 0, 10_000, 8 * MiB) for seq in range(1, 121)]
                peer.send(MAGIC_STORAGE, *(st.encode(r) for r in runs))

            async with RssSampler(node.pid) as rss:
                asking = asyncio.create_task(asyncio.to_thread(ask))
                started = time.monotonic()
                for i in range(200):  # another connection's appends to partition 1 go through meanwhile
                    await client.append(0, 1, records(i, 1, 512))
                elapsed_s = time.monotonic() - started
                await asyncio.sleep(max(0.0, 6.0 - elapsed_s))
            print(
                f"storage RSS {rss.baseline / MiB:.0f} MiB -> peak {rss.peak / MiB:.0f} MiB "
                f"(+{rss.growth / MiB:.0f} MiB) with 120 unread 8 MiB run requests; "
                f"200 appends of another connection in {elapsed_s:.2f} s"
            )
            assert await client.max_transaction_id(0, 1) == 199
            assert rss.growth < 160 * MiB
            peer.close()
            asking.cancel()
            await asyncio.gather(asking, return_exceptions=True)

    with StorageProcess(tmp_path, num_partitions=NUM_PARTITIONS).start() as node:
        run(main(node))
        assert "Traceback" not in node.log_text()


# ------------------------------------------------------------------------------------ a connection flood


@pytest.mark.timeout(120)
def test_server_connection_flood_from_one_address_leaves_room_for_clients(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory()

    async def main() -> None:
        await cluster.start(storages=1, servers=1)
        server = cluster.servers[0]
        rss_before = rss_bytes(server.pid)
        kept, refused = await asyncio.to_thread(flood, server.port, cs.SUPPORTED_VERSIONS, 1100)
        try:
            rss_after = rss_bytes(server.pid)
            print(
                f"server: {len(kept)} flood connections kept, {refused} refused; RSS "
                f"{rss_before / MiB:.0f} -> {rss_after / MiB:.0f} MiB"
            )
            # A client on another address connects, mounts and appends as usual.
            async with ClusterWatcher(cluster.zk, cluster.root) as watcher:
                client = await RawClient(watcher, 3).start(timeout_s=15)
                try:
                    acked = [await asyncio.wait_for(f, 30) for f in await append_stream(client, 100)]
                    assert len(set(acked)) == 100
                finally:
                    await client.aclose()
            assert rss_after - rss_before < 100 * MiB
        finally:
            for peer in kept:
                peer.close()
        log = server.log_text()
        refusals = log_lines(log, "refusing connection")
        print(f"server log: {refusals} refusal line(s) for {refused} refused connections")
        assert refused > 0
        assert 1 <= refusals <= 3  # one line, not one per refused connection

    run(main())


@pytest.mark.timeout(120)
def test_storage_connection_flood_from_one_address_leaves_room_for_servers(tmp_path: Path) -> None:
    async def main(node: StorageProcess) -> None:
        kept, refused = await asyncio.to_thread(flood, node.port, st.STORAGE_VERSIONS, 1100)
        print(f"storage: {len(kept)} flood connections kept, {refused} refused")
        try:
            assert refused > 0
            async with (
                await AdminClient.connect("127.0.0.1", node.admin_port, DEFAULT_KEY, NUM_PARTITIONS) as admin,
                await StorageClient.connect("127.0.0.1", node.port, DEFAULT_KEY, NUM_PARTITIONS) as client,
            ):
                await admin.set_assigned([0], True)
                await client.append(0, 0, records(0, 10, 64))
                assert await client.max_transaction_id(0, 0) == 9
        finally:
            for peer in kept:
                peer.close()

    with StorageProcess(tmp_path, num_partitions=NUM_PARTITIONS).start() as node:
        run(main(node))
        assert 1 <= log_lines(node.log_text(), "refusing connection") <= 3


# ------------------------------------------------------------------------------------- idle connections


@pytest.mark.timeout(120)
def test_idle_and_non_reading_connections_are_closed_while_busy_and_keep_alive_peers_stay(
    cluster_factory: ClusterFactory,
) -> None:
    idle_ms = 1500
    cluster = cluster_factory(
        server_config={"server.connection.idleTimeout": idle_ms},
        storage_config={"storage.connection.idleTimeout": idle_ms},
    )

    async def main() -> None:
        await cluster.start(storages=1, servers=1)
        server, storage = cluster.servers[0], cluster.storages[0]
        async with ClusterWatcher(cluster.zk, cluster.root) as watcher:
            client = await RawClient(watcher, 4).start()
            stop = asyncio.Event()

            async def trickle() -> list[asyncio.Future[int]]:
                futures: list[asyncio.Future[int]] = []
                while not stop.is_set():  # a slow but steady client: never idle for long
                    futures.extend(await append_stream(client, 1))
                    await asyncio.sleep(0.05)
                return futures

            # 6 MiB of data, so that the non-reading peer below has more coming than our buffer takes.
            for f in await append_stream(client, 100, size_bytes=64 * 1024):
                await asyncio.wait_for(f, 30)
            appending = asyncio.create_task(trickle())
            try:
                idle_server = [RawPeer(server.port) for _ in range(40)]
                idle_storage = [RawPeer(storage.port) for _ in range(40)]
                for peer in idle_server:
                    await asyncio.to_thread(peer.hello, cs.SUPPORTED_VERSIONS)
                for peer in idle_storage:
                    await asyncio.to_thread(peer.hello, st.STORAGE_VERSIONS)
                # A peer that asks for data and never reads (after the first bytes) is let go too.
                stuck = RawPeer(server.port, rcvbuf=4096)
                version = await asyncio.to_thread(stuck.hello, cs.SUPPORTED_VERSIONS)
                for seq in range(20):
                    rid = ReqId.of(98, client.generation, 0, seq)
                    stuck.send(MAGIC_CLIENT, cs.encode(cs.TransactionRangeRequest(rid, 0, 10_000), version))
                # A quiet peer that sends keep-alives more often than the timeout stays connected.
                quiet = await open_connection(
                    "127.0.0.1",
                    server.port,
                    magic=MAGIC_CLIENT,
                    versions=cs.SUPPORTED_VERSIONS,
                    hello_text="quiet test peer",
                    keep_alive_interval_s=idle_ms / 1000 / 4,
                )
                started = time.monotonic()
                limit_s = 3 * idle_ms / 1000
                closed = await asyncio.to_thread(
                    lambda: [
                        p.closed_by_peer(max(0.1, limit_s - (time.monotonic() - started)))
                        for p in idle_server
                    ]
                )
                closed_storage = await asyncio.to_thread(
                    lambda: [
                        p.closed_by_peer(max(0.1, limit_s - (time.monotonic() - started)))
                        for p in idle_storage
                    ]
                )
                assert closed == [True] * 40
                assert closed_storage == [True] * 40
                # The keep-alive peer outlived the idle connections, and still gets answers.
                assert not quiet.is_closed
                quiet.send(
                    cs.encode(
                        cs.HighWaterMarkRequest(ReqId.of(97, client.generation, 0, 1)),
                        quiet.negotiated_version,
                    )
                )
                await quiet.drain()
                answer = cs.decode(await asyncio.wait_for(quiet.receive(), 10), quiet.negotiated_version)
                assert isinstance(answer, cs.HighWaterMarkResponse)
                await quiet.aclose()
                assert await asyncio.to_thread(stuck.closed_by_peer, 3 * idle_ms / 1000)
                stuck.close()
                for peer in [*idle_server, *idle_storage]:
                    peer.close()
            finally:
                stop.set()
                futures = await appending
            acked = [await asyncio.wait_for(f, 30) for f in futures]
            assert len(set(acked)) == len(futures) > 20
            assert client.stats.mounts == 1  # the busy client was never cut off
            await client.aclose()
        server_log, storage_log = server.log_text(), storage.log_text()
        assert 1 <= log_lines(server_log, "idle timeout") <= 4
        assert 1 <= log_lines(storage_log, "idle timeout") <= 3

    run(main())


# ------------------------------------------------------------------------------ logs and endless inputs


@pytest.mark.timeout(60)
def test_a_peer_repeating_garbage_gets_one_warning_not_one_per_connection(tmp_path: Path) -> None:
    with StorageProcess(tmp_path, num_partitions=NUM_PARTITIONS).start() as node:

        def garbage() -> None:
            for _ in range(300):
                with socket.create_connection(("127.0.0.1", node.port), timeout=5) as s:
                    s.sendall(b"\xff" * 64)
                    try:
                        while s.recv(4096):
                            pass
                    except OSError:
                        pass

        garbage()
        time.sleep(0.5)
        lines = log_lines(node.log_text(), "hello exchange failed")
        print(f"storage log: {lines} warning line(s) for 300 garbage connections")
        assert 1 <= lines <= 2


def _storage_run(tmp_path: Path, config: str | Path) -> subprocess.CompletedProcess[str]:
    def limit_memory() -> None:
        # If loading were unbounded, fail fast rather than take the machine's memory.
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    return subprocess.run(
        [sys.executable, "-m", "waltz.cli.main", "storage", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=tmp_path,
        preexec_fn=limit_memory,
    )


@pytest.mark.timeout(60)
def test_endless_config_and_certificate_files_and_a_blank_directory_are_refused(tmp_path: Path) -> None:
    started = time.monotonic()
    endless = _storage_run(tmp_path, "/dev/zero")
    assert endless.returncode == 2, endless.stderr[-2000:]
    assert "/dev/zero: not a config file" in endless.stderr

    base = {
        "storage.port": 0,
        "storage.admin.port": 0,
        "storage.directory": str(tmp_path / "data"),
        "storage.cluster.key": str(DEFAULT_KEY),
        "storage.cluster.numPartitions": 1,
    }
    cert = tmp_path / "cert.yaml"
    cert.write_text(
        yaml.safe_dump({**base, "storage.ssl.certFile": "/dev/zero", "storage.ssl.keyFile": "/dev/zero"})
    )
    endless_cert = _storage_run(tmp_path, cert)
    assert endless_cert.returncode == 2, endless_cert.stderr[-2000:]
    assert "storage.ssl.certFile: /dev/zero holds more than" in endless_cert.stderr

    blank = tmp_path / "blank.yaml"
    blank.write_text(yaml.safe_dump({**base, "storage.directory": "  "}))
    refused = _storage_run(tmp_path, blank)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "storage.directory: must name a directory" in refused.stderr
    assert list(tmp_path.glob("*control*")) == []  # nothing written into the current directory
    assert time.monotonic() - started < 30
