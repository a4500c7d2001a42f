"""A poisoned transaction (``apply_transaction`` always raises on it): redelivered with backoff, the traceback
logged once, ``submit`` says what is stuck, and ``uncaught_exception`` may skip it."""

from __future__ import annotations

import logging

import pytest

from waltz import Transaction
from waltz.client.api import ApplyAction
from waltz.errors import PartitionStuckError
from waltz.testing import MockDriver

from .helpers import Ctx, RecordingCallbacks, recording_callbacks
from .test_async_client import client_with, run, wait_until

POISON_HEADER = 66
"""Transactions with this header cannot be applied (as a payload the application cannot decode)."""


def poisoned_callbacks(mode: str, skip_after: int | None = None) -> RecordingCallbacks:
    base = type(recording_callbacks(mode))

    class Poisoned(base):  # type: ignore[valid-type, misc]
        def __init__(self) -> None:
            super().__init__()
            self.skipped: list[int] = []

        def _deliver(self, transaction: Transaction) -> None:
            super()._deliver(transaction)
            if transaction.header == POISON_HEADER:
                raise ValueError("cannot decode this payload")

        def uncaught_exception(
            self, partition_id: int, transaction_id: int, exception: BaseException
        ) -> ApplyAction | None:
            super().uncaught_exception(partition_id, transaction_id, exception)
            failures = sum(1 for _, t, _ in self.errors if t == transaction_id)
            if skip_after is not None and failures >= skip_after:
                self.skipped.append(transaction_id)
                with self.lock:
                    self.hwm[partition_id] = transaction_id  # The application records the skip itself.
                return ApplyAction.SKIP
            return None

    callbacks: RecordingCallbacks = Poisoned()
    return callbacks


@pytest.mark.parametrize("mode", ["threads", "inline"])
def test_a_poisoned_transaction_is_logged_once_and_submit_names_it(
    mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    driver = MockDriver()
    callbacks = poisoned_callbacks(mode)

    async def main() -> None:
        client, _ = client_with(driver, callbacks, callback_mode=mode)
        async with client:
            await client.submit(Ctx(b"ok"))
            await client.submit(Ctx(b"poison", header=POISON_HEADER))
            await wait_until(lambda: len(callbacks.errors) >= 4)
            with pytest.raises(PartitionStuckError, match=r"stuck applying transaction 1: .*cannot decode"):
                await client.submit(Ctx(b"after"))
            assert callbacks.hwm[0] == 0  # Transaction 1 was never applied, so nothing after it either.

    with caplog.at_level(logging.INFO, logger="waltz.client.core"):
        run(main())
    tracebacks = [r for r in caplog.records if r.exc_info is not None and "transaction 1" in r.getMessage()]
    assert len(tracebacks) == 1  # The traceback once, not once per delivery.


@pytest.mark.parametrize("mode", ["threads", "inline"])
def test_uncaught_exception_may_skip_the_poisoned_transaction(mode: str) -> None:
    driver = MockDriver()
    callbacks = poisoned_callbacks(mode, skip_after=3)

    async def main() -> None:
        client, _ = client_with(driver, callbacks, callback_mode=mode)
        async with client:
            poison = Ctx(b"poison", header=POISON_HEADER)
            await client.submit(poison)
            await client.flush_transactions(timeout=5)
            assert callbacks.skipped == [0]
            assert poison.events == ["completion:True", "application"]
            after = Ctx(b"after")
            await client.submit(after)  # The partition moves on.
            await client.flush_transactions(timeout=5)
            assert after.events == ["completion:True", "application"]
            assert callbacks.data(0) == [b"after"]
            assert callbacks.hwm[0] == 1

    run(main())
