"""ZooKeeper client helpers: connecting, the znode layout, and kazoo errors mapped onto Waltz's tree.

Everything here is blocking (kazoo's synchronous API) and meant to be called from a plain thread, a CLI, or
from asyncio code through ``asyncio.to_thread``. Errors that reach callers are always Waltz errors:

* a version-checked write or transaction that lost a race -> :class:`~waltz.errors.ConcurrentUpdateError`
  (retriable: re-read and try again);
* ZooKeeper unreachable, connection lost mid-call, session expired -> :class:`~waltz.errors.ClusterError`;
* a znode that should exist but does not, or holds unreadable bytes -> :class:`~waltz.errors.MetadataError`;
* a znode this process's identity may not touch (ZooKeeper ACLs) -> :class:`~waltz.errors.MetadataError`
  saying so.

Access control (:class:`ZkAuth`, see docs/security.md): every process may authenticate with ZooKeeper's
``digest`` scheme (``zookeeper.authFile``: a file holding ``user:password``). A process that authenticates
creates every znode with an ACL that gives its own identity all permissions and the identities listed in
``zookeeper.aclReaders`` (digest ids ``user:base64(sha1(user:password))``, see :func:`digest_id`) read access,
so anonymous sessions can neither read the cluster key nor write metadata. Without ``zookeeper.authFile``
nothing changes: znodes are created open, as before.

Transport (:class:`ZkTls`): with ``zookeeper.ssl.enabled`` every session runs over TLS to ZooKeeper's secure
client port, so digest passwords and metadata (the cluster key among them) never cross the network in clear.
``zookeeper.ssl.caFile`` is the CA ZooKeeper's certificate must chain to (default: the system's CAs),
``zookeeper.ssl.certFile``/``keyFile`` the client certificate a server with ``ssl.clientAuth=need`` demands,
``zookeeper.ssl.checkHostname`` (default true) whether ZooKeeper's certificate must name the host connected
to. The files are checked when the configuration is read (bounded reads, errors naming the key, as
:mod:`waltz.tls` does for Waltz's own ports), and read again, the same way, at every (re)connection, so a
certificate replaced in place (atomically) is picked up at the next reconnection.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import socket
import ssl
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kazoo.client import KazooClient
from kazoo.exceptions import (
    AuthFailedError,
    BadVersionError,
    ConnectionLoss,
    KazooException,
    NoAuthError,
    NodeExistsError,
    NoNodeError,
    NotEmptyError,
    OperationTimeoutError,
    SessionExpiredError,
)
from kazoo.handlers.threading import KazooTimeoutError, SequentialThreadingHandler
from kazoo.retry import KazooRetry
from kazoo.security import ACL, Id, Permissions

from waltz.config import Key, host_port
from waltz.errors import (
    ClusterError,
    ConcurrentUpdateError,
    ConfigError,
    MetadataError,
    ZooKeeperUnavailableError,
)
from waltz.tls import MIN_TLS_VERSION, TlsConfig

log = logging.getLogger(__name__)

KAZOO_LOG = logging.getLogger("waltz.cluster.zk.kazoo")
"""The logger of every kazoo client :func:`connect` makes (kazoo's ``logger`` argument), behind
:class:`_KazooFilter`: kazoo warns on every failed connection attempt ("Connection dropped", "Connection
time-out", several per second while ZooKeeper is away), and :class:`_StateLog` says the same in one line per
session state change. Its records below ERROR pass only when this logger is enabled for DEBUG (``-v``, or an
application that sets it or the root logger to DEBUG), in servers, storage nodes and applications alike."""


class _KazooFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or KAZOO_LOG.isEnabledFor(logging.DEBUG)


KAZOO_LOG.addFilter(_KazooFilter())

T = TypeVar("T")

DEFAULT_SESSION_TIMEOUT_MS = 30000
DEFAULT_CONNECT_TIMEOUT_MS = 10000
MAX_AUTH_FILE_BYTES = 4096
"""An auth file larger than this is not a ``user:password`` line; refuse it rather than read it whole."""
ZK_SSL_PREFIX = "zookeeper.ssl."
TLS_PROBE_TIMEOUT_S = 2.0
"""How long the diagnosis of a failed TLS connection (:func:`_tls_diagnosis`) may take per host."""
MAX_PROBED_HOSTS = 3


def digest_id(credentials: str) -> str:
    """ZooKeeper's digest id of ``user:password``: ``user:base64(sha1("user:password"))`` (what ACLs name)."""
    user = credentials.split(":", 1)[0]
    return f"{user}:{base64.b64encode(hashlib.sha1(credentials.encode()).digest()).decode()}"


@dataclass(frozen=True)
class ZkTls:
    """How a process reaches ZooKeeper: plain TCP (the default instance) or TLS (module docstring).

    ``files`` holds the paths (``zookeeper.ssl.certFile``/``keyFile``/``caFile``/``checkHostname``), already
    checked by :meth:`from_config`; building an instance in code skips that check (tests do, on purpose).
    """

    enabled: bool = False
    files: TlsConfig = field(default_factory=lambda: TlsConfig(prefix=ZK_SSL_PREFIX))

    @classmethod
    def from_config(cls, config: Mapping[str, Any], source: str = "config") -> ZkTls:
        """From the ``zookeeper.ssl.*`` keys of a parsed config; ConfigError naming the key and file when a
        file is missing, unreadable, larger than 1 MiB, not PEM, or a key that does not match its
        certificate."""
        raw = config.get(f"{ZK_SSL_PREFIX}enabled", False)
        if isinstance(raw, str) and raw.strip().lower() in ("true", "false", "yes", "no", "on", "off"):
            raw = raw.strip().lower() in ("true", "yes", "on")
        if not isinstance(raw, bool):
            raise ConfigError(f"{source}: {ZK_SSL_PREFIX}enabled: expected true or false, got {raw!r}")
        files = TlsConfig.from_config(config, ZK_SSL_PREFIX, role="connect", source=source)
        if files.enabled and not raw:
            # Files without the switch are a half-done setup: connecting in clear would silently send the
            # digest password over the network the operator meant to protect.
            raise ConfigError(
                f"{source}: {ZK_SSL_PREFIX}certFile/keyFile/caFile are set but {ZK_SSL_PREFIX}enabled is not "
                "true; set it to connect to ZooKeeper's secure port, or remove the files"
            )
        return cls(raw, files)

    def kazoo_args(self) -> dict[str, Any]:
        """The keyword arguments of :class:`kazoo.client.KazooClient` for this setting."""
        if not self.enabled:
            return {}
        return {"use_ssl": True, "handler": _TlsHandler(self)}

    def describe(self) -> str:
        if not self.enabled:
            return "plain TCP"
        return "TLS with a client certificate" if self.files.has_identity else "TLS"


class _TlsHandler(SequentialThreadingHandler):  # type: ignore[misc]  # kazoo has no type hints
    """kazoo's threading handler, except that Waltz makes the TLS connections itself.

    kazoo's own TLS path leaks the socket of every failed handshake, reads the key files without a bound and
    accepts TLS below 1.2. Here each (re)connection builds its context with :mod:`waltz.tls` (bounded reads,
    TLS 1.2 minimum, the files read again so a replaced certificate is picked up), and a failed handshake
    closes its socket. Failures are OSErrors, which kazoo treats as a dropped connection and retries.
    """

    def __init__(self, tls: ZkTls) -> None:
        super().__init__()
        self._tls = tls

    def create_connection(  # type: ignore[no-untyped-def]
        self, address, hostname=None, timeout=None, use_ssl=False, **kwargs
    ):
        if not use_ssl:
            return super().create_connection(address, hostname=hostname, timeout=timeout, **kwargs)
        try:
            ctx = _tls_context(self._tls)
        except ConfigError as e:
            raise OSError(f"ZooKeeper TLS settings unusable: {e}") from None
        raw = socket.create_connection(address, timeout)
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # The handshake runs here, bounded by the socket's timeout; on failure the SSL socket closes.
            return ctx.wrap_socket(raw, server_hostname=hostname)
        except BaseException:
            raw.close()
            raise


@dataclass(frozen=True)
class ZkAuth:
    """How one process authenticates with ZooKeeper, how it reaches it, and which ACL its new znodes get
    (module docstring).

    ``credentials`` is ``user:password`` ("" = anonymous); ``readers`` are digest ids granted READ; ``tls``
    is the transport (plain by default).
    """

    credentials: str = ""
    readers: tuple[str, ...] = ()
    tls: ZkTls = field(default_factory=ZkTls)

    @property
    def enabled(self) -> bool:
        return bool(self.credentials)

    @property
    def user(self) -> str:
        return self.credentials.split(":", 1)[0]

    def auth_data(self) -> list[tuple[str, str]] | None:
        return [("digest", self.credentials)] if self.enabled else None

    def default_acl(self) -> list[ACL] | None:
        """All permissions for this digest identity, READ for the readers; None when anonymous (znodes are
        then created open, ZooKeeper's default).

        The identity is named (``digest:user:hash``), not ZooKeeper's ``auth`` scheme ("every id the creating
        session holds"): over TLS a session also holds its certificate's ``x509`` id, and ``auth`` would
        hand the creator's certificate all rights, so whoever holds a copy of a server's certificate could
        rewrite metadata without the cluster's password. Named, the ACL is the same with or without TLS."""
        if not self.enabled:
            return None
        return [
            ACL(Permissions.ALL, Id("digest", digest_id(self.credentials))),
            *(ACL(Permissions.READ, Id("digest", r)) for r in self.readers),
        ]

    @classmethod
    def from_config(cls, config: Mapping[str, Any], source: str = "config") -> ZkAuth:
        """From ``zookeeper.authFile``, ``zookeeper.aclReaders`` and ``zookeeper.ssl.*`` of a parsed config
        (absent: anonymous, plain TCP)."""
        tls = ZkTls.from_config(config, source)
        path = str(config.get("zookeeper.authFile", "") or "").strip()
        readers_raw = config.get("zookeeper.aclReaders", "") or ""
        readers = tuple(r.strip() for r in str(readers_raw).split(",") if r.strip())
        for r in readers:
            if r.count(":") != 1 or not all(r.split(":")):
                raise ConfigError(f"{source}: zookeeper.aclReaders: {r!r} is not a digest id user:hash")
        if not path:
            if readers:
                raise ConfigError(f"{source}: zookeeper.aclReaders needs zookeeper.authFile")
            return cls(tls=tls)
        return cls(read_auth_file(path, source), readers, tls)


def read_auth_file(path: str, source: str = "config") -> str:
    """The ``user:password`` line of an auth file (bounded read; ConfigError naming the key otherwise)."""
    try:
        with Path(path).open("rb") as f:
            raw = f.read(MAX_AUTH_FILE_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"{source}: zookeeper.authFile: cannot read {path}: {e.strerror or e}") from None
    if len(raw) > MAX_AUTH_FILE_BYTES:
        raise ConfigError(f"{source}: zookeeper.authFile: {path} is not a user:password line (too long)")
    text = raw.decode("utf-8", errors="replace").strip()
    user, sep, password = text.partition(":")
    if not sep or not user or not password or "\n" in text:
        raise ConfigError(f"{source}: zookeeper.authFile: {path} must hold one line user:password")
    return text


def zk_auth_keys() -> list[Key]:
    """The ZooKeeper access-control and transport keys every component's schema carries."""
    return [
        Key(
            "zookeeper.authFile", str, "", "file with the digest credentials user:password (empty: anonymous)"
        ),
        Key(
            "zookeeper.aclReaders", str, "", "digest ids user:hash given READ on znodes this process creates"
        ),
        *zk_tls_keys(),
    ]


def zk_tls_keys() -> list[Key]:
    """The ``zookeeper.ssl.*`` keys (see :class:`ZkTls`)."""
    p = ZK_SSL_PREFIX
    return [
        Key(f"{p}enabled", bool, False, "connect to ZooKeeper over TLS (its secureClientPort)"),
        Key(f"{p}certFile", str, "", "PEM client certificate presented to ZooKeeper"),
        Key(f"{p}keyFile", str, "", "PEM private key of certFile (unencrypted)"),
        Key(f"{p}caFile", str, "", "PEM CA ZooKeeper's certificate must chain to (empty: system CAs)"),
        Key(f"{p}checkHostname", bool, True, "ZooKeeper's certificate must name the host connected to"),
    ]


@dataclass(frozen=True)
class ClusterPaths:
    """The znode layout under one cluster root (see docs/zookeeper.md)."""

    root: str

    def __post_init__(self) -> None:
        if not self.root.startswith("/") or (self.root != "/" and self.root.endswith("/")):
            raise ClusterError(f"cluster root must be an absolute znode path, got {self.root!r}")
        if self.root == "/":
            raise ClusterError("the cluster root cannot be the ZooKeeper root '/'")

    @property
    def server_descriptors(self) -> str:
        return f"{self.root}/serverDescriptors"

    @property
    def server_descriptor_prefix(self) -> str:
        return f"{self.root}/serverDescriptors/s_"

    @property
    def ids(self) -> str:
        return f"{self.root}/ids"

    @property
    def client_ids(self) -> str:
        return f"{self.root}/ids/client"

    @property
    def server_ids(self) -> str:
        return f"{self.root}/ids/server"

    @property
    def store(self) -> str:
        return f"{self.root}/store"

    @property
    def partitions(self) -> str:
        return f"{self.root}/store/partition"

    def partition(self, partition_id: int) -> str:
        return f"{self.root}/store/partition/{partition_id}"

    @property
    def replica_assignments(self) -> str:
        return f"{self.root}/store/assignment"

    @property
    def trim_points(self) -> str:
        return f"{self.root}/store/trim"

    @property
    def retention(self) -> str:
        return f"{self.root}/store/retention"

    @property
    def groups(self) -> str:
        return f"{self.root}/store/group"

    @property
    def connections(self) -> str:
        return f"{self.root}/store/connection"

    @property
    def features(self) -> str:
        return f"{self.root}/features"

    @property
    def processes(self) -> str:
        return f"{self.root}/processes"

    def process(self, kind: str, name: str) -> str:
        return f"{self.root}/processes/{kind}-{name}"

    @property
    def admin_lock(self) -> str:
        return f"{self.root}/store/adminLock"


def connect(
    connect_string: str,
    *,
    session_timeout_ms: int = DEFAULT_SESSION_TIMEOUT_MS,
    connect_timeout_ms: int = DEFAULT_CONNECT_TIMEOUT_MS,
    auth: ZkAuth | None = None,
) -> KazooClient:
    """Start a kazoo client and wait until it has a session.

    ``connect_string`` is ``host:port[,host:port...][/chroot]``. Raises ClusterError (and leaves no thread
    behind) when no server answers within ``connect_timeout_ms``; over TLS the error says why the handshake
    failed when it did (a refused client certificate, an untrusted server certificate, a port that does not
    speak TLS). Once connected, the client keeps reconnecting by itself after a drop, and opens a new session
    after an expiry. With ``auth`` the session authenticates (digest) and creates znodes with ``auth``'s ACL,
    over ``auth.tls``.
    """
    auth = auth or ZkAuth()
    client = KazooClient(
        hosts=connect_string,
        timeout=session_timeout_ms / 1000.0,
        auth_data=auth.auth_data(),
        default_acl=auth.default_acl(),
        # Reconnect forever with a capped back-off: a server process must survive a ZooKeeper outage.
        connection_retry=KazooRetry(max_tries=-1, delay=0.1, max_delay=1.0),
        # Individual commands are retried across a connection drop, within the session timeout.
        command_retry=KazooRetry(max_tries=3, delay=0.1, max_delay=1.0),
        logger=KAZOO_LOG,
        **auth.tls.kazoo_args(),
    )
    client.add_listener(_StateLog(connect_string, auth.tls))
    try:
        client.start(timeout=connect_timeout_ms / 1000.0)
    except KazooTimeoutError:
        close(client)
        # kazoo retries a failed handshake like any dropped connection, so all it reports is the time-out;
        # one handshake of our own with the same settings finds the reason.
        reason = _tls_diagnosis(connect_string, auth.tls) if auth.tls.enabled else None
        if reason is not None:
            raise ClusterError(
                f"cannot connect to ZooKeeper at {connect_string} over TLS: {reason}"
            ) from None
        hint = "" if auth.tls.enabled else " (if it serves TLS only, set zookeeper.ssl.enabled and its files)"
        raise ClusterError(
            f"cannot connect to ZooKeeper at {connect_string}: no answer within {connect_timeout_ms} ms{hint}"
        ) from None
    except AuthFailedError:
        close(client)
        raise ClusterError(
            f"cannot connect to ZooKeeper at {connect_string}: authentication as {auth.user!r} failed"
        ) from None
    except (KazooException, OSError, ValueError) as e:
        close(client)
        reason = str(e) or type(e).__name__
        raise ClusterError(f"cannot connect to ZooKeeper at {connect_string}: {reason}") from None
    return client


def _hosts(connect_string: str) -> list[tuple[str, int]]:
    """``(host, port)`` of each server in a connect string (chroot dropped, default port 2181)."""
    found: list[tuple[str, int]] = []
    for part in connect_string.split("/", 1)[0].split(","):
        try:
            found.append(host_port(part, default_port=2181, what="ZooKeeper server"))
        except ConfigError:
            continue  # Not probed: the connect itself says what is wrong with it.
    return found


def _tls_context(tls: ZkTls) -> ssl.SSLContext:
    """A client context for ``tls``: its CA (else the system's), its certificate, its hostname rule."""
    ctx = tls.files.client_context("ZooKeeper TLS") if tls.files.enabled else None
    if ctx is None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = MIN_TLS_VERSION
        ctx.check_hostname = tls.files.check_hostname
        ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)
    return ctx


def _tls_diagnosis(connect_string: str, tls: ZkTls, timeout_s: float = TLS_PROBE_TIMEOUT_S) -> str | None:
    """Why a TLS session with the first reachable server fails, in words naming the key to look at; None
    when no server is reachable or the handshake and a ``ruok`` went through (the failure is elsewhere)."""
    try:
        ctx = _tls_context(tls)
    except (ConfigError, ssl.SSLError, OSError) as e:
        return f"cannot build the TLS context: {e}"
    for host, port in _hosts(connect_string)[:MAX_PROBED_HOSTS]:
        try:
            # Under TLS 1.3 the server judges the client certificate after the handshake: its verdict (an
            # alert) arrives with the first answer, so ask a question.
            with (
                socket.create_connection((host, port), timeout=timeout_s) as raw,
                ctx.wrap_socket(raw, server_hostname=host) as s,
            ):
                s.sendall(b"ruok")
                s.recv(64)
        except ssl.SSLCertVerificationError as e:
            return (
                f"ZooKeeper's certificate at {host}:{port} is not trusted ({e.verify_message}); check "
                f"{ZK_SSL_PREFIX}caFile and {ZK_SSL_PREFIX}checkHostname"
            )
        except ssl.SSLError as e:
            return _explain_ssl_error(host, port, e, has_identity=tls.files.has_identity)
        except (ConnectionResetError, BrokenPipeError):
            return (
                f"{host}:{port} closed the connection during the TLS handshake; is it ZooKeeper's "
                "secureClientPort, and does it accept this client's certificate?"
            )
        except OSError:
            continue
        return None
    return None


def _explain_ssl_error(host: str, port: int, e: ssl.SSLError, *, has_identity: bool) -> str:
    reason = str(e.reason or e)
    where = f"{host}:{port}"
    if isinstance(e, ssl.SSLEOFError) or reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE"):
        return f"{where} does not speak TLS ({reason}); is it ZooKeeper's secureClientPort?"
    if "ALERT" in reason and not has_identity:
        return (
            f"{where} refused the handshake ({reason}): it requires a client certificate; set "
            f"{ZK_SSL_PREFIX}certFile and {ZK_SSL_PREFIX}keyFile"
        )
    if "ALERT" in reason:
        return (
            f"{where} refused this client's certificate ({reason}); {ZK_SSL_PREFIX}certFile must be signed "
            "by a CA in ZooKeeper's ssl.trustStore"
        )
    return f"TLS with {where} failed: {reason}"


class _StateLog:
    """Logs one line per change of a client's session state (kazoo's own warnings are filtered, see
    :data:`KAZOO_LOG`), and counts the changes for :func:`session_state` (the ``waltz_zookeeper_*`` metrics).

    Called on kazoo's thread; it only logs and sets plain fields, which is thread-safe."""

    def __init__(self, connect_string: str, tls: ZkTls | None = None) -> None:
        self.connect_string = connect_string
        # Said only when it is TLS: plain TCP was the only transport before, and its line stays as it was.
        self.where = (
            connect_string if tls is None or not tls.enabled else f"{connect_string}, {tls.describe()}"
        )
        self.state: str | None = None
        self.suspensions = 0
        self.expiries = 0

    def __call__(self, state: str) -> None:
        if state == self.state:
            return
        previous, self.state = self.state, state
        if state == "CONNECTED":
            if previous == "SUSPENDED":
                log.info("ZooKeeper connection back, same session (%s)", self.connect_string)
            else:
                log.info("ZooKeeper session started (%s)", self.where)
        elif state == "SUSPENDED":
            self.suspensions += 1
            log.warning("ZooKeeper connection lost; reconnecting to %s", self.connect_string)
        elif state == "LOST":
            self.expiries += 1
            log.warning("ZooKeeper session expired; its ephemeral znodes are gone; starting a new one")


@dataclass(frozen=True)
class SessionState:
    """A client's ZooKeeper session as :func:`session_state` reads it."""

    connected: bool
    """True while the session is connected (not suspended: kazoo's CONNECTED)."""
    suspensions: int
    """Connections lost since the client started (kazoo's SUSPENDED: the session may come back)."""
    expiries: int
    """Sessions lost since the client started (kazoo's LOST: expired, its ephemeral znodes gone)."""


def session_state(client: KazooClient) -> SessionState | None:
    """The state and counts of a client made by :func:`connect`; None for another one, or once closed."""
    for listener in list(client.state_listeners):
        if isinstance(listener, _StateLog):
            return SessionState(listener.state == "CONNECTED", listener.suspensions, listener.expiries)
    return None


def close(client: KazooClient) -> None:
    """Stop ``client`` (its session ends, its ephemeral znodes go) and release its threads."""
    # A session we end ourselves is not news: only expiries are logged.
    for listener in list(client.state_listeners):
        if isinstance(listener, _StateLog):
            client.remove_listener(listener)
    try:
        client.stop()
    finally:
        client.close()


def connect_from_config(config: Mapping[str, Any], source: str = "config") -> KazooClient:
    """Connect using ``zookeeper.connectString``/``sessionTimeout``/``connectTimeout`` and the access keys
    (``authFile``, ``aclReaders``, ``ssl.*``) of a parsed config; ``source`` names it in errors."""
    return connect(
        str(config["zookeeper.connectString"]),
        session_timeout_ms=int(config.get("zookeeper.sessionTimeout", DEFAULT_SESSION_TIMEOUT_MS)),
        connect_timeout_ms=int(config.get("zookeeper.connectTimeout", DEFAULT_CONNECT_TIMEOUT_MS)),
        auth=ZkAuth.from_config(config, source),
    )


@contextmanager
def session(config: Mapping[str, Any], source: str = "config") -> Iterator[KazooClient]:
    """A connected client for the duration of a ``with`` block (used by the CLI)."""
    client = connect_from_config(config, source)
    try:
        yield client
    finally:
        close(client)


@contextmanager
def zk_errors(what: str) -> Iterator[None]:
    """Translate kazoo exceptions raised inside the block into Waltz errors mentioning ``what``."""
    try:
        yield
    except BadVersionError:
        raise ConcurrentUpdateError(f"{what}: changed concurrently, re-read and retry") from None
    except NodeExistsError:
        raise ConcurrentUpdateError(f"{what}: created concurrently, re-read and retry") from None
    except NoNodeError:
        raise MetadataError(f"{what}: znode missing") from None
    except NotEmptyError:
        raise MetadataError(f"{what}: znode has children") from None
    except NoAuthError:
        raise MetadataError(
            f"{what}: not allowed by the znode's ACL (set zookeeper.authFile to the cluster's identity)"
        ) from None
    except (ConnectionLoss, SessionExpiredError) as e:
        raise ZooKeeperUnavailableError(f"{what}: ZooKeeper unavailable ({type(e).__name__})") from None
    except (OperationTimeoutError, KazooTimeoutError) as e:
        raise ClusterError(f"{what}: ZooKeeper unavailable ({type(e).__name__})") from None
    except KazooException as e:
        raise ClusterError(f"{what}: ZooKeeper error {type(e).__name__}: {e}") from None


def read_value(client: KazooClient, path: str, decode: Callable[[bytes], T], what: str) -> tuple[T, Any]:
    """Read and decode one znode; returns ``(value, stat)``. A missing znode is a MetadataError."""
    with zk_errors(what):
        raw, stat = client.get(path)
    return decode(raw), stat


def commit(transaction: Any, what: str) -> list[Any]:
    """Commit a kazoo transaction; any failed operation raises (BadVersion/NodeExists -> retriable)."""
    with zk_errors(what):
        results: list[Any] = transaction.commit()
    failures = [r for r in results if isinstance(r, Exception)]
    # In a failed multi, the operation that failed carries its real error; all others are RolledBackError.
    for failure in failures:
        if isinstance(failure, BadVersionError | NodeExistsError):
            raise ConcurrentUpdateError(f"{what}: changed concurrently, re-read and retry")
    for failure in failures:
        if isinstance(failure, NoNodeError):
            raise MetadataError(f"{what}: znode missing")
    for failure in failures:
        if type(failure).__name__ != "RolledBackError":
            raise ClusterError(f"{what}: transaction failed: {type(failure).__name__}")
    if failures:
        raise ClusterError(f"{what}: transaction rolled back")
    return results


def compare_and_set(
    client: KazooClient,
    path: str,
    decode: Callable[[bytes], T],
    update: Callable[[T], bytes | None],
    what: str,
    *,
    max_attempts: int = 10,
) -> T | None:
    """Read-modify-write ``path`` with a version check, retrying a lost race up to ``max_attempts`` times.

    ``update`` receives the decoded value and returns new bytes, or ``None`` to write nothing. Returns the
    value ``update`` saw on the successful attempt (or ``None`` if nothing was written). Raises
    ConcurrentUpdateError if every attempt lost a race.
    """
    for _ in range(max_attempts):
        value, stat = read_value(client, path, decode, what)
        new = update(value)
        if new is None:
            return None
        try:
            with zk_errors(what):
                client.set(path, new, version=stat.version)
        except ConcurrentUpdateError:
            log.debug("%s: lost a compare-and-set race, retrying", what)
            continue
        return value
    raise ConcurrentUpdateError(f"{what}: lost {max_attempts} compare-and-set races in a row")
