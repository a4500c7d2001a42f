"""A server partition (one incarnation: one generation on one server) answers every request it cannot take.

The store under it is a small fake (this tests the partition alone): always open, flushes at once.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from waltz.protocol import client_server as cs
from waltz.protocol.records import ReqId
from waltz.server.feed_cache import FeedCache
from waltz.server.partition import Partition
from waltz.server.store.store_partition import StorePartition
from waltz.server.transaction_cache import TransactionCache


class _Store:
    def __init__(self, generation: int) -> None:
        self.generation = generation
        self.high_water_mark = -1
        self.is_healthy = True
        self.submitted: list[ReqId] = []

    def submit(self, request: cs.AppendRequest, *_: object) -> bool:
        self.submitted.append(request.req_id)
        return True

    async def start(self) -> None:
        pass

    async def wait_open(self) -> int:
        return self.high_water_mark

    async def flush(self) -> int:
        return self.high_water_mark

    async def close(self) -> None:
        self.is_healthy = False


class _Peer:
    def __init__(self) -> None:
        self.sent: list[cs.Message] = []
        self.closed = False
        self.drain_needed = False

    def send(self, msg: cs.Message) -> None:
        self.sent.append(msg)

    async def drain(self) -> None:
        pass


async def _mounted(generation: int, client_id: int = 7) -> tuple[Partition, _Peer, ReqId]:
    part = Partition(
        0,
        cast(StorePartition, _Store(generation)),
        feed_cache=FeedCache(1 << 20, 1),
        transaction_cache=TransactionCache(1 << 20),
    )
    await part.start()
    peer = _Peer()
    session = ReqId.of(client_id, generation, 0, -1)
    await part.mount(cast(Any, peer), cs.MountRequest(session, -1, 1))
    for _ in range(100):
        if any(isinstance(m, cs.MountResponse) for m in peer.sent):
            break
        await asyncio.sleep(0.01)
    assert peer.sent[-1] == cs.MountResponse(session, cs.PartitionState.READY)
    return part, peer, session


def test_a_flush_naming_an_append_of_an_earlier_generation_is_taken() -> None:
    # A client's flush names its last pending append, which may have been sent before the partition moved:
    # refusing it for its generation would send the client into a loop of mounts (found by the fault suite).
    async def main() -> None:
        part, peer, _ = await _mounted(generation=3)
        try:
            old_append = ReqId.of(7, 2, 0, 41)
            assert part.accepts_flush(cast(Any, peer), old_append)
            # An append must carry the partition's generation, though.
            assert not part.accepts(cast(Any, peer), old_append)
            assert part.accepts(cast(Any, peer), ReqId.of(7, 3, 0, 42))
            # Another connection of the client is not its current mount: neither is taken.
            assert not part.accepts_flush(cast(Any, _Peer()), ReqId.of(7, 3, 0, 43))
        finally:
            await part.close()

    asyncio.run(main())


def test_closing_an_incarnation_tells_its_mounted_clients_to_mount_again() -> None:
    async def main() -> None:
        part, peer, session = await _mounted(generation=1)
        await part.close()
        assert peer.sent[-1] == cs.MountResponse(session, cs.PartitionState.NOT_READY)
        assert not part.accepts(cast(Any, peer), ReqId.of(7, 1, 0, 1))
        assert part.problem == "closed"

    asyncio.run(main())


def test_append_nowait_takes_only_appends_of_the_current_mount_in_this_generation() -> None:
    # append_nowait checks the mount on the ReqId's raw msb (client id << 32 | generation), kept in step with
    # the registrations: each case accepts() refuses must be refused there too, and nothing reach the store.
    async def main() -> None:
        for client_id in (7, -5):  # a negative client id: the msb's high half read unsigned
            part, peer, session = await _mounted(generation=3, client_id=client_id)
            store = cast(_Store, part.store)
            try:

                def append(generation: int, seq: int, client_id: int = client_id) -> cs.AppendRequest:
                    return cs.AppendRequest.build(ReqId.of(client_id, generation, 0, seq), -1, 0, b"x")

                assert part.append_nowait(cast(Any, peer), append(3, 1)) is True
                assert part.append_nowait(cast(Any, peer), append(2, 2)) is False  # an older generation
                assert part.append_nowait(cast(Any, peer), append(4, 3)) is False  # a newer one
                other = _Peer()
                assert part.append_nowait(cast(Any, other), append(3, 4)) is False  # not its mount
                other_client = cs.AppendRequest.build(ReqId.of(client_id + 1, 3, 0, 5), -1, 0, b"x")
                assert part.append_nowait(cast(Any, peer), other_client) is False  # never mounted
                # A newer connection of the client mounts: the old one's appends are refused from then on.
                newer = _Peer()
                await part.mount(cast(Any, newer), cs.MountRequest(session, -1, 2))
                assert part.append_nowait(cast(Any, peer), append(3, 6)) is False
                assert part.append_nowait(cast(Any, newer), append(3, 7)) is True
                part.disconnect(cast(Any, newer))
                assert part.append_nowait(cast(Any, newer), append(3, 8)) is False
                assert [r.seq_num for r in store.submitted] == [1, 7]
            finally:
                await part.close()
            assert part.append_nowait(cast(Any, peer), append(3, 9)) is False

    asyncio.run(main())
