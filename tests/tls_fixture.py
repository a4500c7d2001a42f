"""Test certificates, made once per test session with ``openssl`` (see :mod:`waltz.local.certs`).

``tls_pki`` (session scope) is a :class:`~waltz.local.certs.LocalPki` with a CA and the certificates
``storage``, ``server``, ``client`` and ``zookeeper`` (each for IP:127.0.0.1 and DNS:localhost, usable by
servers and clients). ``stranger_pki`` is a second CA, which ``tls_pki`` does not trust, with one certificate,
``stranger``: one to present where it must be refused. ``tls_zookeeper`` is a ZooKeeper serving TLS only
with ``tls_pki``'s certificates. ``tests/conftest.py`` makes these fixtures available to every test;
:func:`tls_config`, :func:`tls_keys` and :func:`zk_tls_keys` turn them into settings.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from waltz.cluster.zkserver import ServerTls, ZooKeeperServer
from waltz.local.certs import LocalPki, make_local_pki
from waltz.tls import TlsConfig

NAMES = ("storage", "server", "client", "zookeeper")


@pytest.fixture(scope="session")
def tls_pki(tmp_path_factory: pytest.TempPathFactory) -> LocalPki:
    return make_local_pki(tmp_path_factory.mktemp("pki"), NAMES)


@pytest.fixture(scope="session")
def stranger_pki(tmp_path_factory: pytest.TempPathFactory) -> LocalPki:
    """Another CA and a ``stranger`` certificate signed by it."""
    return make_local_pki(tmp_path_factory.mktemp("stranger-pki"), ["stranger"])


@pytest.fixture(scope="session")
def tls_zookeeper(tmp_path_factory: pytest.TempPathFactory, tls_pki: LocalPki) -> Iterator[ZooKeeperServer]:
    """A ZooKeeper serving TLS only, requiring client certificates from ``tls_pki``; its own certificate is
    ``tls_pki``'s ``zookeeper``. Reach it with :func:`zk_tls_keys`."""
    tls = ServerTls(tls_pki.cert_file("zookeeper"), tls_pki.key_file("zookeeper"), tls_pki.ca_file)
    server = ZooKeeperServer(tmp_path_factory.mktemp("tls-zookeeper"), tls=tls)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def tls_config(pki: LocalPki, name: str | None, *, ca: bool = True, prefix: str = "ssl.") -> TlsConfig:
    """``name``'s certificate and key (None: no identity) and, with ``ca``, the PKI's CA."""
    return TlsConfig(
        cert_file=str(pki.cert_file(name)) if name else "",
        key_file=str(pki.key_file(name)) if name else "",
        ca_file=str(pki.ca_file) if ca else "",
        prefix=prefix,
    )


def tls_keys(pki: LocalPki, name: str | None, prefix: str, *, ca: bool = True) -> dict[str, str]:
    """The config keys for :func:`tls_config`, under ``prefix`` (e.g. ``"storage.ssl."``)."""
    keys: dict[str, str] = {}
    if name:
        keys[f"{prefix}certFile"] = str(pki.cert_file(name))
        keys[f"{prefix}keyFile"] = str(pki.key_file(name))
    if ca:
        keys[f"{prefix}caFile"] = str(pki.ca_file)
    return keys


def zk_tls_keys(pki: LocalPki, name: str | None, *, ca: bool = True) -> dict[str, object]:
    """``zookeeper.ssl.*``: TLS to ZooKeeper with ``name``'s certificate (None: none) and the PKI's CA."""
    return {"zookeeper.ssl.enabled": True, **tls_keys(pki, name, "zookeeper.ssl.", ca=ca)}
