"""The transaction monitor: resolutions from feed, lock failures, flushes and nudges (no I/O, no clock)."""

from __future__ import annotations

import random

import pytest

from waltz.client.monitor import Outcome, Resolution, TransactionMonitor
from waltz.protocol.records import ReqId


def rid(seq: int, client: int = 7) -> ReqId:
    return ReqId.of(client, 0, 0, seq)


def monitor_with(*seqs: int, hwm: int = -1) -> TransactionMonitor:
    m = TransactionMonitor(hwm)
    for s in seqs:
        m.register(rid(s), s, now=float(s))
    return m


def test_own_request_in_feed_commits_it_and_fails_every_older_one() -> None:
    m = monitor_with(1, 2, 3, 4)
    assert m.on_feed(0, rid(3)) == [
        Resolution(rid(1), Outcome.FAILED),
        Resolution(rid(2), Outcome.FAILED),
        Resolution(rid(3), Outcome.COMMITTED, 0),
    ]
    assert m.pending_count == 1
    assert m.is_pending(rid(4))
    assert m.feed_high_water_mark == 0


def test_feed_of_other_clients_resolves_nothing() -> None:
    m = monitor_with(1)
    assert m.on_feed(0, rid(1, client=8)) == []
    assert m.pending_count == 1


def test_registration_must_follow_send_order() -> None:
    m = monitor_with(5)
    with pytest.raises(ValueError, match="seq 4"):
        m.register(rid(4), 4, 0.0)
    with pytest.raises(ValueError, match="twice"):
        m.register(rid(5), 6, 0.0)


def test_lock_failure_waits_until_the_conflicting_transaction_is_applied() -> None:
    m = monitor_with(1, 2, hwm=3)
    assert m.on_lock_failure(rid(1), 5) == []  # Held: the application has only applied up to 3.
    assert m.pending_count == 1
    assert m.unresolved_count == 2
    assert m.on_applied(4) == []
    assert m.on_applied(5) == [Resolution(rid(1), Outcome.LOCK_FAILED, 5)]
    assert m.unresolved_count == 1


def test_lock_failure_already_covered_resolves_at_once() -> None:
    m = monitor_with(1, hwm=9)
    assert m.on_lock_failure(rid(1), 9) == [Resolution(rid(1), Outcome.LOCK_FAILED, 9)]
    assert m.on_lock_failure(rid(1), 9) == []  # Duplicate or stale: ignored.


def test_flush_response_fails_what_the_feed_did_not_commit_once_the_feed_caught_up() -> None:
    m = monitor_with(1, 2, 3)
    flushed = m.flush_request(now=10.0)
    assert flushed == rid(3)
    m.register(rid(4), 4, 11.0)  # Sent after the flush: not covered by it.
    assert m.on_flush_response(rid(3), 1) == []  # The feed has not delivered ids 0 and 1 yet.
    assert m.on_feed(0, rid(9, client=8)) == []
    assert m.on_feed(1, rid(2)) == [
        Resolution(rid(1), Outcome.FAILED),
        Resolution(rid(2), Outcome.COMMITTED, 1),
        Resolution(rid(3), Outcome.FAILED),
    ]
    assert m.pending_count == 1
    assert m.is_pending(rid(4))


def test_flush_response_with_feed_already_there_resolves_at_once() -> None:
    m = monitor_with(1, 2, hwm=4)
    req = m.flush_request(now=0.0)
    assert req is not None
    assert m.on_flush_response(req, 4) == [
        Resolution(rid(1), Outcome.FAILED),
        Resolution(rid(2), Outcome.FAILED),
    ]
    assert m.on_flush_response(req, 4) == []  # Answered twice: ignored.


def test_flush_covers_appends_whose_own_entry_was_lock_failed_meanwhile() -> None:
    m = monitor_with(1, 2, hwm=0)
    req = m.flush_request(now=0.0)
    assert req == rid(2)
    assert m.on_lock_failure(rid(2), 0) == [Resolution(rid(2), Outcome.LOCK_FAILED, 0)]
    assert m.on_flush_response(rid(2), 0) == [Resolution(rid(1), Outcome.FAILED)]


def test_nothing_to_flush_when_idle() -> None:
    m = monitor_with()
    assert m.flush_request(now=0.0) is None
    assert m.nudge(now=100.0, threshold=1.0) is None


def test_nudge_only_after_the_threshold_and_not_again_right_away() -> None:
    m = monitor_with(1, 2)  # Last registered at t=2.
    assert m.nudge(now=2.5, threshold=1.0) is None
    assert m.nudge(now=3.0, threshold=1.0) == rid(2)
    assert m.nudge(now=3.5, threshold=1.0) is None  # A flush is already on its way.
    assert m.nudge(now=4.0, threshold=1.0) == rid(2)  # It may have been lost: ask again.


def test_flush_records_stay_bounded() -> None:
    m = monitor_with(1)
    for i in range(100):
        m.flush_request(now=float(i))
    assert len(m._flushes_sent) <= 16


def test_fail_removes_a_pending_append() -> None:
    m = monitor_with(1, 2)
    assert m.fail(rid(1)) == [Resolution(rid(1), Outcome.FAILED)]
    assert m.fail(rid(1)) == []
    assert m.on_feed(0, rid(2)) == [Resolution(rid(2), Outcome.COMMITTED, 0)]


def test_a_run_of_feed_entries_commits_each_and_fails_older_ones_in_one_pass() -> None:
    m = monitor_with(1, 2, 3, 4, 5)
    entries = [(0, rid(2), 0), (1, rid(9, client=8), 0), (2, rid(3), 0), (3, rid(5), 0)]
    assert m.on_feed_run(entries) == [
        Resolution(rid(1), Outcome.FAILED),
        Resolution(rid(2), Outcome.COMMITTED, 0),
        Resolution(rid(3), Outcome.COMMITTED, 2),
        Resolution(rid(4), Outcome.FAILED),
        Resolution(rid(5), Outcome.COMMITTED, 3),
    ]
    assert m.pending_count == 0
    assert m.feed_high_water_mark == 3
    assert m.on_feed_run([]) == []


@pytest.mark.parametrize("seed", range(40))
def test_a_run_of_feed_entries_resolves_as_the_entries_one_by_one(seed: int) -> None:
    """on_feed_run is on_feed of each entry: the same resolutions, in the same order, the same state after,
    whatever is lost, foreign or covered by a flush (which the run hands to on_feed entry by entry)."""
    rng = random.Random(seed)
    one, run = monitor_with(*range(1, 21)), monitor_with(*range(1, 21))
    if rng.random() < 0.5:
        flush_hwm = rng.randrange(0, 12)
        for m in (one, run):
            flushed = m.flush_request(now=30.0)
            assert flushed is not None
            assert m.on_flush_response(flushed, flush_hwm) == []
    entries: list[tuple[int, ReqId, int]] = []
    seqs = sorted(rng.sample(range(1, 21), 12))
    for tid, seq in enumerate(seqs):
        entries.append((tid, rid(seq) if rng.random() < 0.8 else rid(seq, client=8), 0))
    expected = [r for tid, req_id, _ in entries for r in one.on_feed(tid, req_id)]
    assert run.on_feed_run(entries) == expected
    assert run.pending_count == one.pending_count
    assert run.feed_high_water_mark == one.feed_high_water_mark
    assert run.flush_request(now=40.0) == one.flush_request(now=40.0)
