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
"""

from __future__ import annotations

import base64
import hashlib
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
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
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.retry import KazooRetry
from kazoo.security import ACL, Id, Permissions, make_acl

from waltz.config import Key
from waltz.errors import (
    ClusterError,
    ConcurrentUpdateError,
    ConfigError,
    MetadataError,
    ZooKeeperUnavailableError,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_SESSION_TIMEOUT_MS = 30000
DEFAULT_CONNECT_TIMEOUT_MS = 10000
MAX_AUTH_FILE_BYTES = 4096
"""An auth file larger than this is not a ``user:password`` line; refuse it rather than read it whole."""


def digest_id(credentials: str) -> str:
    """ZooKeeper's digest id of ``user:password``: ``user:base64(sha1("user:password"))`` (what ACLs name)."""
    user = credentials.split(":", 1)[0]
    return f"{user}:{base64.b64encode(hashlib.sha1(credentials.encode()).digest()).decode()}"


@dataclass(frozen=True)
class ZkAuth:
    """How one process authenticates with ZooKeeper and which ACL its new znodes get (module docstring).

    ``credentials`` is ``user:password`` ("" = anonymous); ``readers`` are digest ids granted READ.
    """

    credentials: str = ""
    readers: tuple[str, ...] = ()

    @property
    def enabled(self) -> bool:
        return bool(self.credentials)

    @property
    def user(self) -> str:
        return self.credentials.split(":", 1)[0]

    def auth_data(self) -> list[tuple[str, str]] | None:
        return [("digest", self.credentials)] if self.enabled else None

    def default_acl(self) -> list[ACL] | None:
        """All permissions for this identity (ZooKeeper's ``auth`` scheme: whoever created the znode), READ
        for the readers; None when anonymous (znodes are then created open, ZooKeeper's default)."""
        if not self.enabled:
            return None
        return [
            make_acl("auth", "", all=True),
            *(ACL(Permissions.READ, Id("digest", r)) for r in self.readers),
        ]

    @classmethod
    def from_config(cls, config: Mapping[str, Any], source: str = "config") -> ZkAuth:
        """From ``zookeeper.authFile`` and ``zookeeper.aclReaders`` of a parsed config (absent: anonymous)."""
        path = str(config.get("zookeeper.authFile", "") or "").strip()
        readers_raw = config.get("zookeeper.aclReaders", "") or ""
        readers = tuple(r.strip() for r in str(readers_raw).split(",") if r.strip())
        for r in readers:
            if r.count(":") != 1 or not all(r.split(":")):
                raise ConfigError(f"{source}: zookeeper.aclReaders: {r!r} is not a digest id user:hash")
        if not path:
            if readers:
                raise ConfigError(f"{source}: zookeeper.aclReaders needs zookeeper.authFile")
            return cls()
        return cls(read_auth_file(path, source), readers)


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
    """The ZooKeeper access-control keys every component's schema carries."""
    return [
        Key(
            "zookeeper.authFile", str, "", "file with the digest credentials user:password (empty: anonymous)"
        ),
        Key(
            "zookeeper.aclReaders", str, "", "digest ids user:hash given READ on znodes this process creates"
        ),
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
    def groups(self) -> str:
        return f"{self.root}/store/group"

    @property
    def connections(self) -> str:
        return f"{self.root}/store/connection"

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
    behind) when no server answers within ``connect_timeout_ms``. Once connected, the client keeps
    reconnecting by itself after a drop, and opens a new session after an expiry. With ``auth`` the session
    authenticates (digest) and creates znodes with ``auth``'s ACL.
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
    )
    client.add_listener(_StateLog(connect_string))
    try:
        client.start(timeout=connect_timeout_ms / 1000.0)
    except KazooTimeoutError:
        close(client)
        raise ClusterError(
            f"cannot connect to ZooKeeper at {connect_string}: no answer within {connect_timeout_ms} ms"
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


class _StateLog:
    """Logs one line per change of a client's session state (kazoo's own loggers are kept at ERROR, see
    :mod:`waltz.cli.logsetup`: they warn on every failed attempt while ZooKeeper is down).

    Called on kazoo's thread; it only logs, which is thread-safe."""

    def __init__(self, connect_string: str) -> None:
        self.connect_string = connect_string
        self.state: str | None = None

    def __call__(self, state: str) -> None:
        if state == self.state:
            return
        previous, self.state = self.state, state
        if state == "CONNECTED":
            if previous == "SUSPENDED":
                log.info("ZooKeeper connection back, same session (%s)", self.connect_string)
            else:
                log.info("ZooKeeper session started (%s)", self.connect_string)
        elif state == "SUSPENDED":
            log.warning("ZooKeeper connection lost; reconnecting to %s", self.connect_string)
        elif state == "LOST":
            log.warning("ZooKeeper session expired; its ephemeral znodes are gone; starting a new one")


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


def connect_from_config(config: Mapping[str, Any]) -> KazooClient:
    """Connect using ``zookeeper.connectString``/``sessionTimeout``/``connectTimeout`` of a parsed config."""
    return connect(
        str(config["zookeeper.connectString"]),
        session_timeout_ms=int(config.get("zookeeper.sessionTimeout", DEFAULT_SESSION_TIMEOUT_MS)),
        connect_timeout_ms=int(config.get("zookeeper.connectTimeout", DEFAULT_CONNECT_TIMEOUT_MS)),
        auth=ZkAuth.from_config(config),
    )


@contextmanager
def session(config: Mapping[str, Any]) -> Iterator[KazooClient]:
    """A connected client for the duration of a ``with`` block (used by the CLI)."""
    client = connect_from_config(config)
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
