"""Server membership and partition assignment on ZooKeeper, for asyncio code.

:class:`ClusterMember` is what a Waltz server runs: it registers an ephemeral sequential descriptor under
``<root>/serverDescriptors``, watches the membership and the published assignment, and delivers the
partitions this server owns, with their generations. :class:`ClusterWatcher` is the read-only view clients
use: where each partition lives, in which generation.

How an assignment comes about (see docs/zookeeper.md):

1. Every member watches ``serverDescriptors``' children (membership) and data (the published
   :class:`~waltz.cluster.partition_assignment.PartitionAssignment`).
2. When the assignment's ``cversion`` differs from the znode's (membership changed since it was computed),
   the *coordinator* (the live server with the smallest id) computes a new one with
   :func:`~waltz.cluster.assignment.assign_partitions` and writes it with a version check. Losing that race
   only means someone else wrote first; the member re-reads.
3. Once the assignment is consistent with the membership, members deliver their partitions and watchers
   their endpoints. An inconsistent (stale) assignment is never delivered.

Session states follow kazoo: on ``SUSPENDED`` (connection lost, session maybe alive) the member reports
``suspended`` and calls ``on_suspended``; the server must stop taking new work for its partitions until
``on_resumed``. On ``LOST`` (session expired: our descriptor is gone, our partitions may be moved) the member
stays suspended, re-registers as soon as kazoo has a new session, and resumes once an assignment consistent
with the new membership names it; it then delivers whatever the coordinator gave it. It does *not* deliver
an empty assignment in between: a partition that comes back in the same generation never left this server
(a move always raises the generation), so the server keeps serving it as the same incarnation, mounted
clients and all; one that moved meanwhile comes back with a higher generation, or not at all. Acting on a
stale view while LOST is safe because storage nodes fence an old owner's store session (docs/zookeeper.md).

Threading: kazoo calls watches and state listeners on its own threads; those callbacks only hop onto the
event loop with ``loop.call_soon_threadsafe``. Every blocking kazoo call runs in ``asyncio.to_thread``.
All user callbacks run on the event loop thread, in the order of events. Each member owns one background
task, created by ``start`` and cancelled by ``close``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError
from kazoo.protocol.states import KazooState

from waltz.cluster import features
from waltz.cluster.assignment import assign_partitions
from waltz.cluster.partition_assignment import PartitionAssignment
from waltz.cluster.server_descriptor import ServerDescriptor
from waltz.cluster.store_metadata import next_id
from waltz.cluster.zk import ClusterPaths, zk_errors
from waltz.errors import (
    ClientTimeoutError,
    ClusterError,
    ConcurrentUpdateError,
    MetadataError,
    ZooKeeperUnavailableError,
)
from waltz.runtime import TaskSet
from waltz.version import __version__

log = logging.getLogger(__name__)

T = TypeVar("T")

RETRY_DELAY_S = 0.5
"""Pause before re-reading after a failed read or a ZooKeeper error while connected."""


class Latest(Generic[T]):
    """A latest-value channel on the event loop: readers see every *distinct* value, or at least the newest.

    Not thread-safe: publish from the event loop thread only.
    """

    def __init__(self) -> None:
        self._value: T | None = None
        self._seq = 0
        self._changed = asyncio.Event()
        self._closed = False
        self._error: BaseException | None = None

    @property
    def value(self) -> T | None:
        return self._value

    def publish(self, value: T) -> bool:
        """Set a new value; returns False (and wakes no one) if it equals the current one."""
        if self._seq and value == self._value:
            return False
        self._value = value
        self._seq += 1
        self._wake()
        return True

    def close(self) -> None:
        self._closed = True
        self._wake()

    def fail(self, error: BaseException) -> None:
        """Close the channel with an error: readers get the values they have not seen, then ``error``."""
        self._error = error
        self.close()

    def _wake(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    async def updates(self) -> AsyncIterator[T]:
        """Yield the current value (if any) and then each new one; ends when the channel closes."""
        seen = 0
        while True:
            event = self._changed
            if self._seq != seen and self._value is not None:
                seen = self._seq
                yield self._value
                continue
            if self._closed:
                if self._error is not None:
                    raise self._error
                return
            await event.wait()

    async def wait_for(self, predicate: Callable[[T], bool], timeout_s: float) -> T:
        """The first value (current or future) satisfying ``predicate``; ClientTimeoutError after timeout."""
        try:
            async with asyncio.timeout(timeout_s):
                async for value in self.updates():
                    if predicate(value):
                        return value
        except TimeoutError:
            pass
        raise ClientTimeoutError(f"no matching value within {timeout_s:g} s (latest: {self._value!r})")


@dataclass(frozen=True)
class MembershipSnapshot:
    """One consistent-or-not read of ``serverDescriptors``: assignment, its version, the live servers."""

    assignment: PartitionAssignment
    data_version: int
    cversion: int
    servers: dict[str, ServerDescriptor]

    @property
    def consistent(self) -> bool:
        return self.assignment.cversion == self.cversion

    def live_servers(self) -> dict[int, ServerDescriptor]:
        """Live servers by id (one descriptor per id: the newest znode wins)."""
        out: dict[int, ServerDescriptor] = {}
        for node in sorted(self.servers):
            d = self.servers[node]
            out[d.server_id] = d
        return out


class _AssignmentView:
    """Shared machinery: watches, the refresh task, session-state handling."""

    def __init__(self, client: KazooClient, root: str) -> None:
        self.client = client
        self.paths = ClusterPaths(root)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dirty = asyncio.Event()
        self._tasks = TaskSet(self._task_failed)  # The refresh task.
        self._closed = False
        self._connected = True

    # -- kazoo threads -------------------------------------------------------------------------------------

    def _on_watch(self, _event: Any) -> None:
        self._from_kazoo_thread(self._dirty.set)

    def _on_state(self, state: str) -> None:
        self._from_kazoo_thread(self._state_changed, state)

    def _from_kazoo_thread(self, fn: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        if loop is None or self._closed:
            return
        with contextlib.suppress(RuntimeError):  # The loop was closed under us: nothing left to notify.
            loop.call_soon_threadsafe(fn, *args)

    # -- event loop ------------------------------------------------------------------------------------------

    def _state_changed(self, state: str) -> None:
        if self._closed:
            return
        if state == KazooState.CONNECTED:
            self._connected = True
            self._dirty.set()
        else:
            self._connected = False

    async def _start_task(self, name: str) -> None:
        self._loop = asyncio.get_running_loop()
        self.client.add_listener(self._on_state)
        self._dirty.set()
        self._tasks.spawn(self._run(), name)

    def _task_failed(self, _task: asyncio.Task[Any], error: BaseException) -> None:
        # The refresh task handles ZooKeeper's errors itself; anything that ends it is a bug. Its readers must
        # hear of it (their iterator raises), or they would wait for an update that never comes; they report
        # it, once (the server fails, the client's driver stops), so it is not logged here as well.
        if not self._closed:
            self._failed(error)

    def _failed(self, error: BaseException) -> None:
        raise NotImplementedError

    async def _run(self) -> None:
        while not self._closed:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                await self._refresh()
            except (ClusterError, MetadataError) as e:
                if isinstance(e, ConcurrentUpdateError):
                    log.debug("%s: lost an assignment race, re-reading", self.paths.root)
                elif isinstance(e, ZooKeeperUnavailableError):
                    # waltz.cluster.zk logs the state change once; a line per failed refresh would repeat it.
                    log.debug("%s: refresh failed: %s", self.paths.root, e)
                    await asyncio.sleep(RETRY_DELAY_S)
                else:
                    log.info("%s: refresh failed: %s", self.paths.root, e)
                    await asyncio.sleep(RETRY_DELAY_S)
                # While disconnected, the CONNECTED transition sets the flag again.
                if self._connected:
                    self._dirty.set()

    async def _refresh(self) -> None:
        raise NotImplementedError

    def _read_snapshot(self) -> MembershipSnapshot:
        """Blocking: read the assignment and the live descriptors, leaving watches on both."""
        path = self.paths.server_descriptors
        with zk_errors("server descriptors"):
            if self.client.exists(self.paths.root) is None:
                raise MetadataError(f"no cluster at {self.paths.root}")
            raw, stat = self.client.get(path, watch=self._on_watch)
            children, child_stat = self.client.get_children(path, watch=self._on_watch, include_data=True)
            servers: dict[str, ServerDescriptor] = {}
            for child in children:
                try:
                    data, _ = self.client.get(f"{path}/{child}")
                except NoNodeError:
                    continue
                servers[child] = ServerDescriptor.decode(data)
        # The children's cversion is read after the data; if membership changed in between, the child watch
        # has fired and we will read again.
        return MembershipSnapshot(
            PartitionAssignment.decode(raw), int(stat.version), int(child_stat.cversion), servers
        )

    async def _stop_task(self) -> None:
        self._closed = True
        self.client.remove_listener(self._on_state)
        await self._tasks.aclose()


class ClusterMember(_AssignmentView):
    """A Waltz server's membership: registration, coordination, and its own partitions.

    ``partitions`` (and each value of :meth:`assignments`) is ``{partition id: generation}`` for this server,
    taken only from an assignment consistent with the current membership. The client is not owned: the
    caller starts it before and stops it after the member.
    """

    def __init__(
        self,
        client: KazooClient,
        root: str,
        host: str,
        port: int,
        preferred_partitions: Iterable[int] = (),
        *,
        server_id: int | None = None,
        on_assignment: Callable[[dict[int, int]], None] | None = None,
        on_suspended: Callable[[], None] | None = None,
        on_resumed: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(client, root)
        self.host = host
        self.port = port
        self.preferred_partitions = tuple(sorted(set(preferred_partitions)))
        self.server_id: int = server_id if server_id is not None else -1
        self._on_assignment = on_assignment
        self._on_suspended = on_suspended
        self._on_resumed = on_resumed
        self._partitions: Latest[dict[int, int]] = Latest()
        self._node: str | None = None
        self._session_id: int | None = None
        self._suspended = False
        self._coordinator = False

    @property
    def partitions(self) -> dict[int, int]:
        return dict(self._partitions.value or {})

    @property
    def suspended(self) -> bool:
        """True from SUSPENDED/LOST until the connection (and registration) is back."""
        return self._suspended

    @property
    def is_coordinator(self) -> bool:
        return self._coordinator

    @property
    def node(self) -> str | None:
        """The path of our descriptor znode (None while not registered)."""
        return self._node

    def descriptor(self) -> ServerDescriptor:
        return ServerDescriptor(self.server_id, self.host, self.port, self.preferred_partitions)

    async def start(self) -> None:
        """Take a server id (unless given), register, and start following assignments."""
        await asyncio.to_thread(features.check_supported, self.client, self.paths.root, "this server")
        if self.server_id < 0:
            self.server_id = await asyncio.to_thread(next_id, self.client, self.paths.root, "server")
        await asyncio.to_thread(self._register)
        await self._start_task(f"cluster-member-{self.server_id}")

    async def close(self) -> None:
        """Stop following, and remove our descriptor so our partitions move now rather than at expiry."""
        await self._stop_task()
        node, self._node = self._node, None
        if node is not None and self.client.connected:
            with contextlib.suppress(ClusterError, MetadataError):
                await asyncio.to_thread(self._delete_node, node)
        self._partitions.close()

    async def __aenter__(self) -> ClusterMember:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def assignments(self) -> AsyncIterator[dict[int, int]]:
        """This server's partitions, now and after every change, until :meth:`close`."""
        return self._partitions.updates()

    async def wait_for_partitions(
        self, predicate: Callable[[dict[int, int]], bool], timeout_s: float = 30.0
    ) -> dict[int, int]:
        return await self._partitions.wait_for(predicate, timeout_s)

    async def set_preferred_partitions(self, partitions: Iterable[int]) -> None:
        """Change our preferences and re-register, which forces a new assignment (preferences are not kept
        across restarts, as in the original)."""
        self.preferred_partitions = tuple(sorted(set(partitions)))
        await asyncio.to_thread(self._register)
        self._dirty.set()

    # -- blocking helpers (run in threads) -------------------------------------------------------------------

    def _delete_node(self, node: str) -> None:
        with zk_errors("server descriptor"), contextlib.suppress(NoNodeError):
            self.client.delete(node)

    def _register(self) -> None:
        """Create our ephemeral descriptor, removing any other one of ours from this same session (left by
        a create whose reply was lost, or by a previous registration)."""
        with zk_errors("register server"):
            session_id = self.client.client_id[0] if self.client.client_id else None
            parent = self.paths.server_descriptors
            for child in self.client.get_children(parent):
                stat = self.client.exists(f"{parent}/{child}")
                if stat is not None and stat.ephemeralOwner == session_id:
                    with contextlib.suppress(NoNodeError):
                        self.client.delete(f"{parent}/{child}")
            node = self.client.create(
                self.paths.server_descriptor_prefix, self.descriptor().encode(), ephemeral=True, sequence=True
            )
        # Beside the descriptor (whose format Waltz 0.1.0 servers read, so it cannot carry more): the
        # feature versions this server supports, for `waltz cluster raise-features`.
        features.register_process(
            self.client,
            self.paths.root,
            features.ProcessInfo(
                "server",
                str(self.server_id),
                __version__,
                features.SUPPORTED_FEATURES,
                f"{self.host}:{self.port}",
            ),
        )
        self._node = node
        self._session_id = session_id
        log.info("server %d registered as %s", self.server_id, node)

    def _coordinate(self) -> tuple[MembershipSnapshot, bool]:
        """Read; if we are the coordinator and the assignment is stale, write a new one (version-checked)."""
        snap = self._read_snapshot()
        live = snap.live_servers()
        coordinator = bool(live) and min(live) == self.server_id
        if coordinator and not snap.consistent:
            new = assign_partitions(
                snap.assignment.servers,
                {sid: d.preferred_partitions for sid, d in live.items()},
                snap.assignment.num_partitions,
            )
            value = PartitionAssignment(snap.cversion, snap.assignment.num_partitions, new)
            with zk_errors("publish partition assignment"):
                self.client.set(self.paths.server_descriptors, value.encode(), version=snap.data_version)
            log.info("coordinator %d published assignment for cversion %d", self.server_id, snap.cversion)
        return snap, coordinator

    # -- event loop ------------------------------------------------------------------------------------------

    def _state_changed(self, state: str) -> None:
        if self._closed:
            return
        super()._state_changed(state)
        if state == KazooState.SUSPENDED:
            self._set_suspended(True)
        elif state == KazooState.LOST:
            # Our ephemeral descriptor is gone with the session: register again, and stay suspended until an
            # assignment for the new membership says what we own (see the module docstring).
            self._node = None
            self._set_suspended(True)
        elif state == KazooState.CONNECTED and self._node is not None:
            self._set_suspended(False)

    def _set_suspended(self, suspended: bool) -> None:
        if suspended == self._suspended:
            return
        self._suspended = suspended
        callback = self._on_suspended if suspended else self._on_resumed
        # The ZooKeeper state change itself is logged once, by waltz.cluster.zk.
        log.debug("server %d %s", self.server_id, "suspended" if suspended else "resumed")
        if callback is not None:
            callback()

    def _failed(self, error: BaseException) -> None:
        self._partitions.fail(error)

    def _deliver(self, partitions: dict[int, int]) -> None:
        if self._partitions.publish(partitions) and self._on_assignment is not None:
            self._on_assignment(dict(partitions))

    async def _refresh(self) -> None:
        if self._node is None:
            await asyncio.to_thread(self._register)
        snap, self._coordinator = await asyncio.to_thread(self._coordinate)
        if not snap.consistent:
            return  # The coordinator's write (or our own) triggers the data watch.
        mine = dict(snap.assignment.servers.get(self.server_id, {}))
        if self._node is not None and self._node.rsplit("/", 1)[-1] in snap.servers:
            self._deliver(mine)
            if self._connected:
                # After a LOST session this is the first moment we know what we own again.
                self._set_suspended(False)


