"""TLS end to end on real processes: a storage node, a whole cluster, and ``waltz local up --tls``.

Certificates come from the session fixtures of :mod:`tests.tls_fixture`. The whole-cluster tests run
ZooKeeper over TLS too (``tls_zookeeper``; ``waltz local up --tls`` starts its own), so every link a
cluster has is encrypted and authenticated; tests/integration/test_zookeeper_tls.py covers ZooKeeper's TLS
refusals in detail.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kazoo.exceptions import NoAuthError

from tests.integration.client_cluster import Tagged, wait_until
from tests.integration.server_process import ServerProcess
from tests.integration.storage_process import DEFAULT_KEY, StorageProcess
from tests.tls_fixture import tls_config, tls_keys, zk_tls_keys
from waltz import ClientConfig, WaltzClient
from waltz.client.api import ClientCallbacks
from waltz.client.transaction import Transaction
from waltz.cluster import store_metadata as sm
from waltz.cluster import zk as zkutil
from waltz.cluster.zkserver import ZooKeeperServer
from waltz.config import flatten
from waltz.errors import BrokenResourceError, ClusterError, ConfigError
from waltz.local.certs import LocalPki
from waltz.protocol.records import Record, ReqId
from waltz.server.storage_client import AdminClient, StorageClient
from waltz.tls import TlsConfig

pytestmark = pytest.mark.integration

NUM_PARTITIONS = 2
FAIL_FAST_S = 5.0
"""A refused connection must fail well within this, never wait for a generic timeout."""


def records(first: int, n: int) -> list[Record]:
    return [Record.build(i, ReqId(7 << 32, i), 0, f"tls {i}".encode()) for i in range(first, first + n)]


@pytest.fixture
def tls_node(tmp_path: Path, tls_pki: LocalPki) -> Iterator[StorageProcess]:
    """A standalone storage node requiring client certificates on its data and admin ports."""
    node = StorageProcess(
        tmp_path, num_partitions=NUM_PARTITIONS, config=tls_keys(tls_pki, "storage", "storage.ssl.")
    )
    try:
        node.start()
        yield node
    finally:
        node.stop()


@pytest.mark.timeout(60)
def test_storage_node_serves_data_and_admin_ports_over_mutual_tls(
    tls_node: StorageProcess, tls_pki: LocalPki
) -> None:
    ssl = tls_config(tls_pki, "client").client_context()

    async def main() -> None:
        admin = await AdminClient.connect(
            "127.0.0.1", tls_node.admin_port, DEFAULT_KEY, NUM_PARTITIONS, ssl=ssl
        )
        client = await StorageClient.connect("127.0.0.1", tls_node.port, DEFAULT_KEY, NUM_PARTITIONS, ssl=ssl)
        async with admin, client:
            await admin.set_assigned([0], True)
            await client.last_session_info(3, 0)
            batch = records(0, 20)
            await client.append(3, 0, batch)
            assert await client.read_records(3, 0, 0, 100) == batch
            assert await admin.max_transaction_id(0) == 19

    asyncio.run(asyncio.wait_for(main(), 30))


@pytest.mark.timeout(60)
def test_storage_node_refuses_plain_and_uncertified_clients_at_once(
    tls_node: StorageProcess, tls_pki: LocalPki, stranger_pki: LocalPki, tmp_path: Path
) -> None:
    no_cert = tls_config(tls_pki, None).client_context()
    stranger = TlsConfig(
        str(stranger_pki.cert_file("stranger")), str(stranger_pki.key_file("stranger")), str(tls_pki.ca_file)
    ).client_context()
    plain_node = StorageProcess(tmp_path / "plain", num_partitions=NUM_PARTITIONS)

    async def refused(port: int, ssl: Any, match: str, error: type[Exception] = BrokenResourceError) -> None:
        start = time.monotonic()
        with pytest.raises(error, match=match):
            await StorageClient.connect("127.0.0.1", port, DEFAULT_KEY, NUM_PARTITIONS, ssl=ssl)
        assert time.monotonic() - start < FAIL_FAST_S

    async def main() -> None:
        await refused(tls_node.port, None, "wants TLS and this side has no TLS settings", ConfigError)
        await refused(tls_node.port, no_cert, "does the peer require a client certificate")
        await refused(tls_node.port, stranger, "not trust this one")
        await refused(
            plain_node.port, tls_config(tls_pki, "client").client_context(), "does the peer serve TLS"
        )

    with plain_node:
        plain_node.start()
        asyncio.run(asyncio.wait_for(main(), 30))
        # The plain node says why it dropped the TLS client (it may log that just after the client gave up).
        deadline = time.monotonic() + FAIL_FAST_S
        while (
            "the peer speaks TLS but this side" not in plain_node.log_text() and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert "the peer speaks TLS but this side of the connection is plain" in plain_node.log_text()


class Recorder(ClientCallbacks):
    """Keeps the data of every applied transaction, per partition."""

    def __init__(self) -> None:
        self.applied: dict[int, list[bytes]] = {p: [] for p in range(NUM_PARTITIONS)}

    def client_high_water_mark(self, partition_id: int) -> int:
        return len(self.applied[partition_id]) - 1

    def apply_transaction(self, transaction: Transaction) -> None:
        self.applied[transaction.partition_id].append(transaction.get_transaction_data())

    def uncaught_exception(self, partition_id: int, transaction_id: int, exception: BaseException) -> None:
        raise AssertionError(f"partition {partition_id} transaction {transaction_id}: {exception!r}")


@pytest.fixture
def tls_zk_connect_string(tls_zookeeper: ZooKeeperServer, tls_pki: LocalPki) -> Iterator[str]:
    """A fresh chroot on the TLS-only ZooKeeper (as ``zk_connect_string`` is on the plain one)."""
    auth = zkutil.ZkAuth.from_config(zk_tls_keys(tls_pki, "client"))
    admin = zkutil.connect(tls_zookeeper.connect_string, session_timeout_ms=10_000, auth=auth)
    chroot = f"/test-{os.urandom(6).hex()}"
    admin.create(chroot)
    try:
        yield f"{tls_zookeeper.connect_string}{chroot}"
    finally:
        admin.delete(chroot, recursive=True)
        zkutil.close(admin)


@pytest.mark.timeout(180)
def test_cluster_commits_over_tls_end_to_end(
    tmp_path: Path, tls_pki: LocalPki, tls_zk_connect_string: str
) -> None:
    """Two storage nodes, a server and a client, every Waltz link mutual TLS, and ZooKeeper TLS only: the
    server and the client reach it with their own certificates."""
    root = "/waltz-tls"
    zk_connect_string = tls_zk_connect_string
    zk = zkutil.connect(
        zk_connect_string,
        session_timeout_ms=10_000,
        auth=zkutil.ZkAuth.from_config(zk_tls_keys(tls_pki, "client")),
    )
    sm.create_cluster(zk, root, "tls", NUM_PARTITIONS, cluster_key=DEFAULT_KEY)
    storages = [
        StorageProcess(
            tmp_path,
            num_partitions=NUM_PARTITIONS,
            config=tls_keys(tls_pki, "storage", "storage.ssl."),
            name=f"storage-{i}",
        )
        for i in range(2)
    ]
    server = ServerProcess(
        tmp_path,
        zk_connect=zk_connect_string,
        cluster_root=root,
        name="server",
        config={**tls_keys(tls_pki, "server", "server.ssl."), **zk_tls_keys(tls_pki, "server")},
    )
    admin_ssl = tls_config(tls_pki, "client").client_context()
    config = ClientConfig(
        zookeeper_connect_string=zk_connect_string,
        zookeeper_session_timeout_ms=4000,
        cluster_root=root,
        mount_timeout_ms=30000,
        submit_timeout_ms=30000,
        num_consumer_threads=2,
        ssl={k.removeprefix("client.ssl."): v for k, v in tls_keys(tls_pki, "client", "client.ssl.").items()},
        zookeeper_ssl={
            k.removeprefix("zookeeper.ssl."): v for k, v in zk_tls_keys(tls_pki, "client").items()
        },
    )
    parts = list(range(NUM_PARTITIONS))

    async def main() -> None:
        for sp in storages:
            await asyncio.to_thread(sp.start)
            async with await AdminClient.connect(
                "127.0.0.1", sp.admin_port, DEFAULT_KEY, NUM_PARTITIONS, ssl=admin_ssl
            ) as admin:
                await admin.set_assigned(parts, True)
            address = f"127.0.0.1:{sp.port}"
            await asyncio.to_thread(sm.add_storage_node, zk, root, address, 0, sp.admin_port)
            await asyncio.to_thread(sm.assign_partitions, zk, root, address, parts)
        await asyncio.to_thread(server.start)
        app = Recorder()
        client = await asyncio.to_thread(WaltzClient, app, config)
        try:
            contexts = [Tagged(f"txn {i}".encode(), i % NUM_PARTITIONS) for i in range(10)]

            def work() -> None:
                for context in contexts:
                    client.submit(context)
                client.flush_transactions(60)

            await asyncio.to_thread(work)
            assert all(c.completed is True for c in contexts), [c.exception for c in contexts]
            await wait_until(lambda: sum(map(len, app.applied.values())) == 10, 30, "the feed of all ten")
            assert app.applied[0] == [f"txn {i}".encode() for i in range(0, 10, 2)]
        finally:
            await asyncio.to_thread(client.close)
        # Both replicas hold every transaction (read back over the admin ports, with TLS too).
        for sp in storages:
            async with await AdminClient.connect(
                "127.0.0.1", sp.admin_port, DEFAULT_KEY, NUM_PARTITIONS, ssl=admin_ssl
            ) as admin:
                for p in parts:
                    assert await admin.max_transaction_id(p) >= 3

    try:
        asyncio.run(asyncio.wait_for(main(), 150))
    except BaseException:
        for proc in (server, *storages):
            print(f"===== {proc.name} =====\n{proc.log_text()[-5000:]}")
        raise
    finally:
        server.stop()
        for sp in storages:
            sp.stop()
        zkutil.close(zk)


# --------------------------------------------------------------------------------------- waltz local up --tls


def waltz(
    *args: str, timeout_s: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "waltz.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        stdin=subprocess.DEVNULL,
        env=env,
    )


@pytest.fixture
def cluster_dir(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "local"
    try:
        yield d
    finally:
        if (d / "cluster.json").exists():
            waltz("local", "down", "--dir", str(d))


@pytest.mark.timeout(240)
def test_local_up_tls_status_appends_and_down(cluster_dir: Path) -> None:
    up = waltz(
        "local", "up", "--dir", str(cluster_dir), "--tls", "--storages", "2", "--servers", "1",
        "--partitions", "2", timeout_s=150,
    )  # fmt: skip
    assert up.returncode == 0, up.stderr
    assert "TLS: mutual" in up.stdout
    assert "ZooKeeper: TLS only, client certificates required" in up.stdout
    tls_dir = cluster_dir / "tls"
    assert {p.name for p in tls_dir.iterdir()} >= {
        "ca.pem", "client.pem", "client-key.pem", "server.pem", "zookeeper.pem", "zookeeper-key.pem"
    }  # fmt: skip
    assert not (tls_dir / "ca-key.pem").exists()
    assert (tls_dir / "client-key.pem").stat().st_mode & 0o077 == 0

    status = waltz("local", "status", "--dir", str(cluster_dir), timeout_s=60)
    assert status.returncode == 0, status.stdout + status.stderr
    assert "mutual TLS" in status.stdout
    assert "admin port did not answer" not in status.stdout  # The storage admin ports answered over TLS.

    client_yaml = cluster_dir / "client.yaml"
    assert yaml.safe_load(client_yaml.read_text())["client.ssl.caFile"] == str(tls_dir / "ca.pem")
    validate = waltz(
        "client", "validate", "-c", str(client_yaml), "--txns-per-client", "5", "--clients", "2", timeout_s=90
    )
    assert validate.returncode == 0, validate.stdout + validate.stderr
    hwm = waltz("client", "high-water-mark", "-c", str(client_yaml), "-p", "0", timeout_s=60)
    assert hwm.returncode == 0, hwm.stderr
    assert int(hwm.stdout.strip()) >= 0

    # Admin commands take the client config as -c; without it the TLS server is refused with a clear reason.
    server_port = yaml.safe_load((cluster_dir / "server-0.yaml").read_text())["server.port"]
    listed = waltz("server", "list", "-s", f"127.0.0.1:{server_port}", "-c", str(client_yaml), timeout_s=30)
    assert listed.returncode == 0, listed.stderr
    assert "reachable" in listed.stdout
    plain = waltz("server", "list", "-s", f"127.0.0.1:{server_port}", timeout_s=30)
    assert plain.returncode != 0
    assert "TLS" in plain.stderr
    # Storage ports take the operator's certificate (admin.yaml), not an application's (client.yaml).
    admin_port = yaml.safe_load((cluster_dir / "storage-0.yaml").read_text())["storage.admin.port"]
    admin_yaml = cluster_dir / "admin.yaml"
    storage = waltz("storage", "list", "-s", f"127.0.0.1:{admin_port}", "-c", str(admin_yaml), timeout_s=30)
    assert storage.returncode == 0, storage.stderr
    assert "available" in storage.stdout
    refused = waltz("storage", "list", "-s", f"127.0.0.1:{admin_port}", "-c", str(client_yaml), timeout_s=30)
    assert refused.returncode != 0
    assert "not in storage.ssl.allowedPeers" in (cluster_dir / "logs" / "storage-0.log").read_text()

    # ZooKeeper serves TLS only: a plain client gets no session at all; every process config reaches it with
    # its role's certificate.
    admin_config = yaml.safe_load(admin_yaml.read_text())
    zk_connect = admin_config["zookeeper.connectString"]
    zoo_cfg = (cluster_dir / "zookeeper" / "zoo.cfg").read_text()
    assert f"secureClientPort={zk_connect.rsplit(':', 1)[1]}" in zoo_cfg
    assert "clientPort=" not in zoo_cfg.replace("secureClientPort=", "")
    with pytest.raises(ClusterError, match="no answer within"):
        zkutil.connect(zk_connect, session_timeout_ms=10_000, connect_timeout_ms=1500)
    for name in ("storage-0.yaml", "server-0.yaml", "client.yaml", "admin.yaml"):
        flat = flatten(yaml.safe_load((cluster_dir / name).read_text()))
        assert flat["zookeeper.ssl.enabled"] is True, name
        assert flat["zookeeper.ssl.caFile"] == str(tls_dir / "ca.pem"), name
    # With a certificate of the cluster's CA but no digest identity: neither the cluster key nor a partition's
    # metadata is within reach (the ACLs still hold behind TLS).
    tls_only = {k: v for k, v in admin_config.items() if k.startswith("zookeeper.ssl.")}
    anonymous = zkutil.connect(
        zk_connect, session_timeout_ms=10_000, auth=zkutil.ZkAuth.from_config(tls_only)
    )
    try:
        with pytest.raises(NoAuthError):
            anonymous.get("/waltz/local/store")
        with pytest.raises(NoAuthError):
            anonymous.set("/waltz/local/store/partition/0", b"forged")
    finally:
        zkutil.close(anonymous)
    # The operator's tools work through it.
    listed = waltz("cluster", "list", "-c", str(admin_yaml), timeout_s=30)
    assert listed.returncode == 0, listed.stderr
    assert "partition 0" in listed.stdout

    down = waltz("local", "down", "--dir", str(cluster_dir), timeout_s=60)
    assert down.returncode == 0, down.stderr


@pytest.mark.timeout(30)
def test_local_up_tls_without_openssl_is_a_clear_error(cluster_dir: Path) -> None:
    env = {**os.environ, "PATH": "/nonexistent"}
    result = waltz("local", "up", "--dir", str(cluster_dir), "--tls", env=env)
    assert result.returncode == 2
    assert "openssl command-line tool, which is not on PATH" in result.stderr
    assert not (cluster_dir / "cluster.json").exists()
