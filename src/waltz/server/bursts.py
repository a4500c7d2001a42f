"""The partitions a client's read left waiting for more of their appends.

An append read with more requests behind it goes to its partition with ``more=True``: an idle store writer
then waits for the last of them and sends the burst as one batch (one request and one fsync per replica).
With many partitions the rest of the read is mostly other partitions' appends, so that last call never
comes for most of them, and each would send its append only in a callback of the next loop pass. A
connection's :class:`ReadBursts` remembers those partitions; the read's last request tells each of them to
send what it queued, in the same callback.
"""

from __future__ import annotations

from typing import Protocol


class BurstTaker(Protocol):
    """A partition (``waltz.server.partition.Partition``)."""

    def end_burst(self) -> None:
        """The appends it took with ``more=True`` are the last of their read: they go now."""
        ...


class ReadBursts:
    """One client connection's partitions waiting for the end of the read being handled."""

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending: list[BurstTaker] = []
        """Partitions given an append with more of the read behind it, in order (each once in a row)."""

    def took(self, part: BurstTaker, more: bool) -> None:
        """``part`` took an append; ``more``: requests of the read follow it (else the read ended)."""
        if more:
            pending = self.pending
            if not pending or pending[-1] is not part:
                pending.append(part)
        elif self.pending:
            self.end()

    def end(self) -> None:
        """The read ended: each partition sends what it queued."""
        pending, self.pending = self.pending, []
        for part in pending:
            part.end_burst()
