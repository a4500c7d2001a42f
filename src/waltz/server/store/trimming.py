"""Passing a partition's trim point to its replicas (see ``docs/replication.md``, "Trim points").

The owning server learns trim points from ZooKeeper (``<root>/store/trim``, watched by the server) and tells
every participant of the open store session with a storage ``TrimRequest``; it tells them again each time a
session opens, so a replica that was down, lagging (it refuses a trim point above its log) or newly added
learns it then. Sending never blocks appends: it runs as a task of its own, one request per replica.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Sequence
from typing import Protocol, TypeVar

from waltz.errors import BrokenResourceError, WaltzError
from waltz.server.store.replica_session import ReplicaSession

log = logging.getLogger(__name__)

T = TypeVar("T")


class StoreSession(Protocol):
    """What this module uses of :class:`waltz.server.store.store_session.StoreSession` (which imports this
    module, so it is not imported here)."""

    partition_id: int
    session_id: int

    @property
    def participants(self) -> Sequence[ReplicaSession]: ...

    async def call(self, request: Awaitable[T]) -> T: ...


async def restart_at_trim_point(session: StoreSession, replica: ReplicaSession, trim_point: int) -> None:
    """A catch-up source trimmed what ``replica`` lacks: tell ``replica`` the trim point, so it starts its log
    again, empty, there (it need not hold what is below it), and carry on from its new max id.

    A failure is the lagging replica's own (raised to its task, which retries it or, were it load-bearing,
    ends the session): it is not a failure of the source, and ending the session for it would stop every
    write because one replica that was behind lost its connection."""
    conn = replica.connection
    if conn is None:
        raise BrokenResourceError(f"{replica.storage} has no connection")
    await session.call(conn.trim(trim_point))
    max_id = await session.call(conn.max_transaction_id())
    log.info(
        "partition %d: replica %s lagged below the trim point %d (max id %d); it restarts there (max id %d)",
        session.partition_id,
        replica.storage,
        trim_point,
        replica.max_id,
        max_id,
    )
    replica.max_id = replica.readable_max = max_id


async def tell_replicas(session: StoreSession, trim_point: int) -> dict[str, int]:
    """Send ``trim_point`` to each participant of ``session``; returns storage -> the trim point in force
    there, for the replicas that answered. A replica that fails or refuses is logged (WARNING, once per
    session) and told again when the next session opens."""
    told: dict[str, int] = {}
    for replica in list(session.participants):
        conn = replica.connection
        if conn is None:
            continue
        try:
            told[replica.storage] = await session.call(conn.trim(trim_point))
        except WaltzError as e:
            log.warning(
                "partition %d: replica %s did not take trim point %d (told again at the next session): %s",
                session.partition_id,
                replica.storage,
                trim_point,
                e,
            )
    if told:
        log.info(
            "partition %d: trim point %d sent to replicas %s (session %d)",
            session.partition_id,
            trim_point,
            sorted(told),
            session.session_id,
        )
    return told
