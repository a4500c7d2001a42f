"""Retry policy: capped exponential backoff with jitter, an attempt bound and an expiration time."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RetryPolicy:
    """When to re-execute a failed transaction context, and when to give up.

    * ``delay(n)`` before the ``n``-th retry (``n`` >= 1) is drawn uniformly from ``[d/2, d]`` where
      ``d = min(max_backoff_ms, initial_backoff_ms * 2**(n-1))`` ("equal jitter": never zero unless the
      bound is zero, and spread out so that many clients that failed together do not retry together).
    * ``max_attempts`` bounds the number of executions (0: unlimited).
    * ``timeout_ms`` bounds the age of a context (0: never expires).
    """

    initial_backoff_ms: float = 10.0
    max_backoff_ms: float = 1000.0
    max_attempts: int = 0
    timeout_ms: float = 0.0
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.initial_backoff_ms < 0 or self.max_backoff_ms < self.initial_backoff_ms:
            raise ValueError(
                f"need 0 <= initial_backoff_ms <= max_backoff_ms, got {self.initial_backoff_ms}, "
                f"{self.max_backoff_ms}"
            )
        if self.max_attempts < 0 or self.timeout_ms < 0:
            raise ValueError("max_attempts and timeout_ms must not be negative")

    def delay_s(self, retry: int) -> float:
        """Seconds to wait before retry number ``retry`` (1 for the first retry)."""
        if retry < 1:
            return 0.0
        # Cap the exponent: 2**64 ms is already far past any sane max_backoff_ms.
        bound_ms = min(self.max_backoff_ms, self.initial_backoff_ms * 2.0 ** min(retry - 1, 64))
        return self.rng.uniform(bound_ms / 2, bound_ms) / 1000.0

    def attempts_exhausted(self, attempts: int) -> bool:
        """True if ``attempts`` executions used up the bound."""
        return self.max_attempts > 0 and attempts >= self.max_attempts

    def expired(self, created_at_s: float, now_s: float) -> bool:
        """True if a context created at ``created_at_s`` is past its timeout at ``now_s`` (same clock)."""
        return self.timeout_ms > 0 and (now_s - created_at_s) * 1000.0 >= self.timeout_ms


FETCH_RETRY = RetryPolicy(initial_backoff_ms=10.0, max_backoff_ms=5000.0)
"""Backoff of transaction-data fetches and high-water-mark reads after a retriable error."""

APPLY_RETRY = RetryPolicy(initial_backoff_ms=10.0, max_backoff_ms=1000.0)
"""Backoff before delivering a transaction again after ``apply_transaction`` raised."""

MAX_CHECKSUM_ATTEMPTS = 5
"""Fetches of one transaction's data whose checksum does not match before ``DataChecksumError``."""
