"""One clear line instead of a traceback: ports that cannot be bound, a closed pipe, an unreachable
ZooKeeper, and a plain client against a TLS cluster. Real processes (``python -m waltz.cli.main``)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kazoo.client import KazooClient

from tests.integration.server_process import ServerProcess, free_port
from tests.integration.storage_process import DEFAULT_KEY, StorageProcess
from tests.tls_fixture import tls_keys
from waltz import ClientConfig, WaltzClient
from waltz.cluster import store_metadata as sm
from waltz.errors import ConfigError
from waltz.local.certs import LocalPki
from waltz.protocol.records import Record, ReqId
from waltz.storage.partition import PartitionLog
from waltz.storage.segment import data_file_name

pytestmark = [pytest.mark.integration]


def waltz(*args: str, timeout_s: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "waltz.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        stdin=subprocess.DEVNULL,
    )


def run_with(tmp_path: Path, command: str, config: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    path = tmp_path / f"{command}.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return waltz(command, "run", "--config", str(path))


def assert_one_error_line(result: subprocess.CompletedProcess[str], *expected: str) -> str:
    """Exit status non-zero, no traceback, and exactly one ERROR-ish line (the last) holding ``expected``."""
    assert result.returncode != 0, result
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if "error" in line.lower() or "WARNING" in line]
    assert errors == [lines[-1]], result.stderr
    for text in expected:
        assert text in lines[-1], result.stderr
    return lines[-1]


@pytest.fixture
def listening() -> Iterator[int]:
    """A loopback port some other program holds."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def storage_config(tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    return {
        "storage.port": 0,
        "storage.admin.port": 0,
        "storage.directory": str(tmp_path / "data"),
        "storage.cluster.key": str(DEFAULT_KEY),
        "storage.cluster.numPartitions": 1,
        **overrides,
    }


def test_storage_run_on_a_port_in_use_says_so_in_one_line(tmp_path: Path, listening: int) -> None:
    result = run_with(tmp_path, "storage", storage_config(tmp_path, **{"storage.admin.port": listening}))
    assert_one_error_line(
        result, f"waltz: error: cannot listen on 127.0.0.1:{listening} (storage.admin.port)", "in use"
    )
    assert result.returncode == 2


def test_storage_run_on_an_address_not_ours_says_so_in_one_line(tmp_path: Path) -> None:
    # 192.0.2.0/24 is TEST-NET-1: never an address of this machine.
    result = run_with(tmp_path, "storage", storage_config(tmp_path, **{"storage.host": "192.0.2.1"}))
    assert_one_error_line(result, "cannot listen on 192.0.2.1:0 (storage.port)", "assign requested address")


def test_server_run_on_a_port_in_use_says_so_in_one_line(
    tmp_path: Path, listening: int, zk: KazooClient, zk_connect_string: str
) -> None:
    sm.create_cluster(zk, "/ports", "ports", 1, cluster_key=DEFAULT_KEY)
    config = {"zookeeper.connectString": zk_connect_string, "cluster.root": "/ports", "server.port": 0}
    result = run_with(tmp_path, "server", {**config, "server.http.port": listening})
    assert_one_error_line(result, f"cannot listen on 127.0.0.1:{listening} (server.http.port)", "in use")
    result = run_with(tmp_path, "server", {**config, "server.port": listening})
    assert_one_error_line(result, f"cannot listen on 127.0.0.1:{listening} (server.port)", "in use")


@pytest.mark.parametrize("command", ["server", "storage"])
def test_an_unreachable_zookeeper_is_one_line_not_a_warning_per_attempt(tmp_path: Path, command: str) -> None:
    unused = free_port()
    config: dict[str, Any] = {
        "zookeeper.connectString": f"127.0.0.1:{unused}",
        "zookeeper.connectTimeout": 1500,
        "cluster.root": "/nowhere",
    }
    if command == "server":
        config["server.port"] = 0
    else:
        config.update(
            {k: v for k, v in storage_config(tmp_path).items() if not k.startswith("storage.cluster")}
        )
    started = time.monotonic()
    result = run_with(tmp_path, command, config)
    assert time.monotonic() - started < 15
    assert_one_error_line(result, f"cannot connect to ZooKeeper at 127.0.0.1:{unused}", "1500 ms")
    assert "Connection dropped" not in result.stderr


def test_dump_segment_into_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    key = uuid.uuid4()
    log = PartitionLog.open(str(tmp_path), key, 0)
    log.append([Record.build(i, ReqId.of(1, 1, 0, i), 0, b"x" * 100) for i in range(3000)])
    log.flush()
    log.close()
    segment = tmp_path / "0" / data_file_name(0)
    # `waltz disk dump-segment ... | head -1`: head exits after one line, closing the pipe.
    shell = (
        f"{sys.executable} -m waltz.cli.main disk dump-segment -r {segment} | head -1 >/dev/null; "
        "echo status=${PIPESTATUS[0]}"
    )
    result = subprocess.run(
        ["bash", "-c", shell],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    assert result.stderr == "", result.stderr
    assert result.stdout.strip() == "status=141"  # 128 + SIGPIPE, as a shell reports it


@pytest.mark.timeout(90)
def test_a_plain_client_against_a_tls_cluster_is_told_the_server_wants_tls(
    tmp_path: Path, tls_pki: LocalPki, zk: KazooClient, zk_connect_string: str
) -> None:
    root = "/tls-wanted"
    sm.create_cluster(zk, root, "tls", 1, cluster_key=DEFAULT_KEY)
    storage = StorageProcess(tmp_path, num_partitions=1, config=tls_keys(tls_pki, "storage", "storage.ssl."))
    server = ServerProcess(
        tmp_path,
        zk_connect=zk_connect_string,
        cluster_root=root,
        config=tls_keys(tls_pki, "server", "server.ssl."),
    )
    plain = ClientConfig(
        zookeeper_connect_string=zk_connect_string,
        zookeeper_session_timeout_ms=4000,
        cluster_root=root,
        mount_timeout_ms=30000,
    )
    try:
        storage.start()
        address = f"127.0.0.1:{storage.port}"
        sm.add_storage_node(zk, root, address, 0, storage.admin_port)
        sm.assign_partitions(zk, root, address, [0])
        server.start()
        deadline = time.monotonic() + 20
        while "partition 0 opened" not in server.log_text() and time.monotonic() < deadline:
            time.sleep(0.1)

        class App:
            def client_high_water_mark(self, partition_id: int) -> int:
                return -1

            def apply_transaction(self, transaction: Any) -> None:
                pass

            def uncaught_exception(
                self, partition_id: int, transaction_id: int, exception: BaseException
            ) -> None:
                pass

        started = time.monotonic()
        with pytest.raises(ConfigError, match=r"wants TLS and this side has no TLS settings"):
            WaltzClient(App(), plain).close()  # type: ignore[arg-type]
        assert time.monotonic() - started < 5  # not the 30 s mount timeout
    finally:
        server.stop()
        storage.stop()