class ClusterWatcher(_AssignmentView):
    """Read-only view for clients: ``{partition id: (server "host:port", generation)}``, on every change.

    Only assignments consistent with the live membership are delivered, so a departed server never
    appears. The client is not owned.
    """

    def __init__(self, client: KazooClient, root: str) -> None:
        super().__init__(client, root)
        self._endpoints: Latest[dict[int, tuple[str, int]]] = Latest()

    @property
    def endpoints(self) -> dict[int, tuple[str, int]]:
        return dict(self._endpoints.value or {})

    async def start(self) -> None:
        await self._start_task("cluster-watcher")

    async def close(self) -> None:
        await self._stop_task()
        self._endpoints.close()

    async def __aenter__(self) -> ClusterWatcher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def updates(self) -> AsyncIterator[dict[int, tuple[str, int]]]:
        return self._endpoints.updates()

    def _failed(self, error: BaseException) -> None:
        self._endpoints.fail(error)

    async def wait_for(
        self, predicate: Callable[[dict[int, tuple[str, int]]], bool], timeout_s: float = 30.0
    ) -> dict[int, tuple[str, int]]:
        return await self._endpoints.wait_for(predicate, timeout_s)

    async def _refresh(self) -> None:
        snap = await asyncio.to_thread(self._read_snapshot)
        if not snap.consistent:
            return
        live = snap.live_servers()
        out: dict[int, tuple[str, int]] = {}
        for sid, parts in snap.assignment.servers.items():
            d = live.get(sid)
            if d is None:
                continue
            for p, g in parts.items():
                out[p] = (d.endpoint, g)
        self._endpoints.publish(dict(sorted(out.items())))
