"""waltz perf / waltz client validate against the MockDriver: figures, checks, and the CLI commands."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from waltz.cli.main import main
from waltz.client.builder import TransactionBuilder
from waltz.client.config import ClientConfig
from waltz.client.transaction import Transaction
from waltz.errors import ClientError, ConfigError
from waltz.perf.common import PerfResult, percentile
from waltz.perf.producer import ConsumerOptions, ProducerOptions, run_consumers, run_producers
from waltz.perf.validate import VALUE, ValidateOptions, ValidationReport, _Checker, run_validation
from waltz.protocol.records import ReqId
from waltz.testing import MockCluster, MockDriver

pytestmark = pytest.mark.timeout(60)


def drivers(partitions: int = 2) -> tuple[MockCluster, object]:
    cluster = MockCluster(partitions)
    return cluster, lambda: MockDriver(cluster=cluster)


def test_percentile_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    assert percentile([], 50) == 0.0
    assert percentile([7.0], 95) == 7.0


def test_producer_appends_every_transaction_and_reports_figures() -> None:
    cluster, factory = drivers(2)
    opts = ProducerOptions(txn_size_bytes=100, txns_per_client=50, clients=3, seed=1)
    result = asyncio.run(run_producers(ClientConfig(), opts, factory))  # type: ignore[arg-type]
    assert result.transactions == 150
    assert result.failed == 0
    assert len(cluster.records(0)) + len(cluster.records(1)) == 150
    assert all(len(r.data) == 100 for r in cluster.records(0))
    j = result.to_json()
    assert j["megabytes"] == pytest.approx(0.015)
    assert j["latency_ms"]["p50"] <= j["latency_ms"]["p99"] <= j["latency_ms"]["max"]
    assert j["retries_per_transaction"] >= 0
    assert "transactions/s" in result.render()


def test_producer_executes_its_transactions_on_the_loop_with_the_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As an asyncio application's coroutine callbacks do: a plain execute would cross to a callback
    # thread and back for every append (waltz perf then measured that hop, at a third of the speed).
    threads: set[int] = set()
    original = TransactionBuilder.set_transaction_data

    def noting(builder: TransactionBuilder, data: bytes) -> None:
        threads.add(threading.get_ident())
        original(builder, data)

    monkeypatch.setattr(TransactionBuilder, "set_transaction_data", noting)
    cluster, factory = drivers(2)
    opts = ProducerOptions(txn_size_bytes=10, txns_per_client=20, clients=2, seed=3)
    result = asyncio.run(run_producers(ClientConfig(), opts, factory))  # type: ignore[arg-type]
    assert result.transactions == 40
    assert len(cluster.records(0)) + len(cluster.records(1)) == 40
    assert threads == {threading.get_ident()}


def test_producer_with_a_small_lock_pool_retries_but_loses_nothing() -> None:
    cluster, factory = drivers(1)
    opts = ProducerOptions(txn_size_bytes=16, txns_per_client=40, clients=4, lock_pool_size=2, seed=2)
    result = asyncio.run(run_producers(ClientConfig(), opts, factory))  # type: ignore[arg-type]
    assert result.transactions == 160
    assert result.retries > 0
    assert len(cluster.records(0)) == 160


def test_producer_uses_only_the_requested_partitions() -> None:
    cluster, factory = drivers(4)
    opts = ProducerOptions(txn_size_bytes=8, txns_per_client=30, clients=1, partitions=2, seed=3)
    asyncio.run(run_producers(ClientConfig(), opts, factory))  # type: ignore[arg-type]
    assert len(cluster.records(2)) == len(cluster.records(3)) == 0


def test_consumer_reads_what_it_loaded() -> None:
    _, factory = drivers(2)
    opts = ConsumerOptions(txn_size_bytes=64, num_txns=200, clients=2, seed=4)
    result = asyncio.run(run_consumers(ClientConfig(), opts, factory))  # type: ignore[arg-type]
    assert result.mode == "consumer"
    assert result.parameters["num_txns"] == 200
    assert result.transactions == 400  # two consumers read 200 each


def test_consumer_shows_a_live_progress_line_of_reads() -> None:
    cluster = MockCluster(1)
    # Slow data fetches keep the run going past a few refreshes of the line.
    opts = ConsumerOptions(txn_size_bytes=16, num_txns=100, clients=1, seed=6)
    lines: list[str] = []

    def slow_factory() -> MockDriver:
        driver = MockDriver(cluster=cluster)
        driver.set_max_delay(20)
        return driver

    result = asyncio.run(run_consumers(ClientConfig(), opts, slow_factory, show_progress=lines.append))  # type: ignore[arg-type]
    assert result.transactions == 100
    assert lines, "no progress line was shown"
    assert all(" read, " in line and "/100 read" in line for line in lines)


def test_validation_passes_on_a_correct_cluster() -> None:
    _, factory = drivers(2)
    opts = ValidateOptions(txns_per_client=30, clients=3, seed=5)
    report = asyncio.run(run_validation(ClientConfig(), opts, factory))  # type: ignore[arg-type]
    assert report.ok, report.render()
    assert report.committed == 90
    assert sum(report.end_marks.values()) - sum(report.start_marks.values()) == 90


def test_validation_survives_dropped_appends() -> None:
    cluster = MockCluster(1)

    def factory() -> MockDriver:
        driver = MockDriver(cluster=cluster, seed=6)
        driver.set_fault_rate(0.2)
        return driver

    config = ClientConfig(long_wait_threshold_ms=50)
    report = asyncio.run(
        run_validation(config, ValidateOptions(txns_per_client=20, clients=2, seed=6), factory)
    )
    assert report.ok, report.render()
    assert report.committed == 40


class _Source:
    def __init__(self, data: dict[int, bytes]) -> None:
        self.data = data

    def fetch_blocking(self, partition_id: int, transaction_id: int) -> bytes:
        return self.data[transaction_id]

    async def fetch(self, partition_id: int, transaction_id: int) -> bytes:
        return self.data[transaction_id]


def test_checker_reports_wrong_values_gaps_and_duplicates_precisely() -> None:
    report = ValidationReport(clients=1)
    checker = _Checker(0, {0: -1}, report)
    source = _Source({0: VALUE.pack(0), 1: VALUE.pack(0), 3: VALUE.pack(3), 4: b"x"})
    for tid in (0, 1, 3, 3, 4):
        checker(Transaction(0, tid, 0, ReqId.of(1, 0, 0, tid), source))
    assert not report.ok
    text = "\n".join(report.violations)
    assert "transaction 1 carries value 0" in text
    assert "transaction id 3 after 1 (gap)" in text
    assert "transaction id 3 after 3 (duplicate or out of order)" in text
    assert "transaction 4 carries 1 bytes" in text
    assert "VALIDATION FAILED" in report.render()


def test_options_are_checked() -> None:
    with pytest.raises(ConfigError):
        ProducerOptions(txn_size_bytes=0).validate()
    with pytest.raises(ConfigError):
        ProducerOptions(clients=0).validate()
    with pytest.raises(ConfigError):
        ValidateOptions(txns_per_client=0).validate()
    with pytest.raises(ConfigError):
        ConsumerOptions(num_txns=0).validate()


def test_perf_result_json_without_transactions() -> None:
    r = PerfResult("producer", 0, 512, 0.0)
    assert r.to_json()["transactions_per_second"] == 0.0
    assert r.to_json()["latency_ms"]["max"] == 0.0


def test_cli_commands_on_the_mock(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["perf", "producer", "--mock", "2", "--txns-per-client", "20", "--clients", "2", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["transactions"] == 40
    assert out["mode"] == "producer"
    assert main(["perf", "consumer", "--mock", "1", "--num-txns", "30"]) == 0
    assert "transactions read: 30" in capsys.readouterr().out
    assert main(["client", "validate", "--mock", "2", "--txns-per-client", "10", "--clients", "2"]) == 0
    assert "OK: every client received" in capsys.readouterr().out
    assert main(["client", "high-water-mark", "--mock", "3", "-p", "2"]) == 0
    assert capsys.readouterr().out.strip() == "-1"
    assert main(["client", "high-water-mark", "--mock", "3", "-p", "5"]) == 2
    assert main(["perf", "producer", "--mock", "1", "--txns-per-client", "0"]) == 2
    assert "--txns-per-client must be positive" in capsys.readouterr().err


def test_producer_stops_with_a_clear_error_when_nothing_commits(monkeypatch: pytest.MonkeyPatch) -> None:
    import waltz.perf.common as common

    monkeypatch.setattr(common, "STALL_TIMEOUT_S", 0.5)
    cluster = MockCluster(1)

    class Stuck(MockDriver):
        """A cluster that mounts but never commits: every append is dropped."""

        def send_append(self, partition_id: int, req_id: object, builder: object, now: bool) -> None:  # type: ignore[override]
            return None

    opts = ProducerOptions(txn_size_bytes=10, txns_per_client=5, clients=1, seed=1)
    config = ClientConfig(
        long_wait_threshold_ms=60_000, retry_initial_backoff_ms=1000, retry_max_backoff_ms=1000
    )
    with pytest.raises(ClientError, match=r"no appends completed in the last 0.5 s .* cannot take appends"):
        asyncio.run(run_producers(config, opts, lambda: Stuck(cluster=cluster)))
