"""A real storage node answering MultiAppendRequests (storage codec V2): each contained append is checked and
answered on its own, a malformed one closes only its connection, and a V1 peer cannot send one.

Each test starts its own ``waltz storage run`` subprocess on free ports and a temporary directory.
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from waltz.errors import (
    PartitionNotAssignedError,
    SessionFencedError,
    TransactionOutOfOrderError,
)
from waltz.protocol import storage as st
from waltz.protocol import storage_multi as sm
from waltz.protocol.records import Record, ReqId
from waltz.server.storage_client import StorageClient

from .raw_storage import RawConnection
from .server_process import free_port
from .storage_process import DEFAULT_KEY, StorageProcess

pytestmark = pytest.mark.integration

T = TypeVar("T")
NUM_PARTITIONS = 4


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def records(first: int, n: int, tag: int = 0) -> list[Record]:
    return [Record.build(i, ReqId(tag << 32, i), 0, f"{tag}:{i}".encode()) for i in range(first, first + n)]


def body(first: int, n: int, tag: int = 0) -> bytes:
    return st.append_request_body(records(first, n, tag))


@pytest.fixture
def node(tmp_path: Path) -> Iterator[StorageProcess]:
    proc = StorageProcess(tmp_path, num_partitions=NUM_PARTITIONS, config={"storage.http.port": free_port()})
    try:
        proc.start()
        yield proc
    finally:
        proc.stop()


def request_counts(node: StorageProcess) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{node.http_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("waltz_storage_requests_total{"):
            kind = line.split('type="', 1)[1].split('"', 1)[0]
            out[kind] = float(line.rsplit(" ", 1)[1])
    return out


async def outcome(future: asyncio.Future[object]) -> type[BaseException] | None:
    try:
        await future
    except Exception as e:
        return type(e)
    return None


@pytest.mark.timeout(60)
def test_each_contained_append_gets_the_checks_and_answer_it_would_get_alone(node: StorageProcess) -> None:
    async def go() -> None:
        async with await node.admin_client() as admin, await node.data_client() as client:
            await admin.set_assigned([0, 1, 2], True)  # 3 is not assigned here
            assert client.multi_append is False  # until the server's feature version allows it
            await client.append(7, 2, records(0, 1))  # partition 2 is now in session 7
            client.multi_append = True
            # The first append leaves at once (nothing in flight); the rest of the pass is held and leaves as
            # one MultiAppendRequest.
            futures = [
                client.start_append_encoded(1, 0, body(0, 2)),
                client.start_append_encoded(1, 1, body(0, 3)),
                client.start_append_encoded(1, 0, body(2, 1)),  # partition 0 again, in order
                client.start_append_encoded(1, 1, body(5, 1)),  # a gap: refused, alone
                client.start_append_encoded(1, 3, body(0, 1)),  # not assigned on this node
                client.start_append_encoded(6, 2, body(1, 1)),  # fenced by session 7
                client.start_append_encoded(7, 2, body(1, 1)),
            ]
            results = await asyncio.gather(*(outcome(f) for f in futures))
            assert results == [
                None,
                None,
                None,
                TransactionOutOfOrderError,
                PartitionNotAssignedError,
                SessionFencedError,
                None,
            ]
            assert client.multi_requests == 1
            assert [await client.max_transaction_id(1, p) for p in (0, 1)] == [2, 2]
            assert await client.max_transaction_id(7, 2) == 1
            stored = await client.read_records(1, 0, 0, 10)
            assert [r.transaction_id for r in stored] == [0, 1, 2]
            assert all(r.verify() for r in stored)
        counts = await asyncio.to_thread(request_counts, node)
        assert counts["MultiAppendRequest"] == 1
        assert counts["AppendInMultiAppend"] == 6

    run(go())


@pytest.mark.timeout(60)
def test_held_appends_leave_before_a_later_request_of_another_type(node: StorageProcess) -> None:
    """Requests reach the node in the order they were made: a read made after held appends sees them."""

    async def go() -> None:
        async with await node.admin_client() as admin, await node.data_client() as client:
            await admin.set_assigned([0, 1], True)
            client.multi_append = True
            first = client.start_append_encoded(1, 0, body(0, 1))
            held = [client.start_append_encoded(1, p, body(1 - p, 1)) for p in (0, 1)]
            assert await client.max_transaction_id(1, 0) == 1
            await asyncio.gather(first, *held)
            assert client.multi_requests == 1

    run(go())


def _opened(port: int, version: int) -> RawConnection:
    """A raw connection speaking storage codec ``version`` with a session open, to misbehave on."""
    c = RawConnection(port)
    c.hello(version)
    c.send_payload(st.encode(st.OpenRequest(-1, 0, -1, DEFAULT_KEY, NUM_PARTITIONS)))
    assert isinstance(st.decode(c.read_payload()), st.SuccessResponse)
    return c


def _append(seq: int, partition: int, first: int) -> bytes:
    return st.encode_append_request(1, seq, partition, body(first, 1))


@pytest.mark.timeout(90)
def test_malformed_multi_requests_close_only_their_connection(node: StorageProcess) -> None:
    async def go() -> None:
        async with await node.admin_client() as admin, await node.data_client() as client:
            await admin.set_assigned([0, 1], True)

            def misbehave() -> list[bool]:
                bad = [
                    # A contained message that is not an append (its append before it is not written either).
                    (
                        2,
                        sm.encode_multi_append(
                            [_append(1, 1, 0), st.encode(st.MaxTransactionIdRequest(1, 2, 1, False))]
                        ),
                    ),
                    # More appends than allowed (built by hand: the encoder refuses).
                    (
                        2,
                        sm.MULTI_APPEND_HEAD
                        + (257).to_bytes(4, "big")
                        + (b"\x00\x00\x00\x1a" + _append(1, 1, 0)[:26]) * 257,
                    ),
                    # A contained append cut short.
                    (2, sm.encode_multi_append([_append(1, 1, 0)[:-3]])),
                    # A V1 peer sending type 28.
                    (1, sm.encode_multi_append([_append(1, 1, 0)])),
                ]
                closed = []
                for version, payload in bad:
                    c = _opened(node.port, version)
                    c.send_payload(payload)
                    closed.append(c.closed_by_peer())
                    c.close()
                return closed

            assert await asyncio.to_thread(misbehave) == [True] * 4
            # The node serves on: nothing of the refused requests was written, and appends go on.
            assert await client.max_transaction_id(1, 1) == -1
            await client.append(1, 1, records(0, 1))
            assert await client.max_transaction_id(1, 1) == 0
        log_text = node.log_text()
        assert "append 1 of a multi-append request is storage message type 13" in log_text
        assert "1 to 256 appends, not 257" in log_text
        assert "append 0 of a multi-append request: " in log_text
        assert "storage message type 28 is not in codec V1" in log_text
        assert "Traceback" not in log_text

    run(go())


@pytest.mark.timeout(60)
def test_a_connection_of_v1_gets_appends_one_by_one(
    node: StorageProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection that negotiated codec V1 (a node of a release before V2) is never sent a
    MultiAppendRequest, whatever the feature version says."""

    async def go() -> None:
        async with await node.admin_client() as admin:
            await admin.set_assigned([0, 1], True)
        monkeypatch.setattr(st, "STORAGE_VERSIONS", (0, 1))  # the hello lists V0 and V1 only
        client = await StorageClient.connect("127.0.0.1", node.port, DEFAULT_KEY, NUM_PARTITIONS)
        async with client:
            assert client._rpc.connection.negotiated_version == 1
            client.multi_append = True
            await asyncio.gather(*(client.start_append_encoded(1, p % 2, body(p // 2, 1)) for p in range(6)))
            assert client.multi_requests == 0
            assert [await client.max_transaction_id(1, p) for p in (0, 1)] == [2, 2]
        counts = await asyncio.to_thread(request_counts, node)
        assert counts["MultiAppendRequest"] == 0

    run(go())
