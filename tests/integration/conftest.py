"""Fixtures for tests that run whole clusters of real processes (see ``server_process.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient

from tests.integration.server_process import Cluster

ClusterFactory = Callable[..., Cluster]

_REPORT_KEY = pytest.StashKey[pytest.TestReport]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    if report.when == "call":
        item.stash[_REPORT_KEY] = report
    return report


@pytest.fixture
def cluster_factory(
    request: pytest.FixtureRequest, tmp_path: Path, zk: KazooClient, zk_connect_string: str
) -> Iterator[ClusterFactory]:
    """``make(**kwargs)`` -> a :class:`Cluster` in this test's ZooKeeper chroot; every process it started
    is stopped at teardown, and the process logs are printed if the test failed."""
    made: list[Cluster] = []

    def make(**kwargs: Any) -> Cluster:
        cluster = Cluster(tmp_path / f"cluster-{len(made)}", zk, zk_connect_string, **kwargs)
        made.append(cluster)
        return cluster

    try:
        yield make
    finally:
        report = request.node.stash.get(_REPORT_KEY, None)
        for cluster in made:
            cluster.stop()
            if report is not None and report.failed:
                print(cluster.logs())
