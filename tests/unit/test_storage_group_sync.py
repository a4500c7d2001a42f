"""A storage node's group fsyncs across partitions (:class:`waltz.storage.fsync.GroupSync`): the fsyncs asked
for together go to a thread in one hand-off, each caller hears its own file's outcome, the next batch waits
for the last one, and a lone fsync runs on the loop. The thread runner is a fake the test drives (jobs run
when the test says, on the loop's thread) and the policy's clock is virtual: nothing here sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from waltz.errors import StorageError
from waltz.storage.fsync import INLINE_FSYNC_LIMIT_S, FsyncPolicy, GroupSync
from waltz.storage.work import Tally


class _Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


class _Runner:
    """A :class:`~waltz.storage.fsync.JobRunner` whose jobs wait until :meth:`finish` runs them."""

    def __init__(self) -> None:
        self.jobs: list[tuple[Callable[[], Any], asyncio.Future[Any]]] = []
        self.handed = 0

    def run(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.jobs.append((fn, done))
        self.handed += 1
        return done

    def finish(self, index: int = 0, error: BaseException | None = None) -> None:
        """Run job ``index`` (or fail it whole with ``error``, as a thread that died would)."""
        fn, done = self.jobs.pop(index)
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(fn())

    def close(self, timeout_s: float = 5.0) -> None:
        pass


class _File:
    """One partition's data file: its fsync records the order, optionally fails, optionally takes ``delay_s``
    of the clock's time."""

    def __init__(self, name: str, ran: list[str], clock: _Clock, *, fail: bool = False) -> None:
        self.name = name
        self.ran = ran
        self.clock = clock
        self.fail = fail
        self.delay_s = 0.0

    def fsync(self) -> None:
        self.ran.append(self.name)
        self.clock.now_s += self.delay_s
        if self.fail:
            raise StorageError(f"{self.name}: cannot fsync: Input/output error (injected)")


def _group(**kwargs: int) -> tuple[GroupSync, _Runner, Tally, _Clock, FsyncPolicy]:
    clock = _Clock()
    runner = _Runner()
    policy = FsyncPolicy(clock=clock, runner=runner)
    queued = Tally()
    return GroupSync(policy, queued, **kwargs), runner, queued, clock, policy


async def _passes(n: int = 3) -> None:
    """Let the loop run ``n`` passes (callbacks scheduled with call_soon, and the tasks they wake)."""
    for _ in range(n):
        await asyncio.sleep(0)


def test_fsyncs_asked_for_in_one_pass_go_to_a_thread_in_one_hand_off_and_run_in_turn() -> None:
    group, runner, _queued, clock, policy = _group(jobs=1)
    ran: list[str] = []
    files = [_File(f"p{i}", ran, clock) for i in range(3)]

    async def main() -> None:
        callers = [asyncio.create_task(group.sync(f.fsync)) for f in files]
        await _passes()
        assert len(runner.jobs) == 1  # one job for the three files
        assert ran == []  # nothing ran on the loop
        assert not policy.inline_allowed()  # a batch is in flight
        runner.finish()
        assert await asyncio.gather(*callers) == [True, True, True]  # each ran in the thread
        assert ran == ["p0", "p1", "p2"]  # in turn, in the order asked for
        assert (group.handoffs, group.handed_off) == (1, 3)
        assert not group.pending
        assert policy.inline_allowed()

    asyncio.run(main())


def test_a_failed_fsync_fails_the_group_of_its_file_only() -> None:
    group, runner, _queued, clock, _policy = _group(jobs=1)
    ran: list[str] = []
    files = [_File("p0", ran, clock), _File("p1", ran, clock, fail=True), _File("p2", ran, clock)]

    async def main() -> None:
        callers = [asyncio.create_task(group.sync(f.fsync)) for f in files]
        await _passes()
        runner.finish()
        outcomes = await asyncio.gather(*callers, return_exceptions=True)
        assert outcomes[0] is True
        assert isinstance(outcomes[1], StorageError)
        assert "p1: cannot fsync" in str(outcomes[1])
        assert outcomes[2] is True
        assert ran == ["p0", "p1", "p2"]  # the files after the failed one were still fsynced

    asyncio.run(main())


def test_a_job_that_fails_whole_fails_every_group_in_it() -> None:
    """Not one file's error (the thread itself died, say): no group of the job is known durable."""
    group, runner, _queued, clock, _policy = _group(jobs=1)
    ran: list[str] = []
    files = [_File(f"p{i}", ran, clock) for i in range(2)]

    async def main() -> None:
        callers = [asyncio.create_task(group.sync(f.fsync)) for f in files]
        await _passes()
        runner.finish(error=SystemError("injected"))
        outcomes = await asyncio.gather(*callers, return_exceptions=True)
        assert [type(o) for o in outcomes] == [SystemError, SystemError]

    asyncio.run(main())


