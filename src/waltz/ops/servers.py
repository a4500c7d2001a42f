"""One-shot admin requests to a Waltz server's client port (what ``waltz server list`` and the cluster
checks ask: owned partitions, their health, the server's view of each storage node)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from ssl import SSLContext

from waltz.config import host_port
from waltz.errors import ClientTimeoutError, RemoteProtocolError
from waltz.protocol import client_server as cs
from waltz.protocol.framing import MAGIC_CLIENT
from waltz.protocol.records import ReqId
from waltz.transport import open_connection

ADMIN_CLIENT_ID = -1
"""Client id of one-shot admin connections (they never mount or append)."""


async def query(
    address: str, requests: list[cs.Message], timeout_ms: int = 10_000, ssl: SSLContext | None = None
) -> list[cs.Message]:
    """Send admin requests to a server (over TLS with ``ssl``) and return its answers, in order."""
    host, port = host_port(address)
    conn = await open_connection(
        host,
        port,
        magic=MAGIC_CLIENT,
        versions=cs.SUPPORTED_VERSIONS,
        hello_text="Waltz Admin Client",
        connect_timeout_ms=timeout_ms,
        ssl=ssl,
    )
    try:
        answers = []
        for req in requests:
            conn.send(cs.encode(req, conn.negotiated_version))
            await conn.drain()
            try:
                async with asyncio.timeout(timeout_ms / 1000):
                    answers.append(cs.decode(await conn.receive(), conn.negotiated_version))
            except TimeoutError:
                raise ClientTimeoutError(f"{address} did not answer within {timeout_ms} ms") from None
        return answers
    finally:
        await conn.aclose()


def admin_req_id(seq: int) -> ReqId:
    return ReqId.of(ADMIN_CLIENT_ID, 0, 0, seq)


@dataclass(frozen=True)
class ServerReport:
    """What one server says about itself."""

    address: str
    partitions: tuple[int, ...]
    health: dict[int, bool]
    storage_connectivity: dict[str, bool]


async def server_report(
    address: str, timeout_ms: int = 10_000, ssl: SSLContext | None = None
) -> ServerReport:
    """Owned partitions, their health and the server's view of each storage node, in one connection."""
    answers = await query(
        address,
        [
            cs.ServerPartitionsAssignmentRequest(admin_req_id(1)),
            cs.ServerPartitionsHealthStatRequest(admin_req_id(2)),
            cs.CheckStorageConnectivityRequest(admin_req_id(3)),
        ],
        timeout_ms,
        ssl,
    )
    assignment, health, connectivity = answers
    if not (
        isinstance(assignment, cs.ServerPartitionsAssignmentResponse)
        and isinstance(health, cs.ServerPartitionsHealthStatResponse)
        and isinstance(connectivity, cs.CheckStorageConnectivityResponse)
    ):
        raise RemoteProtocolError(f"unexpected answers from {address}")
    return ServerReport(
        address,
        tuple(assignment.partition_ids),
        dict(health.partition_health),
        dict(connectivity.storage_connectivity),
    )
