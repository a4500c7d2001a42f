"""ZooKeeper over TLS (issue 15, item 4): a real ZooKeeper serving only a TLS port that requires client
certificates, reached by kazoo through :func:`waltz.cluster.zk.connect` with ``zookeeper.ssl.*``.

What is shown: a plain client, a client without a certificate, one with a certificate from a foreign CA and
one that does not trust ZooKeeper's certificate are all refused, each with an error that says why; the
cluster's certificate is accepted; no plain port is open; and what crosses the wire (digest password, znode
data) is not readable by someone on the path, while the same session over plain TCP shows both.
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import TcpProxy
from tests.tls_fixture import zk_tls_keys
from waltz.cluster import zk as zkutil
from waltz.cluster import zkserver
from waltz.cluster.zkserver import ServerTls, ZooKeeperServer, four_letter_word, free_port
from waltz.errors import ClusterError, ConfigError
from waltz.local.certs import LocalPki

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

REFUSED_CONNECT_TIMEOUT_MS = 1500
"""A refused client gives up after this (kazoo retries a failed handshake until its connect timeout)."""


def _auth(keys: dict[str, object], credentials: str = "") -> zkutil.ZkAuth:
    tls = zkutil.ZkTls.from_config(keys, "test")
    return zkutil.ZkAuth(credentials, tls=tls)


def _refused(connect_string: str, auth: zkutil.ZkAuth | None) -> str:
    try:
        client = zkutil.connect(
            connect_string, session_timeout_ms=4000, connect_timeout_ms=REFUSED_CONNECT_TIMEOUT_MS, auth=auth
        )
    except ClusterError as e:
        return str(e)
    zkutil.close(client)
    raise AssertionError(f"ZooKeeper at {connect_string} accepted a client it must refuse")


def test_tls_zookeeper_refuses_plain_uncertified_and_foreign_clients_and_accepts_the_clusters(
    tls_zookeeper: ZooKeeperServer, tls_pki: LocalPki, stranger_pki: LocalPki
) -> None:
    target = tls_zookeeper.connect_string
    config = tls_zookeeper.config_path.read_text(encoding="ascii")
    assert f"secureClientPort={tls_zookeeper.port}" in config
    assert "ssl.clientAuth=need" in config
    assert "clientPort=" not in config.replace("secureClientPort=", "")  # No plain port at all.
    # The port speaks TLS only: a plain four-letter word gets no answer, the same word over TLS does.
    assert four_letter_word(tls_zookeeper.host, tls_zookeeper.port, "ruok") == ""
    assert tls_zookeeper.four_letter_word("ruok") == "imok"

    plain = _refused(target, None)
    assert "no answer within" in plain
    assert "zookeeper.ssl.enabled" in plain

    no_cert = _refused(target, _auth(zk_tls_keys(tls_pki, None)))
    assert "over TLS" in no_cert
    assert "requires a client certificate" in no_cert

    foreign_cert = {
        "zookeeper.ssl.enabled": True,
        "zookeeper.ssl.certFile": str(stranger_pki.cert_file("stranger")),
        "zookeeper.ssl.keyFile": str(stranger_pki.key_file("stranger")),
        "zookeeper.ssl.caFile": str(tls_pki.ca_file),
    }
    foreign = _refused(target, _auth(foreign_cert))
    assert "refused this client's certificate" in foreign

    # A client that does not trust ZooKeeper's CA refuses the server (its own certificate is fine).
    distrusting = {**zk_tls_keys(tls_pki, "client"), "zookeeper.ssl.caFile": str(stranger_pki.ca_file)}
    untrusted = _refused(target, _auth(distrusting))
    assert "ZooKeeper's certificate" in untrusted
    assert "not trusted" in untrusted

    client = zkutil.connect(target, session_timeout_ms=4000, auth=_auth(zk_tls_keys(tls_pki, "client")))
    try:
        path = f"/tls-{uuid.uuid4().hex[:8]}"
        client.create(path, b"over tls")
        assert client.get(path)[0] == b"over tls"
        client.delete(path)
    finally:
        zkutil.close(client)


class RecordingProxy(TcpProxy):
    """:class:`TcpProxy` that keeps (up to ``MAX_BYTES``) every byte it relays, in both directions: what a
    peer on the network path would read."""

    MAX_BYTES = 4 * 1024 * 1024

    def __init__(self, target_host: str, target_port: int) -> None:
        self.seen = bytearray()
        self._seen_lock = threading.Lock()
        super().__init__(target_host, target_port)

    def _relayed(self, data: bytes) -> None:
        with self._seen_lock:
            if len(self.seen) < self.MAX_BYTES:
                self.seen += data


@contextlib.contextmanager
def _recording(server: ZooKeeperServer) -> Iterator[RecordingProxy]:
    proxy = RecordingProxy(server.host, server.port)
    try:
        yield proxy
    finally:
        proxy.close()


PASSWORD = "digest-password-" + uuid.uuid4().hex
METADATA = b"cluster-key-" + uuid.uuid4().hex.encode()


def _session_through(proxy: RecordingProxy, auth: zkutil.ZkAuth) -> None:
    client = zkutil.connect(f"127.0.0.1:{proxy.port}", session_timeout_ms=4000, auth=auth)
    try:
        path = f"/wire-{uuid.uuid4().hex[:8]}"
        client.create(path, METADATA)
        assert client.get(path)[0] == METADATA
        client.delete(path)
    finally:
        zkutil.close(client)


def test_digest_password_and_metadata_do_not_cross_the_wire_in_clear(
    zookeeper: ZooKeeperServer, tls_zookeeper: ZooKeeperServer, tls_pki: LocalPki
) -> None:
    credentials = f"waltz:{PASSWORD}"
    # The control: over plain TCP a peer on the path reads both (so the recorder does see the session).
    with _recording(zookeeper) as plain:
        _session_through(plain, zkutil.ZkAuth(credentials))
    assert PASSWORD.encode() in plain.seen
    assert METADATA in plain.seen

    # ZooKeeper's certificate names 127.0.0.1, which is what the client connects to through the proxy.
    with _recording(tls_zookeeper) as tls:
        _session_through(tls, _auth(zk_tls_keys(tls_pki, "client"), credentials))
    assert len(tls.seen) > 1000  # handshake and session went through the proxy
    assert PASSWORD.encode() not in tls.seen
    assert METADATA not in tls.seen


def test_a_tls_client_at_a_plain_port_is_told_so(zookeeper: ZooKeeperServer, tls_pki: LocalPki) -> None:
    message = _refused(zookeeper.connect_string, _auth(zk_tls_keys(tls_pki, "client")))
    assert "does not speak TLS" in message or "closed the connection during the TLS handshake" in message


def test_zookeeper_tls_material_is_checked_before_the_jvm_starts(tmp_path: Path, tls_pki: LocalPki) -> None:
    missing = ServerTls(tmp_path / "nope.pem", tls_pki.key_file("zookeeper"), tls_pki.ca_file)
    with pytest.raises(ConfigError, match="cannot read certificate"):
        ZooKeeperServer(tmp_path / "a", tls=missing).start()
    swapped = ServerTls(tls_pki.key_file("zookeeper"), tls_pki.cert_file("zookeeper"), tls_pki.ca_file)
    with pytest.raises(ConfigError, match="holds no PEM"):
        ZooKeeperServer(tmp_path / "b", tls=swapped).start()
    endless = ServerTls(tls_pki.cert_file("zookeeper"), tls_pki.key_file("zookeeper"), Path("/dev/zero"))
    with pytest.raises(ConfigError, match="more than 1048576 bytes"):
        ZooKeeperServer(tmp_path / "c", tls=endless).start()
    # The same key in SEC1 form ("BEGIN EC PRIVATE KEY"), which ZooKeeper cannot read.
    sec1 = tmp_path / "sec1-key.pem"
    subprocess.run(
        ["openssl", "ec", "-in", str(tls_pki.key_file("zookeeper")), "-out", str(sec1)],
        check=True,
        capture_output=True,
        timeout=30,
    )
    legacy = ServerTls(tls_pki.cert_file("zookeeper"), sec1, tls_pki.ca_file)
    with pytest.raises(ConfigError, match="not a PKCS#8 key"):
        ZooKeeperServer(tmp_path / "d", tls=legacy).start()


def test_a_plain_port_is_bound_only_when_asked_for(tmp_path: Path, tls_pki: LocalPki) -> None:
    """The migration setting: a secure port and, because ``plain_port`` asks for it, a plain one beside it."""
    plain_port = free_port()
    tls = ServerTls(
        tls_pki.cert_file("zookeeper"), tls_pki.key_file("zookeeper"), tls_pki.ca_file, plain_port=plain_port
    )
    with ZooKeeperServer(tmp_path / "zk", tls=tls) as server:
        assert four_letter_word(server.host, plain_port, "ruok") == "imok"
        assert server.four_letter_word("ruok") == "imok"
        for target, auth in (
            (f"127.0.0.1:{plain_port}", None),
            (server.connect_string, _auth(zk_tls_keys(tls_pki, "client"))),
        ):
            client = zkutil.connect(target, session_timeout_ms=4000, auth=auth)
            try:
                assert "zookeeper" in client.get_children("/")
            finally:
                zkutil.close(client)


def test_missing_netty_jars_give_the_package_to_install(
    tmp_path: Path, tls_pki: LocalPki, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(zkserver, "NETTY_JARS", (tmp_path / "netty-codec.jar",))
    tls = ServerTls(tls_pki.cert_file("zookeeper"), tls_pki.key_file("zookeeper"), tls_pki.ca_file)
    with pytest.raises(ClusterError, match="apt-get install libnetty-java"):
        ZooKeeperServer(tmp_path / "zk", tls=tls).start()
    zkserver.classpath()  # Plain ZooKeeper does not need them.
