"""A storage node's batches of group fsyncs made durable by one ``syncfs``
(:class:`waltz.storage.fsync.GroupSync` with ``fs_sync``): a batch of enough files is one job and one
``syncfs``, a smaller one is fdatasynced file by file, each caller is answered only after the sync that
covers its file returned 0, and a failed ``syncfs`` falls back to each file's fdatasync so that only the
failing files' groups fail. The thread runner and the file system handle are fakes the test drives; the
clock is virtual: nothing here sleeps."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import pytest

from waltz.errors import StorageError
from waltz.storage.fsync import FsyncPolicy, GroupSync
from waltz.storage.work import Tally


class _Runner:
    """A :class:`~waltz.storage.fsync.JobRunner` whose jobs wait until :meth:`finish` runs them."""

    def __init__(self) -> None:
        self.jobs: list[tuple[Callable[[], Any], asyncio.Future[Any]]] = []

    def run(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.jobs.append((fn, done))
        return done

    def finish(self) -> None:
        fn, done = self.jobs.pop(0)
        done.set_result(fn())

    def close(self, timeout_s: float = 5.0) -> None:
        pass


class _FsSync:
    """A ``syncfs`` handle: records the call in ``ran``, fails while ``fail`` is above 0 (counting down)."""

    path = "/data"

    def __init__(self, ran: list[str]) -> None:
        self.ran = ran
        self.fail = 0

    def syncfs(self) -> None:
        self.ran.append("syncfs")
        if self.fail > 0:
            self.fail -= 1
            raise StorageError("/data: cannot syncfs: Input/output error (injected)")

    def close(self) -> None:
        pass


class _File:
    """One partition's data file: ``fsync`` and the two halves of a flush around a ``syncfs``, each recorded
    in ``ran``; its fsync fails if ``fail``."""

    def __init__(self, name: str, ran: list[str], *, fail: bool = False) -> None:
        self.name = name
        self.ran = ran
        self.fail = fail
        self.durable = False

    def fsync(self) -> None:
        self.ran.append(f"fsync {self.name}")
        if self.fail:
            raise StorageError(f"{self.name}: cannot fsync: Input/output error (injected)")
        self.durable = True

    def begin(self) -> Callable[[], None]:
        self.ran.append(f"begin {self.name}")

        def synced() -> None:
            self.ran.append(f"synced {self.name}")
            self.durable = True

        return synced


def _group(min_files: int = 4, *, with_fs: bool = True) -> tuple[GroupSync, _Runner, _FsSync, list[str]]:
    ran: list[str] = []
    runner = _Runner()
    policy = FsyncPolicy(clock=lambda: 1000.0, runner=runner)
    fs_sync = _FsSync(ran)
    group = GroupSync(
        policy, Tally(), jobs=4, fs_sync=fs_sync if with_fs else None, syncfs_min_files=min_files
    )
    return group, runner, fs_sync, ran


async def _passes(n: int = 3) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def _files(n: int, ran: list[str], failing: int = -1) -> list[_File]:
    return [_File(f"p{i}", ran, fail=i == failing) for i in range(n)]


def test_a_batch_of_enough_files_is_one_job_and_one_syncfs_answered_after_it() -> None:
    group, runner, _fs, ran = _group(min_files=4)
    files = _files(6, ran)

    async def main() -> None:
        callers = [asyncio.create_task(group.sync(f.fsync, f.begin, f.name)) for f in files]
        await _passes()
        assert len(runner.jobs) == 1  # one hand-off for six files (not 4 jobs)
        assert ran == []
        assert not any(c.done() for c in callers)  # nothing answered before the sync ran
        runner.finish()
        assert await asyncio.gather(*callers) == [True] * 6
        begins = [f"begin p{i}" for i in range(6)]
        assert ran == [*begins, "syncfs", *(f"synced p{i}" for i in range(6))]  # no fdatasync at all
        assert all(f.durable for f in files)
        assert (group.handoffs, group.handed_off, group.syncfs_calls, group.syncfs_failures) == (1, 6, 1, 0)

    asyncio.run(main())


def test_a_batch_below_the_threshold_is_fdatasynced_file_by_file() -> None:
    group, runner, _fs, ran = _group(min_files=4)
    files = _files(3, ran)

    async def main() -> None:
        callers = [asyncio.create_task(group.sync(f.fsync, f.begin, f.name)) for f in files]
        await _passes()
        assert len(runner.jobs) == 3  # split into jobs as without syncfs
        while runner.jobs:
            runner.finish()
        assert await asyncio.gather(*callers) == [True] * 3
        assert sorted(ran) == ["fsync p0", "fsync p1", "fsync p2"]
        assert group.syncfs_calls == 0

    asyncio.run(main())


@pytest.mark.parametrize(("min_files", "with_fs"), [(0, True), (4, False)])
def test_no_syncfs_when_turned_off_or_not_trusted(min_files: int, with_fs: bool) -> None:
    group, runner, _fs, ran = _group(min_files=min_files, with_fs=with_fs)
    files = _files(8, ran)

    async def main() -> None:
        callers = [asyncio.create_task(group.sync(f.fsync, f.begin, f.name)) for f in files]
        await _passes()
        while runner.jobs:
            runner.finish()
        assert await asyncio.gather(*callers) == [True] * 8
        assert "syncfs" not in ran
        assert sorted(ran) == sorted(f"fsync p{i}" for i in range(8))

    asyncio.run(main())


def test_a_file_that_cannot_say_how_to_record_a_syncfs_keeps_its_batch_on_fdatasync() -> None:
    group, runner, _fs, ran = _group(min_files=4)
    files = _files(5, ran)

    async def main() -> None:
        callers = [asyncio.create_task(group.sync(f.fsync, f.begin, f.name)) for f in files[:4]]
        callers.append(asyncio.create_task(group.sync(files[4].fsync)))
        await _passes()
        while runner.jobs:
            runner.finish()
        assert await asyncio.gather(*callers) == [True] * 5
        assert "syncfs" not in ran

    asyncio.run(main())


def test_a_failed_syncfs_falls_back_to_each_file_and_fails_only_the_bad_files_group(
    caplog: pytest.LogCaptureFixture,
) -> None:
    group, runner, fs, ran = _group(min_files=4)
    files = _files(5, ran, failing=2)
    fs.fail = 1

    async def main() -> None:
        with caplog.at_level(logging.WARNING, logger="waltz.storage.fsync"):
            callers = [asyncio.create_task(group.sync(f.fsync, f.begin, f.name)) for f in files]
            await _passes()
            assert len(runner.jobs) == 1
            runner.finish()
            outcomes = await asyncio.gather(*callers, return_exceptions=True)
        assert [o is True for o in outcomes] == [True, True, False, True, True]
        assert isinstance(outcomes[2], StorageError)
        assert "p2: cannot fsync" in str(outcomes[2])
        fdatasyncs = [f"fsync p{i}" for i in range(5)]
        assert ran == [*(f"begin p{i}" for i in range(5)), "syncfs", *fdatasyncs]  # no "synced"
        assert not files[2].durable
        assert all(f.durable for i, f in enumerate(files) if i != 2)
        assert (group.syncfs_calls, group.syncfs_failures) == (1, 1)
        warnings = [r.getMessage() for r in caplog.records if "syncfs of /data failed" in r.getMessage()]
        assert len(warnings) == 1
        assert "fdatasync of each of the 5 files" in warnings[0]

    asyncio.run(main())


async def _batch(group: GroupSync, runner: _Runner, files: list[_File]) -> list[Any]:
    callers = [asyncio.create_task(group.sync(f.fsync, f.begin, f.name)) for f in files]
    await _passes()
    while runner.jobs:
        runner.finish()
    return await asyncio.gather(*callers, return_exceptions=True)


def test_after_a_failed_syncfs_each_file_is_fdatasynced_once_before_a_syncfs_covers_it_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The failed syncfs may have reported the error of a file outside its batch (``q``): a later syncfs
    returns 0 whatever that file lost, only its own fdatasync still reports it."""
    group, runner, fs, ran = _group(min_files=4)
    files = _files(4, ran)
    q = _File("q", ran)

    async def main() -> None:
        assert await _batch(group, runner, [*files[:3], q]) == [True] * 4  # syncfs, all trusted so far
        assert ran.count("syncfs") == 1
        fs.fail = 1
        with caplog.at_level(logging.WARNING, logger="waltz.storage.fsync"):
            assert await _batch(group, runner, files) == [True] * 4  # failed, each file's own fsync
            ran.clear()
            q.fail = True  # q's pages were lost: the failed syncfs reported it, no later one will
            outcomes = await _batch(group, runner, [*files[:3], q])
            assert "syncfs" not in ran  # q was not fdatasynced since the failure: the batch is not trusted
            assert [o is True for o in outcomes] == [True, True, True, False]
            ran.clear()
            q.fail = False
            assert await _batch(group, runner, [*files[:3], q]) == [True] * 4
            assert "syncfs" not in ran  # q's own fdatasync has not succeeded yet
            ran.clear()
            assert await _batch(group, runner, [*files[:3], q]) == [True] * 4
            assert ran.count("syncfs") == 1  # every file verified since the failure
            assert not any(r.startswith("fsync") for r in ran)
            fs.fail = 1
            assert await _batch(group, runner, files) == [True] * 4
        assert (group.syncfs_calls, group.syncfs_failures) == (4, 2)
        warnings = [r for r in caplog.records if "syncfs of /data failed" in r.getMessage()]
        assert len(warnings) == 1  # at most one line per 10 s

    asyncio.run(main())


def test_a_file_closed_before_the_syncfs_is_fdatasynced_and_reports_its_own_error() -> None:
    group, runner, _fs, ran = _group(min_files=4)
    files = _files(4, ran, failing=1)

    def closed() -> Callable[[], None]:
        raise StorageError("p1: segment is closed")

    async def main() -> None:
        callers = [
            asyncio.create_task(group.sync(f.fsync, closed if i == 1 else f.begin, f.name))
            for i, f in enumerate(files)
        ]
        await _passes()
        runner.finish()
        outcomes = await asyncio.gather(*callers, return_exceptions=True)
        assert [o is True for o in outcomes] == [True, False, True, True]
        assert "syncfs" not in ran
        assert group.syncfs_calls == 0

    asyncio.run(main())
