"""The contract between the client core and whatever carries its messages: ``ClientDriver``.

The client is split in two:

* the **core** (:class:`~waltz.client.core.AsyncWaltzClient`): transaction contexts, the transaction monitor,
  retries, back pressure, ordered application of the feed. It knows nothing about sockets or ZooKeeper.
* a **driver** (:class:`ClientDriver`): finds the servers, keeps connections, sends requests and turns what
  comes back into the events of :class:`DriverListener`. Two exist: the in-memory
  :class:`~waltz.client.mock.MockDriver` and, later, the network driver (ZooKeeper discovery + TCP).

Everything below is per **partition**. A driver method and a listener event always name the partition.

Threading
---------
Every driver method is called on the client's asyncio event loop (the one running the core), and the driver
must deliver every listener event **on that same loop** (hop with ``loop.call_soon_threadsafe`` or
``asyncio.run_coroutine_threadsafe`` if the network or ZooKeeper calls back on another thread). Listener
methods are coroutines: the driver ``await``s each one before delivering the next event **of the same
partition**, which keeps the events of a partition in order and lets the core apply back pressure (the
``on_feed_data`` coroutine only returns once the core has room for the record; a network driver should then
stop reading, or stop re-requesting the feed). Events of different partitions may be delivered concurrently.

Lifecycle
---------
1. ``await driver.open(listener)``: connect/discover. Afterwards ``client_id``, ``cluster_name`` and
   ``num_partitions`` are valid and constant.
2. ``driver.mount(p, client_hwm)``: from now on the driver owns partition ``p``'s stream. It delivers, in
   order, the feed of committed transactions ``client_hwm + 1, client_hwm + 2, ...`` (dense: no gaps, no
   repeats) and :class:`MountState` changes. The **driver keeps the feed position** across reconnects and
   server moves: after a reconnect it re-mounts from the last transaction id it delivered, never from
   ``client_hwm`` again. The driver is the **one owner** of the feed position and of its density check:
   the core does not track or check it again, and takes every ``on_feed_data`` as the next transaction.
3. While mounted (after ``READY``), ``send_append``/``send_flush`` may be called. A server that never
   answers is not waited for without bound: the driver gives a MountRequest ``client.answerTimeout`` to be
   answered, and the core calls ``resync`` when an append stays unresolved that long.
4. ``await driver.unmount(p)`` stops the partition; no more events for it afterwards.
5. ``await driver.close()`` closes everything; it must return even if the cluster is unreachable.

Mount states (the events :meth:`DriverListener.on_mount_state` carries)
------------------------------------------------------------------------
* ``READY``: the server owns the partition, streamed every transaction up to its high-water mark at mount
  time, and holds no pending append of ours from an earlier connection (the server drained its append queue
  before answering). Sent after every successful (re)mount. The core then sends a flush for its last pending
  append, which resolves appends lost with an old connection.
* ``NOT_READY``: the partition is not usable right now (server not ready, connection lost, server moving).
  The driver keeps trying on its own (re-discover, reconnect, re-mount) and reports ``READY`` when it is back;
  meanwhile the core holds new appends.
* ``CLIENT_AHEAD``: the application's high-water mark is past the server's (wrong cluster or lost data).
  Final for the partition's current owner and generation: submits to the partition fail with
  :class:`~waltz.errors.ClientAheadError`. When the partition's owner or generation changes, the driver
  mounts it again (``NOT_READY``, then ``READY`` or ``CLIENT_AHEAD`` once more), since the answer may have
  come from a stale incarnation that a newer one, holding the client's transactions, replaced.

Appends and flushes
-------------------
``send_append`` and ``send_flush`` are **synchronous and non-blocking**: the driver queues the request and
must transmit the requests of one partition **in call order** on the partition's stream (``now``, which
the core sets for a lone append, hands the append to the network at once, after what was queued before
it). The core depends on this: once it sees one of its own request ids in the feed it fails every older
pending append, which is only correct if the server received them in the order they were
registered. The core never has more than ``client.maxConcurrentTransactions`` appends outstanding per
partition, plus one flush per partition at a time (rarely two), so the driver's queue is bounded by that.
If a request cannot be sent (no connection), the driver may drop it silently: after the next ``READY`` the
core's flush resolves it as failed. A failed append on the server sends nothing back; a lock conflict comes
back as ``on_lock_failure``; a flush is always answered by ``on_flush_response`` with the partition's
high-water mark once every earlier append of this client has been resolved.

Data and high-water mark (RPC, no ordering)
-------------------------------------------
``fetch_transaction_data`` returns ``(data, checksum)`` as stored (the core verifies the CRC-32 and re-asks
on a mismatch), and ``high_water_mark`` the partition's last committed id (-1 for an empty log). Both may
raise a retriable :class:`~waltz.errors.WaltzError` (for example ``PartitionNotReadyError`` or
``BrokenResourceError``) which the core retries with backoff; the core applies its own timeout
(``client.requestTimeout``) by cancelling the coroutine, so a driver must tolerate cancellation.

Request ids
-----------
The core builds every :class:`~waltz.protocol.records.ReqId` with ``ReqId.of(client_id, generation,
partition, seq)``: ``seq`` is a per-partition counter starting at 1, ``generation`` is
:meth:`ClientDriver.generation` as it was when the partition last became ``READY`` (the core reads it then,
not once per append: a driver that changes a partition's generation mounts it again, so ``NOT_READY`` and
``READY`` follow). Flushes carry the request id of the last pending append (the server echoes it back in the
flush response).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import NamedTuple, Protocol

from waltz.client.builder import TransactionBuilder
from waltz.errors import ClientError, TrimmedError
from waltz.protocol.client_server import AppendRequest
from waltz.protocol.records import ReqId

__all__ = [
    "AppendRequest",
    "ClientDriver",
    "DriverListener",
    "MountState",
]

# An append reaches the driver as the request id and the TransactionBuilder that ``execute`` filled: the
# network driver frames it straight from the builder (``TransactionBuilder.frame_append``), others send
# ``builder.build(req_id)``, the wire message itself (waltz.protocol.client_server.AppendRequest), whose
# ``client_high_water_mark`` is the application's high-water mark captured just before ``execute`` ran; lock
# values are the 32-bit hashes of :func:`waltz.client.locks.lock_hash`; ``checksum`` is the CRC-32 of
# ``data``.


class MountState(enum.IntEnum):
    """State of a partition's mount, as the server's MountResponse reports it (wire values 0, 1, 2)."""

    READY = 0
    NOT_READY = 1
    CLIENT_AHEAD = 2


class DriverListener(Protocol):
    """What the core offers the driver: one coroutine per event. Await each; see the module docstring."""

    async def on_feed_data(self, partition_id: int, transaction_id: int, req_id: ReqId, header: int) -> None:
        """A committed transaction: its id, the request id of the append that wrote it, and its header."""

    async def on_mount_state(self, partition_id: int, state: MountState) -> None:
        """The partition's mount changed state (see :class:`MountState`)."""

    async def on_lock_failure(self, partition_id: int, req_id: ReqId, transaction_id: int) -> None:
        """The append ``req_id`` was rejected by the lock check; ``transaction_id`` is the (estimated) id of
        the transaction that took the conflicting lock."""

    async def on_flush_response(self, partition_id: int, req_id: ReqId, transaction_id: int) -> None:
        """Every append sent before the flush ``req_id`` is resolved; ``transaction_id`` is the partition's
        high-water mark at that point."""

    async def on_mount_failure(self, partition_id: int, error: TrimmedError) -> None:
        """The partition cannot be mounted at the client's high-water mark, for good: it lies below the
        partition's trim point. The core stops the partition with ``error``."""

    def on_driver_failure(self, error: ClientError) -> None:
        """A task the driver cannot serve without failed (following the partition assignment, say): the
        driver can no longer serve any partition, and ``error`` says why. Called on the loop, at most once;
        the core stops every partition with ``error`` and reports it to the application."""


