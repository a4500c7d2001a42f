"""Every labelled counter of servers and storage nodes exists from the start, at 0, for each known label value
(so Prometheus sees the first increase), and a server's store counters only grow across a partition's
incarnations; the ZooKeeper session metrics count state changes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from waltz.cluster.zk import _StateLog, session_state
from waltz.cluster.zk_metrics import ZooKeeperCollector
from waltz.server.metrics import ServerMetrics, StoreCollector
from waltz.server.store.store_partition import StoreStatistics
from waltz.server.store.store_session import EndReason
from waltz.server.store.support import RepairStatistics
from waltz.storage.metrics import FAILURE_NAMES, Metrics


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            found[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return found


def test_a_new_server_has_every_counter_of_every_partition_at_zero() -> None:
    registry = CollectorRegistry()
    ServerMetrics(registry, num_partitions=3)
    registry.register(StoreCollector(dict, num_partitions=3))
    found = samples(registry)
    for p in ("0", "1", "2"):
        for name in (
            "waltz_server_generation_changes_total",
            "waltz_server_lock_failures_total",
            "waltz_server_failed_appends_total",
            "waltz_server_read_bytes_total",
            "waltz_server_appends_total",
            "waltz_server_store_sessions_opened_total",
            "waltz_server_scrub_repairs_failed_total",
        ):
            assert found[(name, (("partition", p),))] == 0, (name, p)
        for reason in EndReason:
            key = ("waltz_server_store_sessions_ended_total", (("partition", p), ("reason", reason.value)))
            assert found[key] == 0


def _partition(opened: int, ended: dict[str, int], repairs_failed: int = 0) -> Any:
    stats = StoreStatistics(sessions_opened=opened, sessions_ended=dict(ended), recovery_seconds_sum=0.5)
    store = SimpleNamespace(
        stats=stats,
        repairs=RepairStatistics(failed=repairs_failed),
        high_water_mark=10,
        replica_positions=lambda: {"a": ("participant", 10)},
    )
    return SimpleNamespace(store=store)


def test_store_counters_add_up_over_a_partitions_incarnations() -> None:
    registry = CollectorRegistry()
    owned: dict[int, Any] = {0: _partition(1, {"replica failed": 2})}
    registry.register(StoreCollector(lambda: owned, num_partitions=1))

    def ended() -> float:
        return samples(registry)[
            ("waltz_server_store_sessions_ended_total", (("partition", "0"), ("reason", "replica failed")))
        ]

    def opened() -> float:
        return samples(registry)[("waltz_server_store_sessions_opened_total", (("partition", "0"),))]

    assert (ended(), opened()) == (2, 1)
    owned[0].store.stats.sessions_ended["replica failed"] = 3  # the same incarnation counts on
    owned[0] = _partition(1, {"replica failed": 1}, repairs_failed=1)  # reopened at a new generation
    assert (ended(), opened()) == (4, 2)
    del owned[0]  # moved away: its counts stay
    assert (ended(), opened()) == (4, 2)
    assert samples(registry)[("waltz_server_scrub_repairs_failed_total", (("partition", "0"),))] == 1
    owned[0] = _partition(1, {})  # and back
    assert (ended(), opened()) == (4, 3)


def test_a_new_storage_node_has_every_counter_at_zero() -> None:
    registry = CollectorRegistry()
    Metrics(registry, num_partitions=2)
    found = samples(registry)
    for name in FAILURE_NAMES:
        assert found[("waltz_storage_failures_total", (("error", name),))] == 0
    for port in ("data", "admin"):
        assert found[("waltz_storage_refused_peers_total", (("port", port),))] == 0
    for p in ("0", "1"):
        for name in (
            "waltz_storage_corrupt_records_total",
            "waltz_storage_repaired_records_total",
            "waltz_storage_refused_session_ids_total",
            "waltz_storage_read_bytes_total",
        ):
            assert found[(name, (("partition", p),))] == 0, (name, p)


def test_zookeeper_metrics_count_suspensions_and_expiries() -> None:
    listener = _StateLog("zk:2181")
    client = SimpleNamespace(state_listeners=[listener])
    registry = CollectorRegistry()
    registry.register(ZooKeeperCollector(lambda: client))

    def now() -> tuple[float, float, float]:
        found = samples(registry)
        return (
            found[("waltz_zookeeper_connected", ())],
            found[("waltz_zookeeper_suspensions_total", ())],
            found[("waltz_zookeeper_sessions_expired_total", ())],
        )

    assert now() == (0, 0, 0)  # not started yet
    for state, expected in (
        ("CONNECTED", (1, 0, 0)),
        ("SUSPENDED", (0, 1, 0)),
        ("CONNECTED", (1, 1, 0)),
        ("SUSPENDED", (0, 2, 0)),
        ("LOST", (0, 2, 1)),
        ("CONNECTED", (1, 2, 1)),
    ):
        listener(state)
        assert now() == expected, state
    client.state_listeners.clear()  # closed: zk.close removes the listener
    assert session_state(client) is None  # type: ignore[arg-type]
    assert now() == (0, 0, 0)
    # No kazoo client at all (a client whose discovery is not ZooKeeper's): no series, rather than a
    # "disconnected" one that would fire WaltzZooKeeperSuspended.
    other = CollectorRegistry()
    other.register(ZooKeeperCollector(lambda: None))
    assert not [key for key in samples(other) if key[0].startswith("waltz_zookeeper")]
