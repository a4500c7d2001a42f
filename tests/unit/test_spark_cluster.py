"""The process-wide Spark source's worker hygiene (no cluster: see tests/spark for reads)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from waltz.spark import cluster


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_a_reused_spark_worker_freezes_its_heap(monkeypatch: pytest.MonkeyPatch, unfrozen: None) -> None:
    # PySpark's daemon sets SPARK_REUSE_WORKER and runs a full gc.collect() after every task: the objects
    # alive when the source opens (modules, the client) must not be traversed again each time.
    monkeypatch.setenv("SPARK_REUSE_WORKER", "1")
    cluster._freeze_heap_in_reused_worker()
    assert gc.get_freeze_count() > 1000


def test_elsewhere_nothing_is_frozen(monkeypatch: pytest.MonkeyPatch, unfrozen: None) -> None:
    monkeypatch.delenv("SPARK_REUSE_WORKER", raising=False)
    cluster._freeze_heap_in_reused_worker()
    assert gc.get_freeze_count() == 0