# A listener may also offer ``feed_run_nowait(partition_id, entries) -> int``: ``on_feed_data`` without a
# coroutine for a run of consecutive entries ``[(transaction_id, req_id, header), ...]`` (the partition's next
# ids, in order) in one call, returning how many of the leading ones it took (0 when it has no room, having
# done nothing); the driver delivers the rest through ``on_feed_data``. The network driver hands it each
# socket read's entries of a partition (the core's listener offers it); the MockDriver does not need to.


class CoordinationTrouble(NamedTuple):
    """The cluster's coordination service (ZooKeeper) does not answer this client: appends may be waiting on
    it, since the servers hold them while their own ZooKeeper sessions are suspended."""

    since_s: float
    """When it stopped answering (``time.monotonic()``): one outage, one value."""
    description: str
    """One line for errors and logs, naming ZooKeeper and how long it has not answered."""


class ClientDriver(ABC):
    """Carries the core's requests to a Waltz cluster and its events back. See the module docstring."""

    def coordination_trouble(self) -> CoordinationTrouble | None:
        """Why appends may be waiting on the cluster's coordination service, or None (the default: a driver
        without one). Cheap; called when a submit has to wait and when a wait times out."""
        return None

    @abstractmethod
    async def open(self, listener: DriverListener) -> None:
        """Connect (discover the cluster, obtain a client id). Called once, before anything else."""

    @property
    @abstractmethod
    def client_id(self) -> int:
        """This client's id, unique in the cluster (valid after :meth:`open`)."""

    @property
    @abstractmethod
    def cluster_name(self) -> str:
        """The cluster's name (valid after :meth:`open`)."""

    @property
    @abstractmethod
    def num_partitions(self) -> int:
        """The cluster's number of partitions (valid after :meth:`open`)."""

    @abstractmethod
    def generation(self, partition_id: int) -> int:
        """The latest generation of the partition this driver knows (0 if unknown)."""

    @abstractmethod
    async def mount(self, partition_id: int, client_high_water_mark: int) -> None:
        """Start streaming the partition from ``client_high_water_mark + 1``; return without waiting for
        ``READY`` (which arrives as an event)."""

    @abstractmethod
    async def unmount(self, partition_id: int) -> None:
        """Stop the partition: no events for it after this returns."""

    @abstractmethod
    def send_append(self, partition_id: int, req_id: ReqId, builder: TransactionBuilder, now: bool) -> None:
        """Queue the append ``builder.build(req_id)``; requests of one partition are transmitted in call
        order. Never blocks. ``now``: hand it to the network at once (after what was queued before it) rather
        than with the requests of this loop iteration; the core sets it for a lone append (nothing else in
        flight on its partition), which no other request would join, so it leaves one loop pass sooner."""

    @abstractmethod
    def send_flush(self, partition_id: int, req_id: ReqId) -> None:
        """Queue a flush for the partition, after every append queued before it. Never blocks."""

    @abstractmethod
    def resync(self, partition_id: int) -> None:
        """The core heard nothing that resolves the partition's oldest pending append for
        ``client.answerTimeout``: drop the partition's stream as if its connection were lost (``NOT_READY``,
        answers still owed on it are gone) and mount it again. Never blocks. The core's flush after the
        next ``READY`` then resolves every pending append (an append that did commit shows up in the feed,
        which re-mounts from the last id delivered: nothing is applied twice)."""

    @abstractmethod
    async def fetch_transaction_data(self, partition_id: int, transaction_id: int) -> tuple[bytes, int]:
        """Return ``(data, checksum)`` of a committed transaction, as stored."""

    @abstractmethod
    async def high_water_mark(self, partition_id: int) -> int:
        """Return the partition's current high-water mark (-1 for an empty log)."""

    @abstractmethod
    async def close(self) -> None:
        """Close connections and cancel the driver's own tasks; no events after this returns."""
