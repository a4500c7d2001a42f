"""Fixtures shared by every test tier.

ZooKeeper (real, Debian's package; see :mod:`waltz.cluster.zkserver`)
    ``zookeeper``          session-scoped ZooKeeperServer on a free loopback port, stopped at the end.
    ``zk_chroot``          a fresh chroot ``/test-<hex>`` per test, deleted afterwards.
    ``zk_connect_string``  ``127.0.0.1:<port>/test-<hex>``: clients see only their test's tree.
    ``zk_client_factory``  ``make(session_timeout_ms=4000, connect_string=None)`` -> started KazooClient;
                           every client made is stopped at teardown.
    ``zk``                 one started client in the chroot.
    ``zk_proxy``           a TCP proxy to ZooKeeper whose ``cut(seconds)`` simulates a network outage.
    ``expire_session``     ``expire_session(client)``: expire a client's session on the server (the second-
                           client trick) and wait until the client sees LOST.
    ``drop_connection``    ``drop_connection(client)``: break the client's TCP connection once (it reconnects
                           at once, same session).
When a test that used ZooKeeper fails, the tail of ZooKeeper's log is added to its report.
TLS (``tests/tls_fixture.py``): ``tls_pki``, ``stranger_pki``: session-scoped throwaway CAs and certificates;
``tls_zookeeper``: a session-scoped ZooKeeper serving TLS only, started on first use.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from hypothesis import HealthCheck, settings
from kazoo.client import KazooClient
from kazoo.protocol.states import KazooState

from tests.tls_fixture import stranger_pki, tls_pki, tls_zookeeper  # noqa: F401 - session fixtures
from waltz.cluster import zk as zkutil
from waltz.cluster.zkserver import ZooKeeperServer

# Property tests check what is generated, not how fast: on a shared or loaded machine a slow example must not
# fail a run (a deadline miss replays as "Flaky", a slow generator trips a health check).
settings.register_profile(
    "waltz", deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.load_profile("waltz")


# ----------------------------------------------------------------------------------------------- ZooKeeper

TEST_SESSION_TIMEOUT_MS = 4000
"""Short sessions so expiry tests are fast (the server's minimum is 1000 ms)."""

_ZK_SERVER_KEY = pytest.StashKey[ZooKeeperServer]()


@pytest.fixture(scope="session")
def zookeeper(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ZooKeeperServer]:
    server = ZooKeeperServer(tmp_path_factory.mktemp("zookeeper"), die_with_parent=True)
    server.start()
    request.config.stash[_ZK_SERVER_KEY] = server
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def _zk_admin(zookeeper: ZooKeeperServer) -> Iterator[KazooClient]:
    client = zkutil.connect(zookeeper.connect_string, session_timeout_ms=10000)
    try:
        yield client
    finally:
        zkutil.close(client)


@pytest.fixture
def zk_chroot(_zk_admin: KazooClient) -> Iterator[str]:
    chroot = f"/test-{uuid.uuid4().hex[:12]}"
    _zk_admin.create(chroot)
    try:
        yield chroot
    finally:
        with contextlib.suppress(Exception):
            _zk_admin.delete(chroot, recursive=True)


@pytest.fixture
def zk_connect_string(zookeeper: ZooKeeperServer, zk_chroot: str) -> str:
    return f"{zookeeper.connect_string}{zk_chroot}"


ClientFactory = Callable[..., KazooClient]


@pytest.fixture
def zk_client_factory(zk_connect_string: str) -> Iterator[ClientFactory]:
    made: list[KazooClient] = []

    def make(
        session_timeout_ms: int = TEST_SESSION_TIMEOUT_MS, connect_string: str | None = None
    ) -> KazooClient:
        client = zkutil.connect(
            connect_string or zk_connect_string,
            session_timeout_ms=session_timeout_ms,
            connect_timeout_ms=10000,
        )
        made.append(client)
        return client

    try:
        yield make
    finally:
        for client in made:
            zkutil.close(client)


@pytest.fixture
def zk(zk_client_factory: ClientFactory) -> KazooClient:
    return zk_client_factory()


def _wait_for_state(client: KazooClient, wanted: str, action: Callable[[], None], timeout_s: float) -> None:
    seen = threading.Event()

    def listener(state: str) -> None:
        if state == wanted:
            seen.set()

    client.add_listener(listener)
    try:
        action()
        if not seen.wait(timeout_s):
            raise TimeoutError(f"client did not reach {wanted} within {timeout_s} s")
    finally:
        client.remove_listener(listener)


@pytest.fixture
def expire_session(zookeeper: ZooKeeperServer) -> Callable[..., None]:
    """Expire ``client``'s session for real: a second client attaches to the same session id and password
    and closes it; the server then ends the session, and ``client`` sees LOST on its next contact."""

    def expire(client: KazooClient, timeout_s: float = 15.0) -> None:
        # A client still reconnecting (after a dropped connection) has no live session id to borrow yet.
        deadline = time.monotonic() + timeout_s
        while (client_id := client.client_id) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"client had no live session to expire within {timeout_s} s")
            time.sleep(0.02)
        session_id, password = client_id

        def kill_session() -> None:
            twin = KazooClient(hosts=zookeeper.connect_string, client_id=(session_id, password), timeout=4.0)
            twin.start(timeout=10)
            twin.stop()
            twin.close()

        _wait_for_state(client, KazooState.LOST, kill_session, timeout_s)

    return expire


