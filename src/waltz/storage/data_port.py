"""The data port of a storage node: one :class:`DataSession` per connection."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Any

from waltz.errors import (
    ClusterKeyMismatchError,
    ConnectionError_,
    PartitionNotAssignedError,
    RemoteProtocolError,
    SessionFencedError,
    StorageError,
    WaltzError,
)
from waltz.protocol import storage as st
from waltz.protocol import storage_multi as sm
from waltz.storage.authority import step_refusal
from waltz.storage.work import MAX_LIST_BYTES, MAX_LIST_RECORDS, REFUSAL_LOG_INTERVAL_S, InFlight, Item
from waltz.tls import peer_common_name
from waltz.transport import (
    ByteBudget,
    FramedConnection,
    RateLimitedLog,
    reason_kind,
)

if TYPE_CHECKING:
    from waltz.storage.services import NodeServices
    from waltz.storage.worker import StoragePartition

log = logging.getLogger(__name__)
_peer_warnings = RateLimitedLog(log)

SESSION_RECHECK_INTERVAL_S = 0.2
"""After a refusal, higher ids are refused without asking ZooKeeper again for this long (bounds the reads a
peer sending forged ids can cause; a real new session retries after its back-off and passes)."""
RECORD_RESPONSE_ESTIMATE_BYTES = 1024 * 1024
"""What a single-record read reserves from its connection's response budget (its size is unknown before)."""
HEADER_ESTIMATE_BYTES = 64
"""What one record header in a header list reserves (a header is about 40 bytes on the wire)."""


def _response_estimate(msg: st.StorageMessage) -> int:
    """The bytes a read request's response may take, reserved from the connection's budget (0: small)."""
    if isinstance(msg, st.RecordRunRequest):
        return max(0, min(msg.max_bytes, MAX_LIST_BYTES))
    if isinstance(msg, st.RecordListRequest):
        return MAX_LIST_BYTES
    if isinstance(msg, st.RecordRequest):
        return RECORD_RESPONSE_ESTIMATE_BYTES
    if isinstance(msg, st.RecordHeaderListRequest):
        return max(0, min(msg.max_records, MAX_LIST_RECORDS)) * HEADER_ESTIMATE_BYTES
    return 0


def peer_refused(node: NodeServices, conn: FramedConnection, port: str) -> bool:
    """True (logged) if ``storage.ssl.allowedPeers`` is set and the peer's certificate is not listed: a
    client certificate from the same CA must not reach the ports that fence, truncate and unassign."""
    allowed = node.config.allowed_peers
    if not allowed:
        return False
    name = peer_common_name(conn.peercert)
    if name in allowed:
        return False
    node.metrics.refused_peers.labels(port).inc()
    _peer_warnings.warning(
        conn.source,
        f"peer-refused:{port}",
        "refusing %s connection from %s: certificate %r is not in storage.ssl.allowedPeers",
        port,
        conn.peername,
        name,
    )
    return True


async def serve_data(node: NodeServices, conn: FramedConnection) -> None:
    if peer_refused(node, conn, "data"):
        return
    node.metrics.connections.inc()
    try:
        await conn.serve_payloads(DataSession(node, conn).on_payload)
    except ConnectionError_:
        pass
    finally:
        node.metrics.connections.dec()


async def session_refusal(
    node: NodeServices, part: StoragePartition, session_id: int, peer: Any
) -> WaltzError | None:
    """Why ``session_id`` may not fence ``part`` (None: it may): the cluster never handed it out, or, on a
    standalone node, it jumps further than ``storage.maxSessionIdStep``."""
    if session_id <= part.verified_session_id:
        return None
    if node.authority is None:
        return _standalone_refusal(node, part, session_id, peer)
    async with part.session_check:  # One ZooKeeper read at a time per partition.
        if session_id <= part.verified_session_id:
            return None
        now = time.monotonic()
        if now - part.last_refusal_s >= SESSION_RECHECK_INTERVAL_S:
            try:
                newest = await node.authority.newest_session_id(part.partition_id)
            except (WaltzError, TimeoutError) as e:
                # Fail closed: a new session cannot be taken without ZooKeeper either.
                return StorageError(
                    f"cannot confirm session {session_id} of partition {part.partition_id} with the "
                    f"cluster's metadata: {e!r}"
                )
            part.verified_session_id = max(part.verified_session_id, newest)
            if session_id <= part.verified_session_id:
                return None
            part.last_refusal_s = now
    node.metrics.refused_sessions.labels(part.partition_id).inc()
    if now - part.last_refusal_log_s >= REFUSAL_LOG_INTERVAL_S:
        part.last_refusal_log_s = now
        log.warning(
            "partition %d: refused session id %d from %s: the cluster's metadata records no session "
            "above %d (a forged or corrupt request; it fences nothing)",
            part.partition_id,
            session_id,
            peer,
            part.verified_session_id,
        )
    return SessionFencedError(
        f"session {session_id} of partition {part.partition_id} was never handed out by the cluster "
        f"(newest recorded: {part.verified_session_id}); refused"
    )


