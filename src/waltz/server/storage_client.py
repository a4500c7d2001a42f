"""Async clients of a storage node's data port (:class:`StorageClient`) and admin port (:class:`AdminClient`).

One :class:`StorageClient` per storage node is shared by every partition a server writes: it opens the
connection with the cluster key (a failed open is fatal and closes it), then multiplexes concurrent
requests by sequence number. Failure responses are raised as the Waltz error they carry
(:func:`waltz.protocol.storage.failure_to_error`), e.g. SessionFencedError or PartitionNotAssignedError.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import Callable, Sequence
from ssl import SSLContext
from types import TracebackType
from typing import Generic, NamedTuple, Self, TypeVar, cast

from waltz.errors import LocalProtocolError, RemoteProtocolError, StorageError, StorageRpcError
from waltz.protocol import admin as adm
from waltz.protocol import storage as st
from waltz.protocol import storage_multi as sm
from waltz.protocol.framing import MAGIC_ADMIN, MAGIC_STORAGE
from waltz.protocol.record_run import RunBytes
from waltz.protocol.records import Record, RecordHeader
from waltz.transport import RpcClient, open_connection

DEFAULT_TIMEOUT_MS = 30_000
DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024


class EncodedAppend(NamedTuple):
    """An AppendRequest whose records are encoded already
    (:func:`waltz.protocol.storage.append_request_body`): a batch goes to every replica, and its records are
    encoded once for all of them."""

    session_id: int
    seq_num: int
    partition_id: int
    body: bytes


def _encode_storage(msg: object) -> bytes | tuple[bytes, bytes]:
    """The connection's encoder: storage messages, and appends whose records are encoded already. An
    append's records go as their own part after the request's prefix (see ``RpcClient``): joining them to
    it, then to the frame header, copied a batch twice per replica on its way to the socket."""
    if type(msg) is EncodedAppend:
        return st.encode_append_request(msg.session_id, msg.seq_num, msg.partition_id, b""), msg.body
    if not isinstance(msg, st.StorageMessage):
        raise LocalProtocolError(f"not a storage message: {type(msg).__name__}")
    return st.encode(msg)


def _storage_error(resp: st.StorageMessage) -> BaseException | None:
    return st.failure_to_error(resp) if isinstance(resp, st.FailureResponse) else None


def _admin_error(resp: adm.AdminMessage) -> BaseException | None:
    return adm.failure_to_error(resp) if isinstance(resp, adm.AdminFailureResponse) else None


M = TypeVar("M")
T = TypeVar("T")


async def _open_rpc(
    host: str,
    port: int,
    *,
    magic: int,
    versions: Sequence[int],
    hello_text: str,
    encode: Callable[[M], bytes | tuple[bytes, bytes]],
    decode: Callable[[bytes], M],
    seq_of: Callable[[M], int],
    error_of: Callable[[M], BaseException | None],
    ok_type: type[object] | None,
    max_in_flight: int,
    max_frame_bytes: int,
    connect_timeout_ms: int,
    ssl: SSLContext | None,
    name: str,
    decoder_for: Callable[[int], Callable[[bytes], M]] | None = None,
) -> RpcClient[M, M]:
    conn = await open_connection(
        host,
        port,
        magic=magic,
        versions=versions,
        hello_text=hello_text,
        max_frame_bytes=max_frame_bytes,
        connect_timeout_ms=connect_timeout_ms,
        ssl=ssl,
    )
    if decoder_for is not None:
        # The codec's messages differ by version: decode as the version this connection negotiated.
        decode = decoder_for(conn.negotiated_version)
    return RpcClient(
        conn,
        encode=encode,
        decode=decode,
        request_seq=seq_of,
        response_seq=seq_of,
        error_of=error_of,
        ok_type=ok_type,
        max_in_flight=max_in_flight,
        name=name,
    )


async def _open_admin_rpc(
    host: str, port: int, max_in_flight: int, connect_timeout_ms: int, ssl: SSLContext | None
) -> RpcClient[adm.AdminMessage, adm.AdminMessage]:
    """An RPC connection to a storage node's admin port, hello done, not yet opened."""
    return await _open_rpc(
        host,
        port,
        magic=MAGIC_ADMIN,
        versions=adm.ADMIN_VERSIONS,
        hello_text=adm.ADMIN_CLIENT_HELLO,
        encode=adm.encode,
        decode=adm.decode,
        seq_of=adm.seq_num_of,
        error_of=_admin_error,
        ok_type=adm.AdminSuccessResponse,
        max_in_flight=max_in_flight,
        max_frame_bytes=DEFAULT_MAX_FRAME_BYTES,
        connect_timeout_ms=connect_timeout_ms,
        ssl=ssl,
        name=f"storage admin {host}:{port}",
        decoder_for=_admin_decoder,
    )