@pytest.fixture
def drop_connection() -> Callable[..., None]:
    """Break ``client``'s connection once, as a network blip would; it reconnects with the same session.

    Uses kazoo's own test hook (the same one ``kazoo.testing`` uses): the connection thread raises
    ConnectionDropped, closes the socket and reconnects.
    """
    from kazoo.protocol.connection import _CONNECTION_DROP

    def drop(client: KazooClient, timeout_s: float = 10.0) -> None:
        _wait_for_state(
            client,
            KazooState.SUSPENDED,
            lambda: client._call(_CONNECTION_DROP, client.handler.async_result()),
            timeout_s,
        )

    return drop


class TcpProxy:
    """A loopback TCP relay in front of ZooKeeper; :meth:`cut` simulates a network outage.

    While cut, existing connections are closed and new ones are accepted and closed at once, so a client
    keeps its session but cannot reach the server until the outage ends.
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._cut_until = 0.0
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._spawn(self._accept_loop)

    def _spawn(self, target: Callable[..., None], *args: object) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        t.start()
        self._threads.append(t)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            if time.monotonic() < self._cut_until:
                conn.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                conn.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._conns += [conn, upstream]
            self._spawn(self._pump, conn, upstream)
            self._spawn(self._pump, upstream, conn)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                self._relayed(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    def _relayed(self, data: bytes) -> None:
        """Called (on a pump thread) with every chunk relayed, in either direction: a hook for subclasses."""

    def cut(self, seconds: float) -> None:
        """Close every relayed connection and refuse new ones for ``seconds`` (returns at once)."""
        self._cut_until = time.monotonic() + seconds
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed = True
        self.cut(0)
        self._listener.close()
        for t in self._threads:
            t.join(timeout=2)


@pytest.fixture
def zk_proxy(zookeeper: ZooKeeperServer, zk_chroot: str) -> Iterator[TcpProxy]:
    """A proxy to the session's ZooKeeper; connect with ``f"127.0.0.1:{proxy.port}{zk_chroot}"``."""
    proxy = TcpProxy(zookeeper.host, zookeeper.port)
    try:
        yield proxy
    finally:
        proxy.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    if report.failed and "zookeeper" in getattr(item, "fixturenames", ()):
        server = item.config.stash.get(_ZK_SERVER_KEY, None)
        if server is not None:
            report.sections.append(("ZooKeeper log (tail)", server.log_tail(80)))
    return report