def _standalone_refusal(
    node: NodeServices, part: StoragePartition, session_id: int, peer: Any
) -> WaltzError | None:
    """The standalone bound (see :func:`waltz.storage.authority.step_refusal`)."""
    why = step_refusal(session_id, part.verified_session_id, node.config.max_session_id_step)
    if why is None:
        part.verified_session_id = session_id  # accepted: the next step is measured from here
        return None
    node.metrics.refused_sessions.labels(part.partition_id).inc()
    now = time.monotonic()
    if now - part.last_refusal_log_s >= REFUSAL_LOG_INTERVAL_S:
        part.last_refusal_log_s = now
        log.warning(
            "partition %d: refused session id %d from %s: %s (a corrupt or forged request; it fences "
            "nothing; if this replica joins a partition whose sessions really are that far on, raise "
            "storage.maxSessionIdStep)",
            part.partition_id,
            session_id,
            peer,
            why,
        )
    return SessionFencedError(f"partition {part.partition_id}: {why}; refused")


class DataSession:
    """One data connection's requests: decoded, checked and queued (or, for an append the partition can take
    at once, written and answered) in the transport's callback that read them (see
    :meth:`FramedConnection.serve_payloads`). What has to wait (a full queue or connection bound, a new
    session id to confirm) continues in the connection's task, reading paused, so requests keep their order
    and a peer that floods is pushed back by TCP."""

    def __init__(self, node: NodeServices, conn: FramedConnection) -> None:
        self.node = node
        self.conn = conn
        self.version = conn.negotiated_version
        """The storage codec version of the connection (fixed by its hello)."""
        self.opened = False
        self.slots = InFlight(node.config.connection_max_in_flight)
        """Unanswered requests of this connection (bounded)."""
        self.budget = ByteBudget(node.config.connection_max_response_bytes)
        """Bytes of read responses this connection may hold (bounded)."""

    def on_payload(self, payload: bytes) -> Awaitable[None] | None:
        conn = self.conn
        try:
            msg = sm.decode(payload, self.version)
        except RemoteProtocolError as e:
            _peer_warnings.warning(
                conn.source,
                reason_kind("decode", e),
                "closing storage connection from %s: %s",
                conn.peername,
                e,
            )
            raise  # ends serving; the connection is closed
        if isinstance(msg, sm.MultiAppendRequest):
            return self._multi(msg.appends)
        return self._request(msg, conn.read_ahead)

    def _request(self, msg: st.StorageMessage, ahead: bool) -> Awaitable[None] | None:
        """Check and queue (or answer) one request; ``ahead``: more requests follow it right away."""
        conn = self.conn
        if not self.opened or type(msg) is st.OpenRequest:
            self._open(msg)
            return None
        partitions = self.node.partitions
        if not 0 <= msg.partition_id < len(partitions):
            err = PartitionNotAssignedError(f"Partition:{msg.partition_id} does not exist.")
            conn.send(st.encode(st.failure_from_error(msg.session_id, msg.seq_num, msg.partition_id, err)))
            return None
        part = partitions[msg.partition_id]
        if msg.session_id > part.session_id:
            return self._admit_new_session(msg, part, ahead)
        return self._admit(msg, part, ahead)

    def _multi(self, appends: Sequence[st.AppendRequest]) -> Awaitable[None] | None:
        """A MultiAppendRequest: each append as if it had arrived alone, in order (the same checks, its own
        response); the rest continue in the connection's task once one has to wait."""
        requests = self.node.metrics.requests
        requests.inc("MultiAppendRequest")
        requests.inc("AppendInMultiAppend", len(appends))  # also counted as AppendRequests, by the worker
        last = len(appends) - 1
        ahead = self.conn.read_ahead
        for i, msg in enumerate(appends):
            pending = self._request(msg, ahead or i < last)
            if pending is not None:
                return self._multi_rest(pending, appends[i + 1 :], ahead)
        return None

    async def _multi_rest(
        self, pending: Awaitable[None], appends: Sequence[st.AppendRequest], ahead: bool
    ) -> None:
        await pending
        last = len(appends) - 1
        for i, msg in enumerate(appends):
            waiting = self._request(msg, ahead or i < last)
            if waiting is not None:
                await waiting

    def _open(self, msg: st.StorageMessage) -> None:
        conn = self.conn
        if isinstance(msg, st.OpenRequest):
            resp: st.StorageMessage
            try:
                self.node.check_identity(msg.cluster_key, msg.num_partitions)
                self.opened = True
                resp = st.SuccessResponse(msg.session_id, msg.seq_num, msg.partition_id)
            except ClusterKeyMismatchError as e:
                _peer_warnings.warning(
                    conn.source, reason_kind("open", e), "refusing open from %s: %s", conn.peername, e
                )
                resp = st.failure_from_error(msg.session_id, msg.seq_num, msg.partition_id, e)
            conn.send(st.encode(resp))
            return
        err = ClusterKeyMismatchError("the connection has not been opened with the cluster key")
        conn.send(st.encode(st.failure_from_error(msg.session_id, msg.seq_num, msg.partition_id, err)))

    async def _admit_new_session(self, msg: st.StorageMessage, part: StoragePartition, ahead: bool) -> None:
        """A request whose session id is newer than the partition's: confirmed (or refused), then fencing."""
        node = self.node
        conn = self.conn
        # Offline requests too: an offline SetLowWaterMark persists a newer id (recover-partition adopts its
        # source's), so a forged one must not get through that way either.
        refusal = await session_refusal(node, part, msg.session_id, conn.peername)
        if refusal is not None:
            conn.send(
                st.encode(st.failure_from_error(msg.session_id, msg.seq_num, msg.partition_id, refusal))
            )
            return
        offline = bool(getattr(msg, "offline", False) or getattr(msg, "used_by_offline_recovery", False))
        if not offline and msg.session_id > part.session_id:
            log.info(
                "partition %d: session %d from %s fences session %d",
                part.partition_id,
                msg.session_id,
                conn.peername,
                part.session_id,
            )
            part.session_id = msg.session_id  # fence older sessions on arrival
            node.metrics.session.labels(part.partition_id).set(part.session_id)
        pending = self._admit(msg, part, ahead)
        if pending is not None:
            await pending

    def _admit(self, msg: st.StorageMessage, part: StoragePartition, ahead: bool) -> Awaitable[None] | None:
        """Queue ``msg`` for its partition (or commit an append at once unless ``ahead``: more requests
        follow it); an awaitable if it has to wait."""
        append = type(msg) is st.AppendRequest
        reserved = 0 if append else _response_estimate(msg)
        if not self.slots.try_acquire():
            return self._admit_waiting(msg, part, reserved)
        if reserved and not self.budget.try_acquire(reserved):
            self.slots.release()
            return self._admit_waiting(msg, part, reserved)
        # Positional (msg, conn, op, done, slot, arrived_s, budget, reserved): keywords cost more per request.
        item = Item(msg, self.conn, None, None, self.slots, time.monotonic(), self.budget, reserved)
        if append and not ahead and part.may_commit_now:
            # Not when more requests were read behind it: those appends would each take an fsync of their
            # own here, one after the other; queued, the worker writes them together and fsyncs once.
            part.commit_now(item)
            return None
        if append and part.may_commit_soon:
            # One of many partitions' appends read at once: written here, fsynced in the node's batch.
            part.commit_soon(item)
            return None
        if part.enqueue_nowait(item):
            return None
        return part.enqueue(item)

    async def _admit_waiting(self, msg: st.StorageMessage, part: StoragePartition, reserved: int) -> None:
        await self.slots.acquire()  # bounded unanswered requests per connection
        if reserved:
            await self.budget.acquire(reserved)  # bounded bytes of read responses per connection
        item = Item(
            msg, self.conn, slot=self.slots, arrived_s=time.monotonic(), budget=self.budget, reserved=reserved
        )
        await part.enqueue(item)
