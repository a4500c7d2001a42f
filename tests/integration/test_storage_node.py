"""A real storage node process on loopback: every request type, fencing, bad input, crash durability.

Each test starts its own ``waltz storage run`` subprocess (:class:`StorageProcess`) on free ports and a
temporary directory, and stops it in a fixture teardown.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import struct
import uuid
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from waltz.errors import (
    ClusterKeyMismatchError,
    CorruptionError,
    PartitionNotAssignedError,
    SessionFencedError,
    TransactionOutOfOrderError,
)
from waltz.protocol import storage as st
from waltz.protocol.framing import MAGIC_STORAGE, encode_frame
from waltz.protocol.record_run import RecordRun
from waltz.protocol.records import Record, ReqId
from waltz.server.storage_client import AdminClient, StorageClient

from .raw_storage import RawConnection
from .storage_process import DEFAULT_KEY, StorageProcess, append_until_killed

pytestmark = pytest.mark.integration

T = TypeVar("T")
NUM_PARTITIONS = 4


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def records(first: int, n: int, size: int = 64, tag: int = 0) -> list[Record]:
    return [
        Record.build(i, ReqId(tag << 32, i & 0xFFFFFFFF), i % 7, (f"{tag}:{i}:".encode() * size)[:size])
        for i in range(first, first + n)
    ]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[StorageProcess]:
    proc = StorageProcess(tmp_path, num_partitions=NUM_PARTITIONS)
    try:
        proc.start()
        yield proc
    finally:
        proc.stop()


async def connect(node: StorageProcess) -> tuple[StorageClient, AdminClient]:
    admin = await AdminClient.connect("127.0.0.1", node.admin_port, DEFAULT_KEY, NUM_PARTITIONS)
    client = await StorageClient.connect("127.0.0.1", node.port, DEFAULT_KEY, NUM_PARTITIONS)
    return client, admin


# ------------------------------------------------------------------------------------- request types


@pytest.mark.timeout(60)
def test_every_data_and_admin_request(node: StorageProcess) -> None:
    async def go() -> None:
        client, admin = await connect(node)
        async with client, admin:
            await admin.set_assigned([0, 1], True)
            assert {s.partition_id for s in await admin.partition_statuses()} == {0, 1}
            # LastSessionInfo fences in session 5 (the server's first message of a session).
            info = await client.last_session_info(5, 0)
            assert (info.session_id, info.low_water_mark, info.local_low_water_mark) == (-1, -1, -1)
            assert await client.max_transaction_id(5, 0) == -1
            batch = records(0, 10)
            await client.append(5, 0, batch)
            await client.append(5, 0, [])  # an empty append is a no-op that succeeds
            assert await client.max_transaction_id(5, 0) == 9
            assert await client.read_record(5, 0, 3) == batch[3]
            assert await client.read_record(5, 0, 10) is None
            assert await client.read_header(5, 0, 4) == batch[4].header_only()
            assert await client.read_records(5, 0, 2, 5) == batch[2:7]
            assert await client.read_records(5, 0, 8, 100) == batch[8:]
            assert await client.read_headers(5, 0, 0, 3) == [r.header_only() for r in batch[:3]]
            # Truncate answers with the new max id; then the low-water mark can be set at it.
            assert await client.truncate(5, 0, 6) == 6
            await client.set_low_water_mark(5, 0, 6)
            info = await client.last_session_info(5, 0)
            assert (info.session_id, info.low_water_mark, info.local_low_water_mark) == (5, 6, 6)
            # Admin views.
            assert await admin.max_transaction_id(0) == 6
            assert (await admin.last_session_info(0)).session_id == 5
            assert await admin.read_records(0, 0, 100) == batch[:7]
            assert '"maxTransactionId": 6' in await admin.metrics_json()
            # Offline requests need the partition unavailable and the persisted session id.
            with pytest.raises(PartitionNotAssignedError):
                await client.max_transaction_id(5, 0, offline=True)
            await admin.set_available([0], False)
            assert await client.max_transaction_id(5, 0, offline=True) == 6
            assert (await client.last_session_info(5, 0, offline=True)).low_water_mark == 6
            with pytest.raises(SessionFencedError):
                await client.max_transaction_id(4, 0, offline=True)
            with pytest.raises(PartitionNotAssignedError, match="not available"):
                await client.max_transaction_id(5, 0)
            # Offline recovery may end by adopting a newer session id with its low-water mark (and only
            # that request: the others still need the persisted id); older sessions are fenced from then on.
            with pytest.raises(SessionFencedError):
                await client.set_low_water_mark(4, 0, 6, offline=True)
            with pytest.raises(SessionFencedError):
                await client.truncate(8, 0, 6, offline=True)
            await client.set_low_water_mark(8, 0, 6, offline=True)
            assert (await admin.last_session_info(0)).session_id == 8
            assert await client.max_transaction_id(8, 0, offline=True) == 6
            await admin.set_available([0], True)
            with pytest.raises(SessionFencedError):
                await client.max_transaction_id(6, 0)
            assert await client.max_transaction_id(8, 0) == 6
            # Partition 1 is independent; partition 2 is not assigned.
            await client.append(0, 1, records(0, 3))
            assert await client.max_transaction_id(0, 1) == 2
            # A run read returns the stored bytes, which unpack to the very records appended.
            count, run_bytes = await client.read_run(0, 1, 1, 10, 1 << 20)
            assert count == 2
            assert RecordRun(1, count, run_bytes).records() == records(0, 3)[1:]
            assert await client.read_run(0, 1, 3, 10, 1 << 20) == (0, b"")
            with pytest.raises(PartitionNotAssignedError, match="Partition:2 is not assigned"):
                await client.append(0, 2, records(0, 1))
            with pytest.raises(PartitionNotAssignedError, match="does not exist"):
                await client.max_transaction_id(0, NUM_PARTITIONS)
            # Unassign with file deletion, then reassign: the partition starts empty.
            await admin.set_assigned([1], False, delete_files=True)
            with pytest.raises(PartitionNotAssignedError):
                await client.max_transaction_id(0, 1)
            await admin.set_assigned([1], True)
            assert await client.max_transaction_id(0, 1) == -1
            assert client.is_usable  # failures never cost the connection

    run(go())


@pytest.mark.timeout(60)
def test_unassigning_with_deletion_removes_files_that_would_not_open(node: StorageProcess) -> None:
    async def go() -> None:
        client, admin = await connect(node)
        try:
            await admin.set_assigned([0], True)
            await client.append(0, 0, records(0, 5))
            await admin.set_assigned([0], False)  # files stay
            partition_dir = node.directory / "0"
            next(partition_dir.glob("*.idx")).unlink()  # records without an index: would not open any more
            await admin.set_assigned([0], False, delete_files=True)
            assert not partition_dir.exists()
            # Deleting a partition that never had files creates nothing.
            await admin.set_assigned([2], False, delete_files=True)
            assert not (node.directory / "2").exists()
            await admin.set_assigned([0], True)
            assert await client.max_transaction_id(0, 0) == -1
        finally:
            await client.aclose()
            await admin.aclose()

    run(go())


@pytest.mark.timeout(60)
def test_bad_appends_fail_alone_and_the_log_stays_dense(node: StorageProcess) -> None:
    async def go() -> None:
        client, admin = await connect(node)
        async with client, admin:
            await admin.set_assigned([0], True)
            await client.append(1, 0, records(0, 5))
            with pytest.raises(TransactionOutOfOrderError):
                await client.append(1, 0, records(7, 1))
            with pytest.raises(TransactionOutOfOrderError):
                await client.append(1, 0, records(3, 2))  # overlaps what is stored
            bad = records(5, 2)
            bad[1] = bad[1]._replace(checksum=bad[1].checksum ^ 1)
            with pytest.raises(CorruptionError):
                await client.append(1, 0, bad)
            gap = [*records(5, 1), *records(7, 1)]  # not dense inside the request
            with pytest.raises(TransactionOutOfOrderError):
                await client.append(1, 0, gap)
            # Requests of records of one size are checked in bulk: a bad record deep in one is still refused
            # with its own error, naming it, and nothing of the request is written.
            bulk = records(5, 30)
            bulk[17] = bulk[17]._replace(checksum=bulk[17].checksum ^ 0x100)
            with pytest.raises(CorruptionError, match="transaction 22: data does not match"):
                await client.append(1, 0, bulk)
            bulk = [*records(5, 20), *records(26, 10)]
            with pytest.raises(TransactionOutOfOrderError, match="expected 25, got 26"):
                await client.append(1, 0, bulk)
            assert await client.max_transaction_id(1, 0) == 4
            # Many concurrent appends, one of them bad, form groups: only the bad one fails.
            good = [client.append(1, 0, records(5 + i, 1)) for i in range(20)]
            results = await asyncio.gather(
                *good[:10], client.append(1, 0, records(99, 1)), *good[10:], return_exceptions=True
            )
            assert [type(r) for r in results].count(TransactionOutOfOrderError) == 1
            assert all(r is None for i, r in enumerate(results) if i != 10)
            assert await client.max_transaction_id(1, 0) == 24
            stored = await client.read_records(1, 0, 0, 100)
            assert [r.transaction_id for r in stored] == list(range(25))
            assert all(r.verify() for r in stored)

    run(go())


@pytest.mark.timeout(60)
def test_appends_read_together_share_one_fsync(node: StorageProcess) -> None:
    """Group commit: appends to a partition that reach the node together (a server keeps up to
    ``storage.maxInflightBatches`` per partition in flight) are written together and fsynced once, not one
    fsync each (a lone append may be committed in the pass that read it; a burst must not be, one by one)."""

    async def fsyncs(admin: AdminClient) -> int:
        count: int = json.loads(await admin.metrics_json())["partitions"]["0"]["fsyncs"]
        return count

    async def go() -> None:
        client, admin = await connect(node)
        async with client, admin:
            await admin.set_assigned([0], True)
            await client.append(1, 0, records(0, 1))
            before = await fsyncs(admin)
            # Sent in one loop pass: the client's frames leave in one write, and reach the node in one read.
            await asyncio.gather(*(client.append(1, 0, records(1 + i, 1)) for i in range(16)))
            assert await client.max_transaction_id(1, 0) == 16
            assert await fsyncs(admin) - before <= 3

    run(go())


# --------------------------------------------------------------------------------------------- fencing


@pytest.mark.timeout(60)
def test_newer_session_fences_older_ones(node: StorageProcess) -> None:
    async def go() -> None:
        admin = await AdminClient.connect("127.0.0.1", node.admin_port, DEFAULT_KEY, NUM_PARTITIONS)
        old = await StorageClient.connect("127.0.0.1", node.port, DEFAULT_KEY, NUM_PARTITIONS)
        new = await StorageClient.connect("127.0.0.1", node.port, DEFAULT_KEY, NUM_PARTITIONS)
        async with old, new, admin:
            await admin.set_assigned([0], True)
            await old.append(3, 0, records(0, 2))
            # The first message of session 4 fences session 3, on any connection.
            assert (await new.last_session_info(4, 0)).session_id == -1
            with pytest.raises(SessionFencedError):
                await old.append(3, 0, records(2, 1))
            with pytest.raises(SessionFencedError):
                await old.max_transaction_id(3, 0)
            await new.append(4, 0, records(2, 1))
            # An even older session arriving later fences nothing and is refused.
            with pytest.raises(SessionFencedError):
                await old.append(2, 0, records(3, 1))
            await new.append(4, 0, records(3, 1))
            # Requests queued behind the fencing message fail even though they arrived earlier than
            # their processing: send a burst from session 4 and a session-5 message right behind it.
            burst = [new.append(4, 0, records(4 + i, 1)) for i in range(50)]
            fence = new.max_transaction_id(5, 0)
            results = await asyncio.gather(*burst, fence, return_exceptions=True)
            fenced = sum(isinstance(r, SessionFencedError) for r in results[:-1])
            ok = sum(r is None for r in results[:-1])
            assert fenced + ok == 50
            assert isinstance(results[-1], int)
            assert results[-1] == 3 + ok  # everything appended before the fence is there, densely
            assert (await admin.last_session_info(0)).session_id == -1  # fencing is in memory only

    run(go())


# ------------------------------------------------------------------------------------------- bad input


@pytest.mark.timeout(60)
def test_wrong_cluster_key_or_partition_count_is_refused(node: StorageProcess) -> None:
    async def go() -> None:
        with pytest.raises(ClusterKeyMismatchError, match="cluster key"):
            await StorageClient.connect("127.0.0.1", node.port, uuid.uuid4(), NUM_PARTITIONS)
        with pytest.raises(ClusterKeyMismatchError, match="number of partitions"):
            await StorageClient.connect("127.0.0.1", node.port, DEFAULT_KEY, NUM_PARTITIONS + 1)
        with pytest.raises(ClusterKeyMismatchError):
            await AdminClient.connect("127.0.0.1", node.admin_port, uuid.uuid4(), NUM_PARTITIONS)
        # A request without a successful open is refused, not served.
        conn = RawConnection(node.port)
        try:
            conn.hello()
            conn.send_payload(st.encode(st.MaxTransactionIdRequest(0, 0, 0, False)))
            resp = st.decode(conn.read_payload())
            assert isinstance(resp, st.FailureResponse)
            assert "not been opened" in resp.failure.message
        finally:
            conn.close()
        client, admin = await connect(node)  # the node still serves correct peers
        async with client, admin:
            await admin.set_assigned([0], True)
            await client.append(0, 0, records(0, 1))

    run(go())


@pytest.mark.timeout(90)
def test_malformed_and_oversized_frames_while_another_connection_appends(node: StorageProcess) -> None:
    async def go() -> None:
        client, admin = await connect(node)
        async with client, admin:
            await admin.set_assigned([0], True)
            stop = asyncio.Event()
            appended = 0

            async def keep_appending() -> None:
                nonlocal appended
                while not stop.is_set():
                    await client.append(0, 0, records(appended, 5))
                    appended += 5

            appender = asyncio.create_task(keep_appending())

            def misbehave() -> list[bool]:
                closed: list[bool] = []
                # 1. Garbage instead of a hello.
                c = RawConnection(node.port)
                c.sock.sendall(os.urandom(64) + b"\xff" * 64)
                closed.append(c.closed_by_peer())
                c.close()
                # 2. A hello, then a frame header announcing 2 GiB.
                c = RawConnection(node.port)
                c.hello()
                c.sock.sendall(struct.pack(">Bhi", MAGIC_STORAGE, 0, 0x7FFFFFFF) + b"x" * 100)
                closed.append(c.closed_by_peer())
                c.close()
                # 3. An unknown message type in a well-formed frame.
                c = RawConnection(node.port)
                c.hello()
                c.send_payload(struct.pack(">bqqi", 99, 0, 1, 0))
                closed.append(c.closed_by_peer())
                c.close()
                # 4. A truncated append (the record list claims more than the frame holds).
                c = RawConnection(node.port)
                c.hello()
                c.send_payload(st.encode(st.OpenRequest(-1, 0, -1, DEFAULT_KEY, NUM_PARTITIONS)))
                c.read_payload()
                good = st.encode(st.AppendRequest(0, 1, 0, records(10**6, 1), False))
                c.send_payload(good[:-30])
                closed.append(c.closed_by_peer())
                c.close()
                # 5. A wrong frame magic after the hello.
                c = RawConnection(node.port)
                c.hello()
                c.sock.sendall(encode_frame(0x41, 0, b"\x00" * 30))
                closed.append(c.closed_by_peer())
                c.close()
                # 6. A peer that connects and says nothing is dropped after the hello timeout; we only
                # check that its presence does not disturb anyone (closed at once here).
                socket.create_connection(("127.0.0.1", node.port), timeout=5).close()
                return closed

            closed = await asyncio.to_thread(misbehave)
            before = appended
            await asyncio.sleep(0.3)
            stop.set()
            await appender
            assert closed == [True] * 5
            assert appended > before  # the good connection kept appending throughout
            assert await client.max_transaction_id(0, 0) == appended - 1
        log_text = node.log_text()
        assert "hello exchange failed" in log_text
        assert "exceeds the limit" in log_text
        assert "unknown storage message type 99" in log_text
        assert "does not fit the message" in log_text
        assert "negotiated magic" in log_text
        assert "Traceback" not in log_text

    run(go())


# ------------------------------------------------------------------------------------ crash durability


@pytest.mark.timeout(120)
def test_kill_9_during_appends_loses_nothing_acknowledged(node: StorageProcess) -> None:
    acked: set[int] = set()

    async def stream() -> None:
        client, admin = await connect(node)
        async with admin:
            await admin.set_assigned([0], True)
        try:
            await append_until_killed(
                client,
                node,
                0,
                lambda first, n: records(first, n, size=200, tag=7),
                in_flight=64,
                max_batch=4,
                kill_after_s=1.5,
                acked=acked,
            )
        finally:
            await client.aclose()

    run(stream())
    assert len(acked) > 100, "the node was killed before acknowledging a useful number of appends"
    node.restart()

    async def verify() -> None:
        client, _admin = await connect(node)
        async with client, _admin:
            max_id = await client.max_transaction_id(8, 0)
            assert max_id >= max(acked)
            got: list[Record] = []
            while len(got) <= max_id:
                got += await client.read_records(8, 0, len(got), 1000)
            assert [r.transaction_id for r in got] == list(range(max_id + 1))  # dense
            expected = {r.transaction_id: r for r in records(0, max_id + 1, size=200, tag=7)}
            for r in got:
                assert r.verify(), f"record {r.transaction_id} does not verify"
                assert r == expected[r.transaction_id]
            # The log keeps accepting appends after recovery.
            await client.append(8, 0, records(max_id + 1, 3, size=200, tag=7))

    run(verify())


@pytest.mark.timeout(60)
def test_clean_restart_keeps_ports_assignment_and_data(node: StorageProcess) -> None:
    async def write() -> None:
        client, admin = await connect(node)
        async with client, admin:
            await admin.set_assigned([2], True)
            await client.append(1, 2, records(0, 10))
            await client.set_low_water_mark(1, 2, 9)

    run(write())
    ports = (node.port, node.admin_port)
    assert node.terminate() == 0
    node.restart()
    assert (node.port, node.admin_port) == ports

    async def check() -> None:
        client, admin = await connect(node)
        async with client, admin:
            assert [s.partition_id for s in await admin.partition_statuses()] == [2]
            info = await client.last_session_info(2, 2)
            assert (info.session_id, info.low_water_mark, info.local_low_water_mark) == (1, 9, 9)
            assert await client.read_records(2, 2, 0, 100) == records(0, 10)
            # The persisted session id initialises fencing: session 0 is older and refused.
            with pytest.raises(SessionFencedError):
                await client.max_transaction_id(0, 2)

    run(check())


@pytest.mark.timeout(60)
def test_back_pressure_a_peer_that_does_not_read(tmp_path: Path) -> None:
    """A peer that sends many requests and never reads responses makes the node stop reading from it;
    the node's memory stays bounded and other connections are served."""
    proc = StorageProcess(
        tmp_path,
        num_partitions=NUM_PARTITIONS,
        config={"storage.connection.maxInFlight": 16, "storage.partition.queueSize": 8},
    )
    with proc.start():

        async def go() -> None:
            client, admin = await connect(proc)
            raw = RawConnection(proc.port)
            try:
                async with client, admin:
                    await admin.set_assigned([0, 1], True)
                    raw.hello()
                    raw.send_payload(st.encode(st.OpenRequest(-1, 0, -1, DEFAULT_KEY, NUM_PARTITIONS)))
                    raw.read_payload()
                    frame = encode_frame(
                        MAGIC_STORAGE, 0, st.encode(st.MaxTransactionIdRequest(0, 1, 0, False))
                    )
                    chunk = frame * 10_000
                    total_chunks = 200  # 70 MB of requests whose responses are never read
                    sent = 0

                    def flood() -> None:
                        nonlocal sent
                        raw.sock.settimeout(None)
                        for _ in range(total_chunks):
                            raw.sock.sendall(chunk)
                            sent += 1

                    flooder = asyncio.get_running_loop().run_in_executor(None, flood)
                    await asyncio.sleep(3)
                    # TCP pushes back: the node stopped reading from the peer long before 70 MB.
                    assert not flooder.done()
                    assert sent < total_chunks // 2
                    # Everyone else is still served, on the congested partition too.
                    await client.append(0, 1, records(0, 3))
                    await client.append(0, 0, records(0, 3))
                    assert await client.max_transaction_id(0, 0) == 2
                    raw.sock.shutdown(socket.SHUT_RDWR)  # unblocks the flooder
                    with contextlib.suppress(OSError):
                        await flooder
            finally:
                raw.close()

        run(go())