def _storage_decoder(version: int) -> Callable[[bytes], st.StorageMessage]:
    """Decode storage payloads as codec ``version`` (a message of a later version is refused)."""
    return functools.partial(st.decode, version=version)


def _admin_decoder(version: int) -> Callable[[bytes], adm.AdminMessage]:
    return functools.partial(adm.decode, version=version)


class _Endpoint(Generic[M]):
    """What both clients share: one multiplexed connection, typed calls, closing."""

    def __init__(self, rpc: RpcClient[M, M], address: str) -> None:
        self._rpc = rpc
        self.address = address

    async def _opened(self, open_request: M, expected: type[object]) -> Self:
        """Send the open request (cluster key check); close the connection if it fails."""
        try:
            await self._call(open_request, expected)
        except BaseException:
            await self._rpc.aclose()
            raise
        return self

    @property
    def is_usable(self) -> bool:
        return self._rpc.is_usable

    @property
    def last_answer_s(self) -> float:
        """Loop time at which the node last answered anything on this connection (-inf if never)."""
        return self._rpc.last_answer_s

    def add_loss_listener(self, listener: Callable[[BaseException], None]) -> None:
        """Call ``listener(error)`` once when this connection is lost (``RpcClient.add_loss_listener``)."""
        self._rpc.add_loss_listener(listener)

    def remove_loss_listener(self, listener: Callable[[BaseException], None]) -> None:
        self._rpc.remove_loss_listener(listener)

    async def aclose(self) -> None:
        await self._rpc.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def _call(self, msg: M, expected: type[T], timeout_ms: int = DEFAULT_TIMEOUT_MS) -> T:
        resp = await self._rpc.call(msg, timeout_ms)
        if not isinstance(resp, expected):
            raise StorageRpcError(
                f"expected {expected.__name__} from {self.address}, got {type(resp).__name__}"
            )
        return resp

    def _seq(self) -> int:
        return self._rpc.next_seq()


