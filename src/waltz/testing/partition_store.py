"""A store for testing a server :class:`~waltz.server.partition.Partition` alone: appends are committed when
the test says so; and a client connection as a partition sees it that records what it is sent.

:class:`ManualStore` takes what the partition submits and keeps it pending until :meth:`ManualStore.commit`
commits the oldest ones as one batch (their listener hears it as it would from the real store, in order,
dense ids from the high-water mark). It can refuse submissions as a full queue would (``full``, then
:meth:`~ManualStore.make_room`). It holds no records: a feed that reads headers from it fails the test.
"""

from __future__ import annotations

import asyncio
from typing import Any

from waltz.protocol import client_server as cs
from waltz.server.store.appends import AppendListener, PendingAppend

__all__ = ["ManualStore", "RecordingPeer"]


class ManualStore:
    """Submitted appends stay pending until :meth:`commit`; see the module docstring."""

    def __init__(self, generation: int = 1, high_water_mark: int = -1) -> None:
        self.generation = generation
        self.high_water_mark = high_water_mark
        self.is_healthy = True
        self.full = False
        """Refuse submissions as a full store queue would, until :meth:`make_room`."""
        self.submitted: list[cs.AppendFields] = []
        """Every append submitted (and taken), in order."""
        self.pending: list[PendingAppend] = []
        """The appends submitted and not committed yet, oldest first."""
        self._room = asyncio.Event()
        self._resolutions = asyncio.Event()

    async def start(self) -> None:
        pass

    async def wait_open(self) -> int:
        return self.high_water_mark

    def submit(
        self,
        request: cs.AppendFields,
        listener: AppendListener,
        tag: object = None,
        received_s: float = 0.0,
        more: bool = False,
    ) -> bool:
        if self.full:
            return False
        pending = PendingAppend(request.req_id, request.header, request.data, request.checksum, listener, tag)
        pending.received_s = received_s
        self.submitted.append(request)
        self.pending.append(pending)
        return True

    async def wait_room(self) -> None:
        while self.full:
            self._room.clear()
            await self._room.wait()

    def make_room(self) -> None:
        self.full = False
        self._room.set()

    def commit(self, count: int, *, skip: int | None = None) -> None:
        """Commit the ``count`` oldest appends as one batch; ``skip`` (an index in it) is told apart, before
        the rest, as an append the store resolved on its own (the rest then has a gap)."""
        batch, self.pending = self.pending[:count], self.pending[count:]
        for pending in batch:
            self.high_water_mark += 1
            pending.transaction_id = self.high_water_mark
        listener = batch[0].listener
        if skip is not None:
            listener.appends_committed([batch[skip]])
            del batch[skip]
        listener.appends_committed(batch)
        self._resolutions.set()

    async def wait_resolution(self) -> bool:
        """Wait until a commit; False at once if nothing is pending."""
        if not self.pending:
            return False
        self._resolutions.clear()
        await self._resolutions.wait()
        return True

    async def flush(self) -> int:
        """The high-water mark once every append submitted so far is committed."""
        while self.pending:
            self._resolutions.clear()
            await self._resolutions.wait()
        return self.high_water_mark

    async def read_headers(self, transaction_id: int, max_count: int) -> list[Any]:
        raise AssertionError("a ManualStore holds no headers: every committed one is in the feed cache")

    async def close(self) -> None:
        self.is_healthy = False


class RecordingPeer:
    """A client's connection as a partition sees it: it keeps every message sent to it (``sent``) and drops
    the feed entries."""

    def __init__(self) -> None:
        self.sent: list[cs.Message] = []
        self.closed = False
        self.drain_needed = False

    def send(self, msg: cs.Message) -> None:
        self.sent.append(msg)

    def send_feed(self, entries: object, frames: object = None) -> None:
        pass

    async def drain(self) -> None:
        pass