# ------------------------------------------------------------------------------------- configuration


def _run_cli_storage(config_path: Path) -> tuple[int, str]:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "waltz.cli.main", "storage", "run", "--config", str(config_path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return proc.returncode, proc.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "cannot read config file"),
        ("storage.port: [1\n", "not valid YAML"),
        (
            "storage.port: 0\nstorage.admin.port: 0\nstorage.directory: /tmp/x\nstorage.prot: 5\n",
            "unknown key",
        ),
        (
            "storage.port: 7000\nstorage.admin.port: 7000\nstorage.directory: /tmp/x\n"
            f"storage.cluster.key: {DEFAULT_KEY}\nstorage.cluster.numPartitions: 1\n",
            "ports must be distinct",
        ),
        ("storage.port: 0\nstorage.admin.port: 0\nstorage.directory: /tmp/x\n", "zookeeper.connectString"),
        ("storage.port: x\nstorage.admin.port: 0\nstorage.directory: /tmp/x\n", "expected an integer"),
    ],
    ids=["missing-file", "bad-yaml", "unknown-key", "equal-ports", "no-identity", "bad-type"],
)
def test_bad_config_exits_2_with_one_line(tmp_path: Path, text: str | None, message: str) -> None:
    path = tmp_path / "storage.yaml"
    if text is not None:
        path.write_text(text, encoding="utf-8")
    code, stderr = _run_cli_storage(path)
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert message in lines[0]
    assert "Traceback" not in stderr