class StorageClient(_Endpoint[st.StorageMessage]):
    """A connection to one storage node's data port. Safe for concurrent use by many tasks of one loop.

    With :attr:`multi_append` set (the cluster's feature version allows it) and storage codec V2 negotiated,
    the appends :meth:`start_append_encoded` is given while others are in flight on the connection are held
    until the end of the loop pass and leave together, in one MultiAppendRequest
    (:mod:`waltz.protocol.storage_multi`), each still answered, and its future resolved, on its own. Every
    other request sends the held appends first, so the node sees the requests in the order they were made.
    """

    def __init__(self, rpc: RpcClient[st.StorageMessage, st.StorageMessage], address: str) -> None:
        super().__init__(rpc, address)
        self.multi_append = False
        """Whether the cluster's feature version allows MultiAppendRequests (set by the server)."""
        self._multi_capable = rpc.connection.negotiated_version >= sm.MultiAppendRequest.MIN_VERSION
        self._held: list[bytes] = []
        """Whole AppendRequest payloads held for this loop pass's MultiAppendRequest, in order."""
        self._held_bytes = 0
        self._flush_handle: asyncio.Handle | None = None
        self._loop = asyncio.get_running_loop()
        self.multi_requests = 0
        """MultiAppendRequests sent (each carries two appends or more)."""

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        cluster_key: uuid.UUID,
        num_partitions: int,
        *,
        connect_timeout_ms: int = 5_000,
        max_in_flight: int = 1024,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        ssl: SSLContext | None = None,
    ) -> StorageClient:
        """Connect (over TLS with ``ssl``, see :mod:`waltz.tls`) and open with the cluster key; raises
        ClusterKeyMismatchError on a wrong key."""
        rpc = await _open_rpc(
            host,
            port,
            magic=MAGIC_STORAGE,
            versions=st.STORAGE_VERSIONS,
            hello_text=st.STORAGE_CLIENT_HELLO,
            encode=_encode_storage,
            decode=st.decode,
            decoder_for=_storage_decoder,
            seq_of=st.seq_num_of,
            error_of=_storage_error,
            ok_type=st.SuccessResponse,  # every append's answer: no _storage_error call for it
            max_in_flight=max_in_flight,
            max_frame_bytes=max_frame_bytes,
            connect_timeout_ms=connect_timeout_ms,
            ssl=ssl,
            name=f"storage {host}:{port}",
        )
        # The open is answered with the conventional prefix; it gets a fresh sequence number so the
        # multiplexer matches it like any other request.
        return await cls(rpc, f"{host}:{port}")._opened(
            st.OpenRequest(-1, rpc.next_seq(), -1, cluster_key, num_partitions), st.SuccessResponse
        )

    async def last_session_info(
        self, session_id: int, partition_id: int, *, offline: bool = False
    ) -> st.SessionInfo:
        resp = await self._call(
            st.LastSessionInfoRequest(session_id, self._seq(), partition_id, offline),
            st.LastSessionInfoResponse,
        )
        return resp.info

    async def max_transaction_id(self, session_id: int, partition_id: int, *, offline: bool = False) -> int:
        resp = await self._call(
            st.MaxTransactionIdRequest(session_id, self._seq(), partition_id, offline),
            st.MaxTransactionIdResponse,
        )
        return resp.transaction_id

    async def truncate(
        self,
        session_id: int,
        partition_id: int,
        transaction_id: int,
        *,
        offline: bool = False,
        operator_repair: bool = False,
        reason: str = "",
    ) -> int:
        """Truncate the replica to ``transaction_id``; the node refuses to go below its persisted low-water
        mark unless ``operator_repair`` (only the operator's repair tools set it). ``reason`` is logged by the
        node (at most ``MAX_TRUNCATE_REASON_BYTES``, cut to fit here)."""
        raw = reason.encode("utf-8")[: st.MAX_TRUNCATE_REASON_BYTES]
        resp = await self._call(
            st.TruncateRequest(
                session_id,
                self._seq(),
                partition_id,
                transaction_id,
                offline,
                operator_repair,
                raw.decode("utf-8", errors="ignore"),
            ),
            st.MaxTransactionIdResponse,
        )
        return resp.transaction_id

    async def set_low_water_mark(
        self, session_id: int, partition_id: int, low_water_mark: int, *, offline: bool = False
    ) -> None:
        await self._call(
            st.SetLowWaterMarkRequest(session_id, self._seq(), partition_id, low_water_mark, offline),
            st.SuccessResponse,
        )

    async def trim(
        self, session_id: int, partition_id: int, trim_point: int, *, offline: bool = False
    ) -> int:
        """Raise the replica's trim point (see :mod:`waltz.storage.retention`); returns the one in force."""
        resp = await self._call(
            st.TrimRequest(session_id, self._seq(), partition_id, trim_point, offline), st.TrimResponse
        )
        return resp.trim_point

    async def append(
        self, session_id: int, partition_id: int, records: Sequence[Record], *, offline: bool = False
    ) -> None:
        """Append a dense batch; returns once the node fsynced it."""
        await self._call(
            st.AppendRequest(session_id, self._seq(), partition_id, records, offline), st.SuccessResponse
        )

    async def append_encoded(self, session_id: int, partition_id: int, body: bytes) -> None:
        """:meth:`append` of records encoded by :func:`waltz.protocol.storage.append_request_body`."""
        # The request rides the storage connection like any message (its encoder knows this type; the
        # sequence number is read the same way): the cast only tells the type checker so.
        request = cast(st.StorageMessage, EncodedAppend(session_id, self._seq(), partition_id, body))
        await self._call(request, st.SuccessResponse)

    def start_append_encoded(
        self,
        session_id: int,
        partition_id: int,
        body: bytes,
        on_answer: Callable[[asyncio.Future[object]], None] | None = None,
    ) -> asyncio.Future[object]:
        """:meth:`append_encoded` sent now, without a timeout of its own (see ``RpcClient.start_call``, also
        for ``on_answer``): the future's result is the node's SuccessResponse once it fsynced the records."""
        # (Once per replica of every append: the types are adjusted with ignores, not typing.cast calls.)
        rpc = self._rpc
        seq = rpc.next_seq()
        # Appends held already are in flight: the in_flight call is needed only for the first of a pass.
        if not (self.multi_append and self._multi_capable and (self._held or rpc.in_flight)):
            request: st.StorageMessage = EncodedAppend(session_id, seq, partition_id, body)  # type: ignore[assignment]
            return rpc.start_call(request, on_answer)  # type: ignore[arg-type,return-value]
        # Held for this pass's MultiAppendRequest (see the class docstring).
        part = st.encode_append_request(session_id, seq, partition_id, body)
        held = self._held
        if held and (
            len(held) >= sm.MAX_MULTI_APPENDS or self._held_bytes + len(part) > sm.MAX_MULTI_APPEND_BYTES
        ):
            self._send_held()
        future = rpc.expect(seq, on_answer)  # type: ignore[arg-type]
        held.append(part)
        self._held_bytes += len(part)
        if self._flush_handle is None:
            self._flush_handle = self._loop.call_soon(self._send_held)
        return future  # type: ignore[return-value]

    def _send_held(self) -> None:
        """Send the held appends: one alone as an AppendRequest, several as one MultiAppendRequest."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        held, self._held, self._held_bytes = self._held, [], 0
        if len(held) == 1:
            self._rpc.send_payload(held[0])
        elif held:
            self.multi_requests += 1
            self._rpc.send_payload(sm.encode_multi_append(held))

    async def _call(
        self, msg: st.StorageMessage, expected: type[T], timeout_ms: int = DEFAULT_TIMEOUT_MS
    ) -> T:
        if self._held:
            self._send_held()  # the node sees requests in the order they were made
        return await super()._call(msg, expected, timeout_ms)

    async def read_header(
        self, session_id: int, partition_id: int, transaction_id: int
    ) -> RecordHeader | None:
        resp = await self._call(
            st.RecordHeaderRequest(session_id, self._seq(), partition_id, transaction_id),
            st.RecordHeaderResponse,
        )
        return resp.header

    async def read_record(self, session_id: int, partition_id: int, transaction_id: int) -> Record | None:
        resp = await self._call(
            st.RecordRequest(session_id, self._seq(), partition_id, transaction_id), st.RecordResponse
        )
        return resp.record

    async def read_headers(
        self, session_id: int, partition_id: int, transaction_id: int, max_records: int
    ) -> list[RecordHeader]:
        resp = await self._call(
            st.RecordHeaderListRequest(session_id, self._seq(), partition_id, transaction_id, max_records),
            st.RecordHeaderListResponse,
        )
        return list(resp.headers)

    async def read_records(
        self, session_id: int, partition_id: int, transaction_id: int, max_records: int
    ) -> list[Record]:
        resp = await self._call(
            st.RecordListRequest(session_id, self._seq(), partition_id, transaction_id, max_records),
            st.RecordListResponse,
        )
        return list(resp.records)

    async def read_run(
        self, session_id: int, partition_id: int, transaction_id: int, max_records: int, max_bytes: int
    ) -> tuple[int, RunBytes]:
        """Up to ``max_records`` records from ``transaction_id`` as stored (a record run, relayed: only its
        size against ``count`` and its first id are checked here, the rest by the reader):
        ``(count, run)``."""
        resp = await self._call(
            st.RecordRunRequest(
                session_id, self._seq(), partition_id, transaction_id, max_records, max_bytes
            ),
            st.RecordRunResponse,
        )
        if resp.count and resp.first != transaction_id:
            raise RemoteProtocolError(f"asked for a run from {transaction_id}, got one from {resp.first}")
        return resp.count, resp.run

    async def repair(self, session_id: int, partition_id: int, records: Sequence[Record]) -> None:
        """Send good copies of records this node reported damaged (see ``st.RepairRequest``)."""
        await self._call(st.RepairRequest(session_id, self._seq(), partition_id, records), st.SuccessResponse)

    async def damaged_records(self, session_id: int, partition_id: int, max_ids: int) -> list[int]:
        """Ids of stored records this node found damaged and has not had repaired yet, lowest first."""
        resp = await self._call(
            st.DamagedRecordsRequest(session_id, self._seq(), partition_id, max_ids),
            st.DamagedRecordsResponse,
        )
        return list(resp.transaction_ids)

    async def segment_sizes(
        self, session_id: int, partition_id: int, max_segments: int
    ) -> list[tuple[int, int]]:
        """``(first transaction id, bytes)`` of the replica's newest segments, oldest first; StorageError if
        the node speaks storage codec V0 (Waltz 0.1.0), which has no such request."""
        if not st.available(st.SegmentSizesRequest, self._rpc.connection.negotiated_version):
            raise StorageError(
                f"storage node {self.address} speaks storage codec V0 (Waltz 0.1.0): it cannot report its "
                "segment sizes (a retention limit in bytes needs every node at 0.2.0 or later)"
            )
        resp = await self._call(
            st.SegmentSizesRequest(session_id, self._seq(), partition_id, max_segments),
            st.SegmentSizesResponse,
        )
        return list(resp.segments)


class AdminClient(_Endpoint[adm.AdminMessage]):
    """A connection to one storage node's admin port."""

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        cluster_key: uuid.UUID,
        num_partitions: int,
        *,
        connect_timeout_ms: int = 5_000,
        ssl: SSLContext | None = None,
    ) -> AdminClient:
        """Connect (over TLS with ``ssl``) and open with the cluster key."""
        rpc = await _open_admin_rpc(host, port, 16, connect_timeout_ms, ssl)
        return await cls(rpc, f"{host}:{port}")._opened(
            adm.AdminOpenRequest(rpc.next_seq(), cluster_key, num_partitions), adm.AdminSuccessResponse
        )

    @classmethod
    async def identify(
        cls, host: str, port: int, *, connect_timeout_ms: int = 5_000, ssl: SSLContext | None = None
    ) -> adm.NodeIdentityResponse:
        """The cluster key and partition count the node's control file was made for, and its data port,
        asked without opening (no cluster key needed); the connection is closed afterwards."""
        rpc = await _open_admin_rpc(host, port, 1, connect_timeout_ms, ssl)
        async with cls(rpc, f"{host}:{port}") as client:
            return await client._call(adm.NodeIdentityRequest(rpc.next_seq()), adm.NodeIdentityResponse)

    @classmethod
    async def node_version(
        cls, host: str, port: int, *, connect_timeout_ms: int = 5_000, ssl: SSLContext | None = None
    ) -> adm.NodeVersionResponse | None:
        """The node's release and supported feature range, asked without opening; None if the node speaks
        admin codec V0 only (Waltz 0.1.0, whose range is feature version 1). The connection is closed."""
        rpc = await _open_admin_rpc(host, port, 1, connect_timeout_ms, ssl)
        async with cls(rpc, f"{host}:{port}") as client:
            if not adm.available(adm.NodeVersionRequest, rpc.connection.negotiated_version):
                return None
            return await client._call(adm.NodeVersionRequest(rpc.next_seq()), adm.NodeVersionResponse)

    async def set_assigned(
        self, partition_ids: Sequence[int], assigned: bool, *, delete_files: bool = False
    ) -> None:
        await self._call(
            adm.PartitionAssignmentRequest(self._seq(), tuple(partition_ids), assigned, delete_files),
            adm.AdminSuccessResponse,
        )

    async def set_available(self, partition_ids: Sequence[int], available: bool) -> None:
        await self._call(
            adm.PartitionAvailableRequest(self._seq(), tuple(partition_ids), available),
            adm.AdminSuccessResponse,
        )

    async def last_session_info(self, partition_id: int) -> st.SessionInfo:
        resp = await self._call(
            adm.LastSessionInfoRequest(self._seq(), partition_id), adm.LastSessionInfoResponse
        )
        return resp.info

    async def max_transaction_id(self, partition_id: int) -> int:
        resp = await self._call(
            adm.MaxTransactionIdRequest(self._seq(), partition_id), adm.MaxTransactionIdResponse
        )
        return resp.transaction_id

    async def read_records(self, partition_id: int, transaction_id: int, max_records: int) -> list[Record]:
        resp = await self._call(
            adm.RecordListRequest(self._seq(), partition_id, transaction_id, max_records),
            adm.RecordListResponse,
        )
        return list(resp.records)

    async def metrics_json(self) -> str:
        resp = await self._call(adm.MetricsRequest(self._seq()), adm.MetricsResponse)
        return resp.metrics_json

    async def partition_statuses(self) -> list[adm.PartitionStatus]:
        resp = await self._call(
            adm.AssignedPartitionStatusRequest(self._seq()), adm.AssignedPartitionStatusResponse
        )
        return list(resp.statuses)
