"""The entry points' process set-up: the event loop, the collector and the allocator."""

from __future__ import annotations

import asyncio

import pytest

from waltz.runtime import GC_THRESHOLDS, run, tune_gc, tune_malloc


def test_run_helper_returns_the_result() -> None:
    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    assert run(answer()) == 42


def test_tune_gc_freezes_start_up_objects_and_raises_the_thresholds() -> None:
    import gc

    before = gc.get_threshold()
    try:
        tune_gc()
        assert gc.get_threshold() == GC_THRESHOLDS
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_tune_malloc_keeps_run_sized_buffers_on_the_heap(monkeypatch: pytest.MonkeyPatch) -> None:
    # Servers and storage nodes call it at start-up: record runs of megabytes must come from memory that
    # stays mapped (M_MMAP_THRESHOLD -3 at 32 MiB, M_TRIM_THRESHOLD -1 at 128 MiB), not be faulted in afresh.
    import ctypes

    calls: list[tuple[int, int]] = []

    class FakeLibc:
        def __init__(self, name: str) -> None:
            assert name == "libc.so.6"

        def mallopt(self, param: int, value: int) -> int:
            calls.append((param, value))
            return 1

    monkeypatch.setattr(ctypes, "CDLL", FakeLibc)
    assert tune_malloc()
    assert calls == [(-3, 32 * 1024 * 1024), (-1, 128 * 1024 * 1024)]


@pytest.mark.parametrize("missing", ["library", "function"])
def test_tune_malloc_changes_nothing_where_the_allocator_is_not_glibc(
    monkeypatch: pytest.MonkeyPatch, missing: str
) -> None:
    # musl (no libc.so.6) and macOS (no such library either) must start a server or a node as before, and a
    # libc.so.6 without mallopt (a compatibility shim) too: tune_malloc says False instead of raising.
    import ctypes

    class NoMallopt:
        def __init__(self, name: str) -> None:
            if missing == "library":
                raise OSError(f"{name}: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(ctypes, "CDLL", NoMallopt)
    assert tune_malloc() is False