@pytest.mark.timeout(60)
def test_control_file_of_another_cluster_refuses_to_start(tmp_path: Path) -> None:
    first = StorageProcess(tmp_path, num_partitions=2)
    with first.start():
        pass
    other = StorageProcess(tmp_path, num_partitions=2, cluster_key=uuid.uuid4())
    code, stderr = _run_cli_storage(_write_config(other))
    assert code == 1
    assert "does not match" in stderr
    # Besides the INFO lines of the start (the version and configuration), one line: the error.
    assert len([line for line in stderr.strip().splitlines() if " INFO " not in line]) == 1


def _write_config(proc: StorageProcess) -> Path:
    import yaml

    proc.config_path.write_text(yaml.safe_dump(proc.config), encoding="utf-8")
    return proc.config_path


# ---------------------------------------------------------------------------- identity from ZooKeeper


@pytest.mark.timeout(120)
def test_identity_from_zookeeper(tmp_path: Path, zk: Any, zk_connect_string: str) -> None:
    from waltz.cluster.store_metadata import create_cluster

    params = create_cluster(zk, "/waltz/c1", "c1", 3)
    zk_config = {"zookeeper.connectString": zk_connect_string, "cluster.root": "/waltz/c1"}
    proc = StorageProcess(tmp_path, use_cluster_identity=False, config=zk_config)
    with proc.start():

        async def go() -> None:
            async with await AdminClient.connect("127.0.0.1", proc.admin_port, params.cluster_key, 3) as a:
                await a.set_assigned([0], True)
            with pytest.raises(ClusterKeyMismatchError):
                await StorageClient.connect("127.0.0.1", proc.port, DEFAULT_KEY, 3)

        run(go())
    # The same directory under another cluster's ZooKeeper identity: the node refuses to start.
    create_cluster(zk, "/waltz/c2", "c2", 3)
    other = StorageProcess(
        tmp_path,
        use_cluster_identity=False,
        config={"zookeeper.connectString": zk_connect_string, "cluster.root": "/waltz/c2"},
    )
    code, stderr = _run_cli_storage(_write_config(other))
    assert code == 1
    assert "does not match" in stderr
    # No cluster at that root: a clear error, not a traceback.
    missing = StorageProcess(
        tmp_path / "m",
        use_cluster_identity=False,
        config={"zookeeper.connectString": zk_connect_string, "cluster.root": "/nope"},
    )
    code, stderr = _run_cli_storage(_write_config(missing))
    assert code == 1, stderr
    assert "Traceback" not in stderr
