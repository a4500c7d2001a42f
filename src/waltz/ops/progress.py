"""What the operator tools' long copies (``waltz backup``, ``waltz restore``, ``waltz storage
recover-partition``) report while they run."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["CopyProgress", "OnProgress", "PartitionCopyProgress", "records_per_s"]


def records_per_s(records: int, elapsed_s: float) -> float:
    """``records`` over ``elapsed_s`` seconds (0 before any time has passed)."""
    return records / elapsed_s if elapsed_s > 0 else 0.0


@dataclass(frozen=True)
class CopyProgress:
    """Where a copy stands: ``done`` of ``total`` records after ``elapsed_s`` seconds."""

    done: int
    total: int
    elapsed_s: float

    @property
    def records_per_s(self) -> float:
        return records_per_s(self.done, self.elapsed_s)


@dataclass(frozen=True)
class PartitionCopyProgress(CopyProgress):
    """A copy of one partition's records, the next to copy being ``next_id`` and the last ``target``."""

    partition: int
    next_id: int
    target: int


OnProgress = Callable[[CopyProgress], None]
"""Called as a copy advances (on the copy's loop: keep it short)."""
