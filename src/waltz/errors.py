"""The one exception tree of Waltz.

Every failure Waltz raises on purpose is a :class:`WaltzError` (bugs caught by a check have their own root,
below). Each class says whether retrying the same operation later can succeed (``retriable``); callers
decide on that flag, never on message text::

    WaltzError
    ├── ConfigError                    bad configuration file, key or CLI argument (not retriable)
    ├── ProtocolError                  bytes that do not follow a Waltz wire format
    │   ├── LocalProtocolError         we were asked to send something the format cannot carry
    │   └── RemoteProtocolError        a peer sent something malformed; the connection is closed
    │       └── FrameTooLargeError     a frame header announced more than the configured maximum
    ├── ConnectionError_               the transport is gone
    │   ├── ClosedResourceError        we closed it ourselves (not retriable on the same object)
    │   └── BrokenResourceError        the peer or the network broke it (retriable with a new connection)
    ├── StorageError                   storage node and on-disk format
    │   ├── CorruptionError            a checksum or structure on disk does not verify
    │   ├── FormatVersionError         a file's format version is one this release does not read
    │   ├── StorageRpcError            a storage node answered a request with a failure response
    │   ├── ClusterKeyMismatchError    the peer belongs to another cluster (wrong key or partition count)
    │   ├── SessionFencedError         a newer store session exists; this one may no longer write
    │   ├── PartitionNotAssignedError  the partition is not assigned (or not available) on that node
    │   ├── TransactionOutOfOrderError an append did not continue the log densely
    │   └── TrimmedError               a read or mount asked for transactions below the trim point
    ├── ClusterError                   ZooKeeper metadata and membership
    │   ├── ClusterNotFoundError       no cluster at that root
    │   ├── ConcurrentUpdateError      a version-checked write lost a race (retriable)
    │   ├── MetadataError              a znode holds something we cannot read, or an edit is refused
    │   ├── FeatureVersionError        the cluster's feature version is outside what this process
    │   │                              supports, or a raise is refused (a process cannot follow)
    │   └── ZooKeeperUnavailableError  the connection was lost or the session expired (retriable)
    ├── ServerError
    │   ├── GenerationMismatchError    a request carried another partition generation (retriable)
    │   ├── PartitionNotReadyError     this server does not (yet) own the partition (retriable)
    │   └── QuorumLostError            too few replicas are reachable to commit (retriable)
    ├── ClientError
    │   ├── ClientClosedError          the client was closed
    │   ├── ClientTimeoutError         an operation did not finish in its time limit (retriable)
    │   ├── ClientAheadError           the application's high-water mark is past the server's
    │   ├── LockFailureError           an optimistic-lock conflict rejected the transaction (retriable)
    │   ├── PartitionStuckError        apply_transaction keeps failing on one transaction (retriable)
    │   └── DataChecksumError          transaction data did not match its checksum after retries
    └── BackupError                    a backup is unusable (partial, damaged, another cluster's), or a
                                       restore's target is not an empty cluster; nothing was changed

A bug is not a failure to handle, so its errors have a root of their own, deliberately outside
:class:`WaltzError`: no ``except WaltzError`` that handles an expected failure (retrying, answering a
peer) may swallow one. They derive from ``RuntimeError``::

    InternalError                      a bug: something that must hold does not; never retried
    ├── InvariantViolation             a replication invariant (or storage that breaks its contract)
    ├── LifecycleError                 an event that cannot happen in a client context's state
    └── BusyResourceError              a second task asked for what one task at a time may use

Storage failure responses carry a class name (the first frame of the wire ``StorageRpcException``);
:func:`error_from_wire` maps it back to the class here so a remote failure keeps its meaning.
"""

from __future__ import annotations

import re
from typing import ClassVar


class WaltzError(Exception):
    """Base of every error Waltz raises on purpose."""

    retriable: ClassVar[bool] = False


