"""A client whose appends wait while ZooKeeper does not answer says so: one log line per outage, and the
timeouts of submit name ZooKeeper instead of client.maxConcurrentTransactions (docs/client.md, "Faults")."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import pytest

from waltz import AsyncWaltzClient
from waltz.client.driver import CoordinationTrouble
from waltz.errors import ClientTimeoutError
from waltz.testing import MockDriver

from .helpers import FAST, Ctx, recording_callbacks


class NoZooKeeper(MockDriver):
    """Partitions never mount, and ZooKeeper has not answered since ``since_s`` (None: it answers)."""

    def __init__(self) -> None:
        super().__init__()
        self.since_s: float | None = time.monotonic()

    async def mount(self, partition_id: int, client_high_water_mark: int) -> None:
        return None

    def coordination_trouble(self) -> CoordinationTrouble | None:
        if self.since_s is None:
            return None
        return CoordinationTrouble(self.since_s, "ZooKeeper (zk:2181) has not answered this client for 3.0 s")


def run_submits(
    driver: MockDriver, count: int, before: Callable[[int], None] = lambda _: None, **config: object
) -> list[str]:
    """``count`` submits that time out, ``before(i)`` called before submit ``i``; their errors."""

    async def main() -> list[str]:
        client = AsyncWaltzClient(recording_callbacks("threads"), FAST.replace(**config), driver=driver)
        errors = []
        async with client:
            for i in range(count):
                before(i)
                with pytest.raises(ClientTimeoutError) as info:
                    await client.submit(Ctx(f"x{i}".encode()))
                errors.append(str(info.value))
        return errors

    return asyncio.run(asyncio.wait_for(main(), 30))


def test_a_mount_timeout_while_zookeeper_is_away_names_it(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="waltz.client.core")
    errors = run_submits(NoZooKeeper(), 3, mount_timeout_ms=50)
    assert all("not mounted within 50 ms (client.mountTimeout): waiting on ZooKeeper" in e for e in errors)
    assert all("ZooKeeper (zk:2181) has not answered this client" in e for e in errors)
    said = [r.getMessage() for r in caplog.records if "waiting on ZooKeeper" in r.getMessage()]
    # Three waits in one outage: said once.
    assert said == ["appends to partition 0 are waiting on ZooKeeper: ZooKeeper (zk:2181) has not answered "
                    "this client for 3.0 s"]  # fmt: skip


def test_each_outage_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="waltz.client.core")
    driver = NoZooKeeper()

    def new_outage_at_2(i: int) -> None:
        if i == 2:
            driver.since_s = time.monotonic() + 1

    run_submits(driver, 4, new_outage_at_2, mount_timeout_ms=50)
    assert sum("waiting on ZooKeeper" in r.getMessage() for r in caplog.records) == 2


def test_without_trouble_the_mount_timeout_says_what_it_did() -> None:
    driver = NoZooKeeper()
    driver.since_s = None
    (error,) = run_submits(driver, 1, mount_timeout_ms=50)
    assert "ZooKeeper" not in error
    assert error == "partition 0 was not mounted within 50 ms (client.mountTimeout)"
