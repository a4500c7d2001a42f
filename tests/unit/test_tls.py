"""TLS: building contexts from PEM files (and every way that can go wrong), and framed connections over TLS.

Certificates come from :mod:`tests.tls_fixture` (``openssl``, once per session). Connections run in-process
on loopback: mutual TLS round trips on asyncio and uvloop, keep-alives and timeouts over TLS, and each
mismatch (plain vs TLS, missing or untrusted certificate, wrong host) failing fast with a message that
says what is wrong.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import subprocess
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.tls_fixture import tls_config, tls_keys
from waltz.cli.common import cli_tls
from waltz.client.config import ClientConfig
from waltz.errors import BrokenResourceError, ConfigError
from waltz.local.certs import LocalPki
from waltz.protocol.framing import MAGIC_STORAGE
from waltz.server.config import ServerConfig
from waltz.storage.config import StorageConfig
from waltz.tls import TlsConfig
from waltz.transport import FramedConnection, RpcClient, open_connection, serve

pytestmark = pytest.mark.timeout(60)

T = TypeVar("T")
HOST = "127.0.0.1"
PROTO: dict[str, Any] = {"magic": MAGIC_STORAGE, "versions": (0,)}


def run(main: Coroutine[Any, Any, T], timeout_s: float = 10.0) -> T:
    async def bounded() -> T:
        async with asyncio.timeout(timeout_s):
            return await main

    return asyncio.run(bounded())


async def echo(conn: FramedConnection) -> None:
    while True:
        conn.send(await conn.receive())
        await conn.drain()


@asynccontextmanager
async def serving(ctx: ssl.SSLContext | None, host: str = HOST, **kwargs: Any) -> AsyncIterator[int]:
    async with await serve(
        host, 0, echo, hello_text="Waltz Storage Server", ssl=ctx, **PROTO, **kwargs
    ) as server:
        yield server.port


async def connect(port: int, ctx: ssl.SSLContext | None, host: str = HOST, **kwargs: Any) -> FramedConnection:
    options = {"hello_text": "Waltz Storage Client", "connect_timeout_ms": 3000, **PROTO, **kwargs}
    return await open_connection(host, port, ssl=ctx, **options)


def server_ctx(pki: LocalPki, *, mutual: bool = True) -> ssl.SSLContext:
    ctx = tls_config(pki, "storage", ca=mutual).server_context()
    assert ctx is not None
    return ctx


def client_ctx(pki: LocalPki, name: str | None = "client", **changes: Any) -> ssl.SSLContext:
    tls = tls_config(pki, name)
    if changes:
        tls = TlsConfig(**{**vars(tls), **changes})
    ctx = tls.client_context()
    assert ctx is not None
    return ctx


# ---------------------------------------------------------------------------------------- building contexts


def test_no_keys_means_plain_tcp() -> None:
    tls = TlsConfig()
    assert not tls.enabled
    assert tls.server_context() is None
    assert tls.client_context() is None
    tls.check("both")


def test_server_context_requires_client_certificates_only_with_a_ca(tls_pki: LocalPki) -> None:
    plain_auth = tls_config(tls_pki, "storage", ca=False).server_context()
    mutual = tls_config(tls_pki, "storage").server_context()
    assert plain_auth is not None
    assert mutual is not None
    assert plain_auth.verify_mode == ssl.CERT_NONE
    assert mutual.verify_mode == ssl.CERT_REQUIRED
    for ctx in (plain_auth, mutual):
        assert ctx.minimum_version == ssl.TLSVersion.TLSv1_2


def test_client_context_always_verifies_and_checks_hostnames_by_default(tls_pki: LocalPki) -> None:
    ctx = tls_config(tls_pki, None).client_context()
    assert ctx is not None
    assert ctx.verify_mode == ssl.CERT_REQUIRED
    assert ctx.check_hostname
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_2
    relaxed = TlsConfig(ca_file=str(tls_pki.ca_file), check_hostname=False).client_context()
    assert relaxed is not None
    assert relaxed.verify_mode == ssl.CERT_REQUIRED
    assert not relaxed.check_hostname


def test_client_without_a_ca_file_trusts_the_system_cas(tls_pki: LocalPki) -> None:
    ctx = TlsConfig(str(tls_pki.cert_file("client")), str(tls_pki.key_file("client"))).client_context()
    assert ctx is not None
    assert ctx.verify_mode == ssl.CERT_REQUIRED


@pytest.mark.parametrize(
    ("changes", "role", "message"),
    [
        ({"key_file": ""}, "listen", "ssl.certFile is set but ssl.keyFile is not"),
        ({"cert_file": ""}, "connect", "ssl.keyFile is set but ssl.certFile is not"),
        ({"cert_file": "", "key_file": ""}, "listen", "ssl.caFile is set but ssl.certFile and ssl.keyFile"),
        ({"cert_file": "/nonexistent/cert.pem"}, "listen", "ssl.certFile: cannot read /nonexistent/cert.pem"),
        ({"ca_file": "/nonexistent/ca.pem"}, "connect", "ssl.caFile: cannot read /nonexistent/ca.pem"),
        ({"ca_file": "/"}, "connect", "ssl.caFile: / is a directory"),
    ],
)
def test_bad_combinations_and_missing_files_name_the_key(
    tls_pki: LocalPki, changes: dict[str, str], role: str, message: str
) -> None:
    tls = TlsConfig(**{**vars(tls_config(tls_pki, "client")), **changes})
    with pytest.raises(ConfigError, match=message):
        tls.check(role)  # type: ignore[arg-type]


def test_a_key_that_does_not_match_its_certificate(tls_pki: LocalPki) -> None:
    tls = TlsConfig(str(tls_pki.cert_file("server")), str(tls_pki.key_file("client")), prefix="server.ssl.")
    with pytest.raises(ConfigError, match=r"server\.ssl\.keyFile: .*client-key\.pem is not the private key"):
        tls.server_context()


def test_files_that_are_not_pem(tls_pki: LocalPki, tmp_path: Path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("hello\n")
    cert, key = str(tls_pki.cert_file("client")), str(tls_pki.key_file("client"))
    with pytest.raises(ConfigError, match=r"ssl.certFile: .*junk.pem holds no PEM certificate"):
        TlsConfig(str(junk), key).server_context()
    with pytest.raises(ConfigError, match=r"ssl.keyFile: .*junk.pem holds no PEM private key"):
        TlsConfig(cert, str(junk)).server_context()
    with pytest.raises(ConfigError, match=r"ssl.caFile: .*junk.pem holds no PEM certificate"):
        TlsConfig(ca_file=str(junk)).client_context()
    # A certificate given as the key (PEM, but no key in it).
    with pytest.raises(ConfigError, match=r"ssl.keyFile: .* holds no PEM private key"):
        TlsConfig(cert, cert).server_context()


def test_an_encrypted_key_is_refused_without_prompting(tls_pki: LocalPki, tmp_path: Path) -> None:
    encrypted = tmp_path / "encrypted-key.pem"
    subprocess.run(
        [
            *("openssl", "pkey", "-in", str(tls_pki.key_file("client"))),
            *("-aes256", "-passout", "pass:secret", "-out", str(encrypted)),
        ],
        check=True,
        capture_output=True,
        stdin=subprocess.DEVNULL,
    )
    with pytest.raises(ConfigError, match=r"ssl.keyFile: .*encrypted-key.pem is encrypted"):
        TlsConfig(str(tls_pki.cert_file("client")), str(encrypted)).server_context()


# --------------------------------------------------------------------------------------------- config keys


def test_storage_config_reads_and_checks_storage_ssl_keys(tls_pki: LocalPki, tmp_path: Path) -> None:
    base = {
        "storage.port": 0,
        "storage.admin.port": 0,
        "storage.directory": str(tmp_path),
        "storage.cluster.key": "6d4f7c44-2c0f-4b5e-9a51-8d7a2f64a3b1",
        "storage.cluster.numPartitions": 1,
    }
    assert not StorageConfig.from_mapping(base).tls.enabled
    config = StorageConfig.from_mapping({**base, **tls_keys(tls_pki, "storage", "storage.ssl.")})
    assert config.tls.enabled
    assert config.tls.ca_file == str(tls_pki.ca_file)
    with pytest.raises(ConfigError, match=r"storage.ssl.caFile is set but"):
        StorageConfig.from_mapping({**base, "storage.ssl.caFile": str(tls_pki.ca_file)})
    # Java keystore keys do not apply: a typo or a leftover must not silently mean "no TLS".
    with pytest.raises(ConfigError, match=r"unknown key 'storage.ssl.keyStore.location'"):
        StorageConfig.from_mapping({**base, "storage.ssl.keyStore.location": "x.jks"})


def test_server_config_uses_server_ssl_for_both_sides(tls_pki: LocalPki) -> None:
    base = {"zookeeper.connectString": "127.0.0.1:1", "cluster.root": "/w", "server.port": 0}
    config = ServerConfig.from_mapping({**base, **tls_keys(tls_pki, "server", "server.ssl.")})
    assert config.tls.server_context() is not None
    assert config.tls.client_context() is not None
    with pytest.raises(ConfigError, match=r"server\.ssl\.keyFile is set but server\.ssl\.certFile is not"):
        ServerConfig.from_mapping({**base, "server.ssl.keyFile": str(tls_pki.key_file("server"))})


def test_client_config_reads_client_ssl_keys(tls_pki: LocalPki) -> None:
    base = {"zookeeper.connectString": "127.0.0.1:1", "zookeeper.sessionTimeout": 5000, "cluster.root": "/w"}
    assert not ClientConfig.from_dict(base).tls.enabled
    config = ClientConfig.from_dict(
        {**base, **tls_keys(tls_pki, "client", "client.ssl."), "client.ssl.checkHostname": "false"}
    )
    assert config.tls.enabled
    assert not config.tls.check_hostname
    assert config.ssl["certFile"] == str(tls_pki.cert_file("client"))
    with pytest.raises(ConfigError, match=r"client.ssl.caFile: cannot read"):
        ClientConfig.from_dict({**base, "client.ssl.caFile": "/nonexistent.pem"})
    # Built in code, the same checks apply.
    with pytest.raises(ConfigError, match=r"client.ssl.certFile is set but client.ssl.keyFile is not"):
        ClientConfig(ssl={"certFile": str(tls_pki.cert_file("client"))})


def test_cli_config_uses_ssl_keys_or_falls_back_to_client_ssl(tls_pki: LocalPki) -> None:
    base = {"zookeeper.connectString": "127.0.0.1:1", "cluster.root": "/w"}
    assert not cli_tls(base).enabled
    assert cli_tls({**base, **tls_keys(tls_pki, "client", "ssl.")}).has_identity
    # A client config (like `waltz local up`'s client.yaml) works as a CLI config too.
    fallback = cli_tls({**base, **tls_keys(tls_pki, "client", "client.ssl.")})
    assert fallback.has_identity
    assert fallback.prefix == "client.ssl."


# -------------------------------------------------------------------------------------- connections over TLS


def test_mutual_tls_round_trip(tls_pki: LocalPki) -> None:
    async def main() -> None:
        async with serving(server_ctx(tls_pki)) as port, await connect(port, client_ctx(tls_pki)) as conn:
            assert conn.peer_hello_text == "Waltz Storage Server"
            payloads = [bytes([i]) * (1 + i * 997) for i in range(100)] + [bytes(1 << 20)]
            for p in payloads:
                conn.send(p)
            await conn.drain()
            for p in payloads:
                assert await conn.receive() == p

    run(main())


def test_mutual_tls_round_trip_on_uvloop(tls_pki: LocalPki) -> None:
    # uvloop is a core dependency (the entry points run on it), so it is imported, never skipped.
    import uvloop

    async def main() -> None:
        assert "uvloop" in type(asyncio.get_running_loop()).__module__
        async with asyncio.timeout(10):
            async with serving(server_ctx(tls_pki)) as port, await connect(port, client_ctx(tls_pki)) as conn:
                conn.send(b"over uvloop")
                await conn.drain()
                assert await conn.receive() == b"over uvloop"

    uvloop.run(main())


def test_keep_alives_flow_over_tls(tls_pki: LocalPki) -> None:
    async def main() -> None:
        async with serving(server_ctx(tls_pki)) as port:
            conn = await connect(port, client_ctx(tls_pki), keep_alive_interval_s=0.02)
            async with conn:
                await asyncio.sleep(0.2)  # About ten keep-alives, which the server skips.
                conn.send(b"after keep-alives")
                await conn.drain()
                assert await conn.receive() == b"after keep-alives"

    run(main())


def test_hostname_is_checked_unless_disabled(tls_pki: LocalPki) -> None:
    """The certificates name 127.0.0.1 and localhost; 127.0.0.2 (also loopback on Linux) is neither."""

    async def main() -> None:
        async with serving(server_ctx(tls_pki, mutual=False), host="127.0.0.2") as port:
            with pytest.raises(BrokenResourceError, match=r"not trusted: IP address mismatch"):
                await connect(port, client_ctx(tls_pki), host="127.0.0.2")
            relaxed = client_ctx(tls_pki, check_hostname=False)
            async with await connect(port, relaxed, host="127.0.0.2") as conn:
                conn.send(b"ok")
                await conn.drain()
                assert await conn.receive() == b"ok"
        ctx = client_ctx(tls_pki)
        async with (
            serving(server_ctx(tls_pki, mutual=False)) as port,
            await connect(port, ctx, host="localhost") as conn,
        ):
            conn.send(b"by name")
            await conn.drain()
            assert await conn.receive() == b"by name"

    run(main())


def test_plain_client_to_tls_server_fails_fast(tls_pki: LocalPki) -> None:
    async def main() -> None:
        async with serving(server_ctx(tls_pki)) as port:
            start = asyncio.get_running_loop().time()
            # Not retriable: a probe found that the listener completes a TLS handshake.
            with pytest.raises(ConfigError, match=r"wants TLS and this side has no TLS settings"):
                await connect(port, None)
            assert asyncio.get_running_loop().time() - start < 2.0

    run(main())


def test_tls_client_to_plain_server_fails_fast_on_both_sides(
    tls_pki: LocalPki, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        async with serving(None) as port:
            start = asyncio.get_running_loop().time()
            with pytest.raises(
                BrokenResourceError, match=r"TLS handshake with .* failed.*does the peer serve TLS"
            ):
                await connect(port, client_ctx(tls_pki))
            assert asyncio.get_running_loop().time() - start < 2.0

    with caplog.at_level(logging.WARNING, logger="waltz.transport"):
        run(main())
    assert any("the peer speaks TLS but this side" in r.getMessage() for r in caplog.records)


def test_mutual_tls_refuses_a_client_without_a_certificate(tls_pki: LocalPki) -> None:
    async def main() -> None:
        async with serving(server_ctx(tls_pki)) as port:
            with pytest.raises(BrokenResourceError, match=r"does the peer require a client certificate"):
                await connect(port, client_ctx(tls_pki, None))

    run(main())


def test_mutual_tls_refuses_a_certificate_from_another_ca(tls_pki: LocalPki, stranger_pki: LocalPki) -> None:
    stranger = TlsConfig(
        str(stranger_pki.cert_file("stranger")), str(stranger_pki.key_file("stranger")), str(tls_pki.ca_file)
    ).client_context()

    async def main() -> None:
        async with serving(server_ctx(tls_pki)) as port:
            with pytest.raises(BrokenResourceError, match=r"not trust this one"):
                await connect(port, stranger)

    run(main())


def test_a_server_certificate_from_another_ca_is_not_trusted(
    tls_pki: LocalPki, stranger_pki: LocalPki
) -> None:
    trusts_other_ca = TlsConfig(ca_file=str(stranger_pki.ca_file)).client_context()

    async def main() -> None:
        async with serving(server_ctx(tls_pki, mutual=False)) as port:
            with pytest.raises(BrokenResourceError, match=r"not trusted: .*certificate"):
                await connect(port, trusts_other_ca)

    run(main())


def test_a_silent_peer_is_dropped_within_the_handshake_timeout(tls_pki: LocalPki) -> None:
    async def main() -> None:
        async with serving(server_ctx(tls_pki), handshake_timeout_ms=200) as port:
            reader, writer = await asyncio.open_connection(HOST, port)
            try:
                async with asyncio.timeout(3):
                    assert await reader.read() == b""  # The server closes it: no TLS handshake came.
            finally:
                writer.close()
                await writer.wait_closed()

    run(main())


def test_connect_timeout_covers_a_peer_that_never_completes_the_handshake(tls_pki: LocalPki) -> None:
    async def main() -> None:
        accepted: list[asyncio.StreamWriter] = []

        def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.append(writer)  # Accept and say nothing.

        server = await asyncio.start_server(silent, HOST, 0)
        async with server:
            port = server.sockets[0].getsockname()[1]
            start = asyncio.get_running_loop().time()
            with pytest.raises(BrokenResourceError, match=r"timed out after 300 ms"):
                await connect(port, client_ctx(tls_pki), connect_timeout_ms=300)
            assert asyncio.get_running_loop().time() - start < 2.0
            for writer in accepted:
                writer.close()
                await writer.wait_closed()

    run(main())


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_rpc_over_a_connection_with_mutual_tls(tls_pki: LocalPki, loop: str) -> None:
    """The server's storage connections (an RpcClient over ``open_connection``): responses read from the
    TLS transport's callback, on both loops; a refusal reads as a plain connection's does."""
    import uvloop

    def seq_of(payload: bytes) -> int:
        return payload[0]

    async def main() -> None:
        async with asyncio.timeout(10), serving(server_ctx(tls_pki)) as port:
            conn = await connect(port, client_ctx(tls_pki))
            async with RpcClient(
                conn, encode=bytes, decode=bytes, request_seq=seq_of, response_seq=seq_of
            ) as rpc:
                payloads = [bytes([i]) * (1 + i * 997) for i in range(100)]
                assert await asyncio.gather(*(rpc.call(p, timeout_ms=5000) for p in payloads)) == payloads
            with pytest.raises(BrokenResourceError, match=r"does the peer require a client certificate"):
                await connect(port, client_ctx(tls_pki, None))
            with pytest.raises(ConfigError, match=r"wants TLS and this side has no TLS settings"):
                await connect(port, None)

    if loop == "uvloop":
        uvloop.run(main())
    else:
        run(main())