class ConfigError(WaltzError):
    """A configuration value, file or command-line argument is invalid."""


class ProtocolError(WaltzError):
    """Bytes that do not follow a Waltz wire format."""


class LocalProtocolError(ProtocolError):
    """We were asked to encode something the wire format cannot carry (a bug on our side)."""


class RemoteProtocolError(ProtocolError):
    """The peer sent malformed bytes; the connection must be closed."""


class FrameTooLargeError(RemoteProtocolError):
    """A frame header announced a payload larger than the configured maximum."""


class ConnectionError_(WaltzError):  # noqa: N801 - avoids shadowing the builtin ConnectionError
    """The transport is gone."""


class ClosedResourceError(ConnectionError_):
    """We closed the connection (or client) ourselves."""


class BrokenResourceError(ConnectionError_):
    """The peer or the network broke the connection; a new connection may succeed."""

    retriable = True


class InternalError(RuntimeError):
    """A bug: something that must hold in production does not. Raised instead of ``assert`` (which ``-O``
    removes); never retried, and not a :class:`WaltzError`, so no handler of expected failures catches it."""


class InvariantViolation(InternalError):
    """A replication invariant does not hold: a bug, or storage that breaks its contract."""


class LifecycleError(InternalError):
    """An event that cannot happen in a client context's state (see ``waltz.client.lifecycle``): a bug in the
    client core."""


class BusyResourceError(InternalError):
    """A second task asked for a resource only one task may use at a time (such as receiving on one
    connection): a bug in the caller, not a state of the resource."""


class StorageError(WaltzError):
    """An error of a storage node or of the on-disk format."""


class CorruptionError(StorageError):
    """A checksum or structure on disk does not verify."""


class FormatVersionError(StorageError):
    """A file (segment, index, control file) carries a format version this release does not read: it was
    written by a newer release, or is not a Waltz file. Refused, never treated as damage, so a node started
    with an older release than its files changes nothing (the message names the file and both versions)."""


class StorageRpcError(StorageError):
    """A storage node answered a request with a failure response."""

    retriable = True


class ClusterKeyMismatchError(StorageError):
    """The peer belongs to another cluster: the cluster key or partition count differs."""


class SessionFencedError(StorageError):
    """A newer store session exists for the partition; the older session may no longer write."""


class PartitionNotAssignedError(StorageError):
    """The partition is not assigned to, or not available on, the storage node."""

    retriable = True


class TransactionOutOfOrderError(StorageError):
    """An append did not continue the log densely (its first id is not max id + 1)."""


class TrimmedError(StorageError):
    """A read (or a client's mount) asked for a transaction below the partition's trim point: those
    transactions were deleted on purpose (see ``docs/operations.md``, "Retention"). Not retriable: no replica
    holds them any more; an application bootstraps from a snapshot instead. The message names the partition,
    the requested id and the trim point; so do the attributes (-1 where a peer's message did not say)."""

    def __init__(
        self, message: str, *, partition_id: int = -1, transaction_id: int = -1, trim_point: int = -1
    ):
        super().__init__(message)
        self.partition_id = partition_id
        self.transaction_id = transaction_id
        self.trim_point = trim_point

    @classmethod
    def below(cls, partition_id: int, transaction_id: int, trim_point: int) -> TrimmedError:
        """The error for a read of ``transaction_id`` below ``trim_point``."""
        return cls(
            f"partition {partition_id}: transaction {transaction_id} is below the trim point {trim_point} "
            f"(transactions 0..{trim_point - 1} were trimmed); bootstrap from a snapshot at or above "
            f"{trim_point - 1}",
            partition_id=partition_id,
            transaction_id=transaction_id,
            trim_point=trim_point,
        )

    @classmethod
    def from_message(cls, message: str) -> TrimmedError | None:
        """The error a peer described in ``message`` (as :meth:`below` words it), or None if the message is
        not one. For answers whose wire format carries an error as text only (a client's transaction data
        read, ``docs/operations.md`` "Retention")."""
        m = _TRIM_NUMBERS.search(message)
        if m is None:
            return None
        pid, txn, trim = (int(g) for g in m.groups())
        return cls(message, partition_id=pid, transaction_id=txn, trim_point=trim)


