"""A real Prometheus (Debian's binary) scrapes a real cluster and a client: every query of the Grafana
dashboard returns data, the counters show the events that happened (store sessions ended, generations taken by
a server started after the first scrape), and the alert rules load and evaluate without errors.

The cluster: three storage nodes and a server with HTTP ports, and an AsyncWaltzClient exporting its metrics
(``metrics_registry=``) on an HTTP port of the test's own; Prometheus scrapes them every second (targets in a
file it watches, so servers started later join). Load: counter increments under a write lock from the client;
then a storage node is killed (its store sessions end), a second server starts and the first one stops (the
partitions move to it: new generations on a process Prometheus scraped before it took them)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from tests.integration.client_cluster import CounterApp, Increment
from tests.integration.conftest import ClusterFactory
from tests.integration.server_process import TEST_ZK_SESSION_TIMEOUT_MS, free_port, wait_until
from waltz import AsyncWaltzClient, ClientConfig
from waltz.http import HttpEndpoint

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).parents[2]
DASHBOARD = ROOT / "contrib" / "grafana" / "waltz-dashboard.json"
RULES = ROOT / "contrib" / "prometheus" / "waltz-alerts.yml"
NUM_PARTITIONS = 2


class Prometheus:
    """``prometheus`` on a free loopback port, scraping the targets of :meth:`set_targets` every second and
    evaluating the alert rules every second; :meth:`stop` ends it."""

    def __init__(self, base: Path) -> None:
        binary = shutil.which("prometheus")
        assert binary is not None, "prometheus not found: run scripts/install-system-deps.sh"
        self.base = base
        self.port = free_port()
        self.targets = base / "targets.json"
        self.set_targets([])
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "900ms", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {
                    "job_name": "waltz",
                    "file_sd_configs": [{"files": [str(self.targets)], "refresh_interval": "1s"}],
                }
            ],
        }
        (base / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
        self.log = (base / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={base / 'prometheus.yml'}",
                f"--storage.tsdb.path={base / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def set_targets(self, ports: list[int]) -> None:
        tmp = self.targets.with_suffix(".tmp")
        tmp.write_text(json.dumps([{"targets": [f"127.0.0.1:{p}" for p in ports]}]))
        tmp.replace(self.targets)  # atomically: Prometheus never reads half a file

    def get(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=5) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.get("/api/v1/query", query=expr)
        result: list[dict[str, Any]] = data["result"] if data["resultType"] in ("vector", "matrix") else []
        return result

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=1) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()

    def log_text(self) -> str:
        return (self.base / "prometheus.log").read_text()[-8000:]


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expression) of every dashboard query, with ``$job`` matching every job."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [
        (panel["title"], target["expr"].replace("$job", ".*"))
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


def value(result: list[dict[str, Any]]) -> float:
    return sum(float(sample["value"][1]) for sample in result)


@pytest.mark.timeout(240)
def test_prometheus_sees_every_dashboard_query_and_loads_the_alert_rules(
    cluster_factory: ClusterFactory, tmp_path: Path
) -> None:
    cluster = cluster_factory(num_partitions=NUM_PARTITIONS)
    prometheus = Prometheus(tmp_path)
    try:
        asyncio.run(_run(cluster, prometheus))
    except BaseException:
        print(f"===== prometheus =====\n{prometheus.log_text()}")
        raise
    finally:
        prometheus.stop()


async def _run(cluster: Any, prometheus: Prometheus) -> None:
    await wait_until(prometheus.ready, 30, "Prometheus ready")
    for _ in range(3):
        cluster.storage_config["storage.http.port"] = free_port()
        await cluster.add_storage()
    first = await cluster.add_server()
    registry = CollectorRegistry()
    endpoint = HttpEndpoint(registry, lambda: (True, {}))
    client_port = await endpoint.start("127.0.0.1", 0)
    ports = [client_port, first.http_port, *(sp.http_port for sp in cluster.storages)]
    prometheus.set_targets(ports)
    app = CounterApp(NUM_PARTITIONS)
    config = ClientConfig(
        zookeeper_connect_string=cluster.zk_connect,
        zookeeper_session_timeout_ms=TEST_ZK_SESSION_TIMEOUT_MS,
        cluster_root=cluster.root,
        mount_timeout_ms=60000,
        submit_timeout_ms=60000,
    )
    try:
        async with AsyncWaltzClient(app, config, metrics_registry=registry) as client:

            async def increments(count: int) -> None:
                for i in range(count):
                    await client.submit(Increment(app, i % NUM_PARTITIONS))
                await client.flush_transactions(timeout=60)

            await increments(20)
            await _scraped(prometheus, ports)
            # A replica failure ends the store sessions of both partitions; the next ones open without it.
            cluster.storages[2].kill()
            await increments(10)
            # A server Prometheus scrapes before it owns anything takes the partitions from the first one.
            second = await cluster.add_server()
            prometheus.set_targets([*ports, second.http_port])
            await _scraped(prometheus, [second.http_port])
            await asyncio.to_thread(first.stop)
            await increments(10)
            # Checked while the client runs (its series go stale once its endpoint closes).
            await _check(prometheus)
    finally:
        await endpoint.aclose()


async def _scraped(prometheus: Prometheus, ports: list[int]) -> None:
    """Wait until Prometheus has scraped every one of ``ports``."""
    instances = "|".join(f"127.0.0.1:{p}" for p in ports)
    await wait_until(
        lambda: value(prometheus.query(f'sum(up{{instance=~"{instances}"}})')) == len(ports),
        30,
        f"Prometheus scraped {ports}",
    )


async def _eventually(prometheus: Prometheus, expr: str, what: str) -> None:
    """Wait (a few scrapes and evaluations at most) until ``expr`` returns a sample."""
    # Generous: on a loaded machine scrapes time out now and then, and a subquery sees a change late.
    await wait_until(lambda: bool(prometheus.query(expr)), 60, f"{what}: {expr}")


async def _check(prometheus: Prometheus) -> None:
    queries = dashboard_queries()
    assert len(queries) >= 50
    # rate() over [1m] needs two samples of the new owner's counters: a few scrapes after the move.
    await wait_until(
        lambda: all(prometheus.query(expr) for _, expr in queries), 60, "every dashboard query has data"
    )
    jobs = prometheus.get("/api/v1/label/job/values", **{"match[]": "waltz_build_info"})
    assert jobs == ["waltz"]  # the dashboard's job variable: label_values(waltz_build_info, job)
    # The counters saw the events: series born at 0 before them, so increase() counts the first one.
    await _eventually(
        prometheus,
        'sum(increase(waltz_server_store_sessions_ended_total{reason="replica failed"}[5m])) > 0',
        "the store sessions the storage node's death ended",
    )
    await _eventually(
        prometheus,
        "sum(increase(waltz_server_generation_changes_total[5m])) > 0",
        "the generation the second server took after its first scrape",
    )
    # The dashboard's cluster-wide count also has the partition the second server took at once, before its
    # first scrape: the first server's generation of it was scraped (see _scraped) only a second or two
    # before it moved, and the panel counts every sample, so both partitions' moves show.
    generations = next(expr for title, expr in queries if title == "Generations raised (5 min)")
    await _eventually(prometheus, f"sum({generations}) >= {NUM_PARTITIONS}", "both partitions moved")
    # The client's last appends and its mount on the second server came just before the check: awaited,
    # not read at once (the first scrape of the client after them may be a scrape interval away).
    await _eventually(prometheus, "sum(waltz_client_submit_seconds_count) == 40", "every submit counted")
    await _eventually(
        prometheus, f"sum(waltz_client_mount_state{{state='ready'}}) == {NUM_PARTITIONS}", "both mounted"
    )
    # The alert rules loaded and every one evaluates without an error.
    groups = prometheus.get("/api/v1/rules")["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert len(rules) >= 16
    assert [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []
    # Nothing is unserved at the end (the second server serves both partitions).
    alerts = prometheus.get("/api/v1/alerts")["alerts"]
    assert "WaltzPartitionUnserved" not in {
        a["labels"]["alertname"] for a in alerts if a["state"] == "firing"
    }
