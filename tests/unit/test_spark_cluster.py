"""The process-wide Spark source tunes a reused PySpark worker (no cluster: tests/spark read through one)."""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Iterator

import pytest

from waltz.spark import cluster


class FakeLibc:
    """Records mallopt calls instead of changing the test process's allocator."""

    def __init__(self, name: str) -> None:
        assert name == "libc.so.6"
        self.calls: list[tuple[int, int]] = []
        CALLS.append(self.calls)

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1


CALLS: list[list[tuple[int, int]]] = []


@pytest.fixture
def worker(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    gc.unfreeze()
    CALLS.clear()
    monkeypatch.setattr(ctypes, "CDLL", FakeLibc)
    yield
    gc.unfreeze()


def test_a_reused_spark_worker_freezes_its_heap_and_keeps_large_buffers_mapped(
    monkeypatch: pytest.MonkeyPatch, worker: None
) -> None:
    # PySpark's daemon sets SPARK_REUSE_WORKER and runs a full gc.collect() after every task: the objects
    # alive when the source opens (modules, the client) must not be traversed again each time; and the runs'
    # multi-megabyte buffers must come from memory that stays mapped (M_MMAP_THRESHOLD -3, M_TRIM_THRESHOLD
    # -1), not be faulted in afresh for every run.
    monkeypatch.setenv("SPARK_REUSE_WORKER", "1")
    assert cluster._tune_reused_worker()
    assert gc.get_freeze_count() > 1000
    assert CALLS == [[(-3, 32 * 1024 * 1024), (-1, 128 * 1024 * 1024)]]


def test_elsewhere_nothing_changes(monkeypatch: pytest.MonkeyPatch, worker: None) -> None:
    monkeypatch.delenv("SPARK_REUSE_WORKER", raising=False)
    assert not cluster._tune_reused_worker()
    assert gc.get_freeze_count() == 0
    assert CALLS == []