_TRIM_NUMBERS = re.compile(r"partition (-?\d+): transaction (-?\d+) is below the trim point (-?\d+)")


class ClusterError(WaltzError):
    """An error of the ZooKeeper-held cluster metadata or membership."""


class ClusterNotFoundError(ClusterError):
    """No Waltz cluster exists at the given ZooKeeper root."""


class ConcurrentUpdateError(ClusterError):
    """A version-checked (compare-and-set) write lost a race; re-read and retry."""

    retriable = True


class MetadataError(ClusterError):
    """A znode holds something unreadable, or a metadata edit is refused."""


class FeatureVersionError(ClusterError):
    """The cluster's feature version (``<root>/features``) is one this process does not support, or a raise
    of it is refused because a running process could not follow (the message names which, and both
    ranges)."""


class ZooKeeperUnavailableError(ClusterError):
    """A ZooKeeper request failed because the connection was lost or the session expired. That state change
    is logged once where it is seen (``waltz.cluster.zk``), so callers that retry do it quietly."""

    retriable = True


class ServerError(WaltzError):
    """An error of a Waltz server."""


class GenerationMismatchError(ServerError):
    """A request carried another generation than the partition's current one."""

    retriable = True


class PartitionNotReadyError(ServerError):
    """The server does not own the partition, or has not finished opening it."""

    retriable = True


class QuorumLostError(ServerError):
    """Too few replicas are reachable to commit or to decide the high-water mark."""

    retriable = True


class ClientError(WaltzError):
    """An error raised by the Waltz client library."""


class ClientClosedError(ClientError):
    """The client was closed."""


class ClientTimeoutError(ClientError):
    """An operation did not finish within its time limit."""

    retriable = True


class ClientAheadError(ClientError):
    """The application's high-water mark is ahead of the server's: wrong cluster or lost data."""


class LockFailureError(ClientError):
    """An optimistic-lock conflict rejected the transaction."""

    retriable = True


class PartitionStuckError(ClientError):
    """``apply_transaction`` keeps failing on one transaction, so the partition's feed cannot advance; the
    message names the transaction and the error. Retriable: it clears once the transaction applies (or the
    application skips it)."""

    retriable = True


class DataChecksumError(ClientError):
    """Transaction data did not match its CRC-32 after the allowed number of re-reads."""


class BackupError(WaltzError):
    """A backup cannot be used (partial, damaged, not matching its manifest, of another cluster), or a
    restore's target is not an empty cluster. The message names the file or the partition; nothing was
    changed."""


_WIRE_CLASSES: dict[str, type[WaltzError]] = {
    cls.__name__: cls
    for cls in (
        StorageError,
        CorruptionError,
        StorageRpcError,
        ClusterKeyMismatchError,
        SessionFencedError,
        PartitionNotAssignedError,
        TransactionOutOfOrderError,
        TrimmedError,
        RemoteProtocolError,
        ConfigError,
    )
}


def error_from_wire(class_name: str, message: str) -> WaltzError:
    """Rebuild an error received from a peer; unknown class names become :class:`StorageRpcError`."""
    cls = _WIRE_CLASSES.get(class_name, StorageRpcError)
    if cls is TrimmedError:
        # The numbers travel in the message only (the failure format has no fields for them).
        return TrimmedError.from_message(message) or TrimmedError(message)
    return cls(message)


def wire_name(error: BaseException) -> str:
    """The class name to put on the wire for ``error`` (so the peer can rebuild its meaning)."""
    name = type(error).__name__
    return name if name in _WIRE_CLASSES else StorageRpcError.__name__
