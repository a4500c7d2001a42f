"""The Grafana dashboard queries only metrics the servers and storage nodes expose, and every HTTP port serves
/buildinfo.

Real processes: a server and storage nodes with HTTP ports, scraped after some appends and a replica failure
(so the counters of ended sessions have samples too)."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import ClusterFactory
from tests.integration.raw_client import RawClient
from tests.integration.server_process import free_port, wait_until
from waltz import __version__
from waltz.cluster.membership import ClusterWatcher

pytestmark = [pytest.mark.integration]

DASHBOARD = Path(__file__).parents[2] / "contrib" / "grafana" / "waltz-dashboard.json"
METRIC = re.compile(r"\b((?:waltz|process|python)_[a-zA-Z0-9_]+)\b")


def get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
        return str(response.read().decode())


def exposed(text: str) -> dict[str, int]:
    """Every metric name in an exposition (families, and their samples' names), with its sample count."""
    names: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        suffixes = {"counter": ["_total"], "info": ["_info"], "summary": ["_sum", "_count"]}
        for suffix in ["", *suffixes.get(family.type, [])]:
            names.setdefault(family.name + suffix, 0)
        for sample in family.samples:
            names[sample.name] = names.get(sample.name, 0) + 1
    return names


def dashboard_metrics() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    found: set[str] = set()
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            found.update(METRIC.findall(target["expr"]))
    for variable in dashboard["templating"]["list"]:
        found.update(METRIC.findall(str(variable.get("query", ""))))
    return found


@pytest.mark.timeout(90)
def test_every_metric_the_dashboard_queries_is_exposed(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(storage_config={"storage.http.port": 0})

    async def main() -> dict[str, int]:
        for _ in range(3):
            cluster.storage_config["storage.http.port"] = free_port()
            await cluster.add_storage()
        server = await cluster.add_server()
        async with ClusterWatcher(cluster.zk, cluster.root) as watcher:
            client = await RawClient(watcher, 1).start()
            try:
                for i in range(10):
                    await client.append_and_wait(b"record %d" % i)
                # A replica failure ends a session: the ended-sessions counter gets a sample.
                cluster.storages[2].kill()
                await client.append_and_wait(b"one more")
            finally:
                await client.aclose()
        # And the next one opened: between the two, no session has replicas, so the lag series (per replica
        # of the open session) has no sample, and a scrape in that gap missed it.
        await wait_until(
            lambda: all(
                series in text
                for text in [get(server.http_port, "/metrics")]
                for series in ("waltz_server_store_sessions_ended_total{", "waltz_server_replica_lag{")
            ),
            20,
            "a session ended and the next one opened",
        )
        names: dict[str, int] = {}
        for port in [server.http_port, *(sp.http_port for sp in cluster.storages[:2])]:
            for name, count in exposed(get(port, "/metrics")).items():
                names[name] = names.get(name, 0) + count
        return names

    names = asyncio.run(main())
    # A client's metrics come from the application's process: test_prometheus.py runs one and checks every
    # dashboard query, these included, against a real Prometheus.
    queried = {m for m in dashboard_metrics() if not m.startswith("waltz_client_")}
    assert len(queried) >= 25  # the regular expression found the dashboard's queries
    missing = sorted(m for m in queried if m not in names)
    assert missing == [], f"the dashboard queries metrics no process exposes: {missing}"
    # The headline series have samples, not just a declaration.
    for name in (
        "waltz_build_info",
        "process_cpu_seconds_total",
        "waltz_server_appends_total",
        "waltz_server_appended_bytes_total",
        "waltz_server_replica_lag",
        "waltz_server_store_sessions_opened_total",
        "waltz_server_recovery_seconds_count",
        "waltz_storage_disk_bytes",
        "waltz_storage_appended_bytes_total",
    ):
        assert names.get(name, 0) > 0, name


@pytest.mark.timeout(60)
def test_buildinfo_on_every_http_port(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(storage_config={"storage.http.port": free_port()})

    async def main() -> None:
        storage = await cluster.add_storage()
        server = await cluster.add_server()
        for port in (storage.http_port, server.http_port):
            info = json.loads(get(port, "/buildinfo"))
            assert info["version"] == __version__
            assert re.fullmatch(r"3\.\d+\.\d+.*", info["python"])
            # This test runs from a git checkout, so the commit is known.
            assert re.fullmatch(r"[0-9a-f]{40}", info["commit"]), info
            metrics = get(port, "/metrics")
            assert f'waltz_build_info{{commit="{info["commit"]}",python="{info["python"]}"' in metrics

    asyncio.run(main())
