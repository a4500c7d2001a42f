"""RetryLog: a retry loop of the store layer logs at most one line per 10 s (virtual time), and says how
many it left out."""

from __future__ import annotations

import asyncio
import logging

import pytest

from waltz.server.store.support import RETRY_LOG_INTERVAL_S, RetryLog
from waltz.testing import run_virtual

logger = logging.getLogger("test.retry_log")


def test_a_loop_retrying_every_100_ms_logs_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    async def loop() -> None:
        retry_log = RetryLog(logger)
        for attempt in range(600):  # 60 s of refusals, one every 100 ms
            retry_log.log(logging.WARNING, "refused (attempt %d)", attempt)
            await asyncio.sleep(0.1)

    with caplog.at_level(logging.WARNING, logger="test.retry_log"):
        run_virtual(loop())
    lines = [r.getMessage() for r in caplog.records]
    assert RETRY_LOG_INTERVAL_S == 10.0
    assert len(lines) == 6
    assert lines[0] == "refused (attempt 0)"
    for line in lines[1:]:
        assert "more line(s) of this retry loop in the last 10 s not logged" in line, line
