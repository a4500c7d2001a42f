"""A client connection as the server's partitions see it, and the two ways a connection ends early."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from waltz.errors import ConnectionError_, RemoteProtocolError
from waltz.protocol import client_server as cs
from waltz.protocol.records import ReqId
from waltz.server.feed_cache import FeedEntry
from waltz.transport import ByteBudget, FramedConnection

__all__ = ["BadMessage", "ClientConnection", "CloseConnection"]

TRIMMED_RESPONSE_VERSION = cs.TrimmedResponse.MIN_VERSION
"""The first codec that can tell a client its read or mount starts below the trim point."""


class CloseConnection(Exception):
    """Raised by a request handler when the only honest answer is to close the connection."""


class BadMessage(Exception):
    """A client message did not decode (``error``): the connection is closed, with a rate-limited warning."""

    def __init__(self, error: RemoteProtocolError) -> None:
        super().__init__(str(error))
        self.error = error


class ClientConnection:
    """A client connection as partitions see it (implements :class:`waltz.server.partition.Peer`), with its
    bounds: ``slots`` for unanswered spawned requests and ``budget`` for the bytes of read responses."""

    __slots__ = ("_conn", "_version", "budget", "client_id", "mounts", "slots")

    def __init__(self, conn: FramedConnection, max_in_flight: int, max_response_bytes: int) -> None:
        self._conn = conn
        self._version = conn.negotiated_version
        self.client_id: int | None = None
        self.mounts: dict[int, ReqId | None] = {}
        """Per partition, the ReqId of the latest MountRequest on this connection; None once we ended it."""
        self.slots = asyncio.Semaphore(max_in_flight)
        self.budget = ByteBudget(max_response_bytes)

    def end_mount(self, partition_id: int) -> bool:
        """Tell the client its mount of ``partition_id`` on this connection is over (MountResponse NOT_READY),
        once per mount. False if the connection never mounted the partition: nothing to answer on."""
        if partition_id not in self.mounts:
            return False
        session = self.mounts[partition_id]
        if session is not None:
            self.mounts[partition_id] = None
            self.send(cs.MountResponse(session, cs.PartitionState.NOT_READY))
        return True

    @property
    def closed(self) -> bool:
        return self._conn.is_closed

    @property
    def source(self) -> str:
        return self._conn.source

    def send(self, msg: cs.Message) -> None:
        try:
            self._conn.send(cs.encode(msg, self._version))
        except ConnectionError_:
            pass  # the connection is gone: its read loop ends and cleans up

    def send_trimmed(self, req_id: ReqId, transaction_id: int, trim_point: int) -> bool:
        """Answer ``req_id`` (a range read or a mount) with TrimmedResponse: its first id, ``transaction_id``,
        is below ``trim_point``. False (nothing sent) if the peer's codec (before V6) has no such answer."""
        if self._version < TRIMMED_RESPONSE_VERSION:
            return False
        self.send(cs.TrimmedResponse(req_id, transaction_id, trim_point))
        return True

    def send_range(self, msg: cs.TransactionRangeResponse) -> None:
        """:meth:`send` of a range response, its run (megabytes, as the storage node sent it) written after
        the head rather than joined into a payload and then into a frame."""
        if not msg.run:
            self.send(msg)
            return
        try:
            self._conn.send(*cs.encode_range_response_parts(msg, self._version))
        except ConnectionError_:
            pass

    def send_feed(self, entries: Sequence[FeedEntry], frames: dict[int, bytes] | None = None) -> None:
        """A FeedData for each of ``entries``, in order (the feed's hot path: one call per batch). ``frames``:
        the entries framed by protocol version, shared by every client a committed batch goes to: framed
        once per version, not once per client."""
        data = frames.get(self._version) if frames is not None else None
        if data is None:
            data = cs.frame_feed_entries(entries, self._version)
            if frames is not None:
                frames[self._version] = data
        try:
            self._conn.send(data, framed=True)
        except ConnectionError_:
            pass

    @property
    def drain_needed(self) -> bool:
        return self._conn.drain_needed

    async def drain(self) -> None:
        conn = self._conn
        # The feed drains after every batch it sends: with little unsent (nearly always) the drain could not
        # wait, and skipping it saves two coroutines per batch. The frames leave with the iteration's flush.
        if conn.drain_needed:
            await conn.drain()

    async def aclose(self) -> None:
        await self._conn.aclose()