def test_fsyncs_asked_for_while_a_batch_runs_wait_for_it_and_then_go_together() -> None:
    group, runner, _queued, clock, _policy = _group(jobs=1)
    ran: list[str] = []

    async def main() -> None:
        first = [asyncio.create_task(group.sync(_File(f"a{i}", ran, clock).fsync)) for i in range(2)]
        await _passes()
        assert len(runner.jobs) == 1
        later = []
        for i in range(3):  # arriving over several passes while the first batch runs
            later.append(asyncio.create_task(group.sync(_File(f"b{i}", ran, clock).fsync)))
            await _passes()
        assert len(runner.jobs) == 1  # they wait: none of them is handed off yet
        runner.finish()
        assert await asyncio.gather(*first) == [True, True]
        await _passes()
        assert len(runner.jobs) == 1  # the three went in one job
        runner.finish()
        assert await asyncio.gather(*later) == [True, True, True]
        assert ran == ["a0", "a1", "b0", "b1", "b2"]
        assert (group.handoffs, group.handed_off) == (2, 5)

    asyncio.run(main())


def test_a_lone_fsync_runs_on_the_loop_without_a_hand_off_unless_requests_are_queued() -> None:
    group, runner, queued, clock, policy = _group()
    ran: list[str] = []

    async def main() -> None:
        assert not group.pending
        assert policy.inline_allowed()
        policy.run_inline(_File("now", ran, clock).fsync)  # the caller's fast path: no loop pass at all
        assert await group.sync(_File("lone", ran, clock).fsync) is False  # alone in its pass: on the loop
        assert runner.handed == 0
        queued.items = 1  # another partition has work queued: its fsync is coming, so this one waits for it
        caller = asyncio.create_task(group.sync(_File("busy", ran, clock).fsync))
        await _passes()
        assert runner.handed == 1
        runner.finish()
        assert await caller is True
        assert ran == ["now", "lone", "busy"]

    asyncio.run(main())


def test_a_slow_fsync_on_the_loop_sends_the_next_lone_one_to_a_thread() -> None:
    group, runner, _queued, clock, policy = _group()
    ran: list[str] = []
    slow = _File("slow", ran, clock)
    slow.delay_s = 2 * INLINE_FSYNC_LIMIT_S

    async def main() -> None:
        assert await group.sync(slow.fsync) is False
        assert not policy.inline_allowed()
        caller = asyncio.create_task(group.sync(_File("next", ran, clock).fsync))
        await _passes()
        assert runner.handed == 1
        runner.finish()
        assert await caller is True

    asyncio.run(main())


@pytest.mark.parametrize(("fsyncs", "jobs"), [(2, 2), (4, 4), (7, 4), (80, 4)])
def test_a_batch_is_split_into_at_most_four_jobs(fsyncs: int, jobs: int) -> None:
    """They run at once in as many threads (the disk overlaps fsyncs of different files); the next batch
    waits for the last of them."""
    group, runner, _queued, clock, _policy = _group()
    ran: list[str] = []

    async def main() -> None:
        callers = [asyncio.create_task(group.sync(_File(f"p{i}", ran, clock).fsync)) for i in range(fsyncs)]
        await _passes()
        assert len(runner.jobs) == jobs
        later = asyncio.create_task(group.sync(_File("later", ran, clock).fsync))
        while len(runner.jobs) > 1:
            runner.finish(len(runner.jobs) - 1)
            await _passes()
            assert len(runner.jobs) >= 1  # "later" waits for the batch's last job
        runner.finish()
        assert all(await asyncio.gather(*callers))
        assert await later is False  # alone after the batch, nothing queued: on the loop
        assert ran[-1] == "later"
        assert sorted(ran[:-1]) == sorted(f"p{i}" for i in range(fsyncs))
        assert group.handoffs == jobs

    asyncio.run(main())


def test_the_fsync_of_a_caller_cancelled_before_its_hand_off_is_not_run() -> None:
    """A worker cancelled while it waited (the node is closing): its file may be closed next."""
    group, runner, _queued, clock, _policy = _group(jobs=1)
    ran: list[str] = []

    async def main() -> None:
        first = asyncio.create_task(group.sync(_File("a", ran, clock).fsync))
        second = asyncio.create_task(group.sync(_File("b", ran, clock).fsync))
        await _passes()
        waiting = [asyncio.create_task(group.sync(_File(n, ran, clock).fsync)) for n in ("c", "d")]
        await _passes()
        waiting[0].cancel()
        runner.finish()
        assert await asyncio.gather(first, second) == [True, True]
        await _passes()
        assert len(runner.jobs) == 0  # "d" alone now: on the loop
        assert await waiting[1] is False
        assert ran == ["a", "b", "d"]

    asyncio.run(main())
