"""RetryPolicy: capped, jittered backoff; attempt bound; expiration."""

from __future__ import annotations

import random

import pytest

from waltz.client.retry import RetryPolicy


def test_backoff_doubles_up_to_the_bound_with_jitter_in_the_upper_half() -> None:
    policy = RetryPolicy(initial_backoff_ms=10, max_backoff_ms=100, rng=random.Random(1))
    for retry, bound_ms in [(1, 10), (2, 20), (3, 40), (4, 80), (5, 100), (50, 100), (10_000, 100)]:
        for _ in range(20):
            delay_ms = policy.delay_s(retry) * 1000
            assert bound_ms / 2 <= delay_ms <= bound_ms


def test_no_delay_before_the_first_attempt_and_zero_backoff_allowed() -> None:
    assert RetryPolicy().delay_s(0) == 0
    assert RetryPolicy(initial_backoff_ms=0, max_backoff_ms=0).delay_s(5) == 0


def test_attempt_bound_and_expiration() -> None:
    unbounded = RetryPolicy()
    assert not unbounded.attempts_exhausted(10**9)
    assert not unbounded.expired(0.0, 10**9)
    bounded = RetryPolicy(max_attempts=3, timeout_ms=500)
    assert not bounded.attempts_exhausted(2)
    assert bounded.attempts_exhausted(3)
    assert not bounded.expired(100.0, 100.4)
    assert bounded.expired(100.0, 100.5)


def test_invalid_policies_are_rejected() -> None:
    with pytest.raises(ValueError, match="initial_backoff_ms"):
        RetryPolicy(initial_backoff_ms=100, max_backoff_ms=10)
    with pytest.raises(ValueError, match="negative"):
        RetryPolicy(max_attempts=-1)
