"""The client's Prometheus metrics (``metrics_registry=``): off by default, in the application's registry
when given, every series there from the start, and each counter bumped by the event it names."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from waltz import AsyncWaltzClient
from waltz.errors import ClientError
from waltz.testing import MockDriver

from .helpers import Ctx, recording_callbacks
from .test_async_client import FAST, client_with, run, wait_until
from .test_poisoned_transaction import POISON_HEADER, poisoned_callbacks


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the registry's exposition, by name and sorted labels."""
    found: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            found[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return found


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return samples(registry)[(name, tuple(sorted(labels.items())))]


def test_without_a_registry_the_client_keeps_no_metrics() -> None:
    async def main() -> None:
        client, _ = client_with(MockDriver())
        async with client:
            await client.submit(Ctx(b"a"))
            await client.flush_transactions(timeout=5)
            assert client._metrics is None

    run(main())


def test_every_series_is_there_from_the_start_and_counts_what_happens() -> None:
    registry = CollectorRegistry()
    driver = MockDriver(num_partitions=2)
    callbacks = recording_callbacks()

    async def main() -> None:
        client = AsyncWaltzClient(callbacks, FAST, driver=driver, metrics_registry=registry)
        async with client:
            await wait_until(lambda: value(registry, "waltz_client_mounts_total", partition="1") == 1)
            # Before any append: every counter of both partitions, at 0.
            for p in ("0", "1"):
                assert value(registry, "waltz_client_retries_total", partition=p, reason="lock") == 0
                assert value(registry, "waltz_client_retries_total", partition=p, reason="lost") == 0
                assert value(registry, "waltz_client_failed_contexts_total", partition=p) == 0
                assert value(registry, "waltz_client_apply_failures_total", partition=p) == 0
                assert value(registry, "waltz_client_submit_seconds_count", partition=p) == 0
                assert value(registry, "waltz_client_mount_state", partition=p, state="ready") == 1
                assert value(registry, "waltz_client_mount_state", partition=p, state="not_ready") == 0
            for i in range(5):
                await client.submit(Ctx(b"t%d" % i))
            driver.force_next_append_fail()
            await client.submit(Ctx(b"lost once"))
            driver.force_next_lock_fail()
            await client.submit(Ctx(b"lock once"))
            await client.flush_transactions(timeout=5)
            assert value(registry, "waltz_client_submit_seconds_count", partition="0") == 7
            assert value(registry, "waltz_client_submit_seconds_bucket", partition="0", le="+Inf") == 7
            assert value(registry, "waltz_client_submit_seconds_count", partition="1") == 0
            assert value(registry, "waltz_client_retries_total", partition="0", reason="lost") == 1
            assert value(registry, "waltz_client_retries_total", partition="0", reason="lock") == 1
            assert value(registry, "waltz_client_applied_high_water_mark", partition="0") == 6
            assert value(registry, "waltz_client_feed_high_water_mark", partition="0") == 6
            assert value(registry, "waltz_client_apply_lag", partition="0") == 0
            assert value(registry, "waltz_client_partition_stuck", partition="0") == 0
        # Closed: the client's series leave the registry.
        assert not any(name.startswith("waltz_client_") for name, _ in samples(registry))

    run(main())


def test_a_stuck_partition_shows_its_failures_and_lag() -> None:
    registry = CollectorRegistry()
    driver = MockDriver()
    callbacks = poisoned_callbacks("threads")

    async def main() -> None:
        client = AsyncWaltzClient(callbacks, FAST, driver=driver, metrics_registry=registry)
        async with client:
            await client.submit(Ctx(b"poison", header=POISON_HEADER))
            await client.submit(Ctx(b"behind it"))
            await wait_until(lambda: len(callbacks.errors) >= 3)
            assert value(registry, "waltz_client_partition_stuck", partition="0") == 1
            assert value(registry, "waltz_client_apply_failures_total", partition="0") >= 3
            assert value(registry, "waltz_client_applied_high_water_mark", partition="0") == -1
            await wait_until(lambda: value(registry, "waltz_client_feed_high_water_mark", partition="0") == 1)
            assert value(registry, "waltz_client_apply_lag", partition="0") == 2

    run(main())


def test_a_context_that_fails_is_counted() -> None:
    registry = CollectorRegistry()

    async def main() -> None:
        client = AsyncWaltzClient(recording_callbacks(), FAST, driver=MockDriver(), metrics_registry=registry)
        async with client:
            with pytest.raises(ValueError, match="bad"):
                await client.submit(Ctx(b"x", raise_in_execute=ValueError("bad")))
            assert value(registry, "waltz_client_failed_contexts_total", partition="0") == 1

    run(main())


def test_one_client_per_registry() -> None:
    registry = CollectorRegistry()

    async def main() -> None:
        first = AsyncWaltzClient(recording_callbacks(), FAST, driver=MockDriver(), metrics_registry=registry)
        second = AsyncWaltzClient(recording_callbacks(), FAST, driver=MockDriver(), metrics_registry=registry)
        async with first:
            with pytest.raises(ClientError, match="one client per registry"):
                await second.start()
            await second.close()
        # The first one's close freed the names: a new client may use the registry.
        async with AsyncWaltzClient(
            recording_callbacks(), FAST, driver=MockDriver(), metrics_registry=registry
        ):
            assert value(registry, "waltz_client_mount_state", partition="0", state="mounting") in (0, 1)

    run(main())
