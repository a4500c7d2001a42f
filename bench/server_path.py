"""The server's CPU per append on its own: the append path of one partition in one process, no sockets.

``bench/append_e2e.py`` measures the server process among real storage nodes and a load generator, which
is what counts, but its figure moves by a few µs from run to run on a shared machine. This bench runs the
server's code for one append from the decoded frame to the FeedData payloads in one process, with
everything else stubbed, so a change of 0.5 µs per append shows:

* the client: a list of encoded AppendRequest payloads, handed over ``--burst`` at a time, as one socket
  read would (the connection loop's decode + ``Partition.append_nowait``, as ``server.py`` runs them), at
  most ``--in-flight`` unanswered;
* the storage nodes: three replica connections that encode each batch as the TCP one does
  (``append_request_body``, once for all three) and acknowledge it ``--ack-ms`` later (a quorum round
  trip: batches then form as they do against real nodes);
* the feed: a peer whose ``send_feed`` encodes and frames the entries as the server's connection does.

What it leaves out: socket reads and writes, frame decoding of the requests, the storage answers' decode.

    .venv/bin/python bench/server_path.py                    # plain appends
    .venv/bin/python bench/server_path.py --locks            # one write lock each, its own key
    .venv/bin/python bench/server_path.py --profile /tmp/p   # cProfile of the measured part

Prints CPU µs per committed append (process time over the measured appends, the stubs included).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import inspect
import struct
import time
from collections.abc import Sequence

from waltz.protocol import client_server as cs
from waltz.protocol import storage as st
from waltz.protocol.framing import MAGIC_CLIENT, ProtocolConnection
from waltz.protocol.records import Record, ReqId
from waltz.server.feed_cache import FeedCache, FeedEntry
from waltz.server.partition import Partition
from waltz.server.store.store_partition import StorePartition
from waltz.server.transaction_cache import TransactionCache
from waltz.testing.store import MemoryMetadataStore, NullConnector

VERSION = max(cs.SUPPORTED_VERSIONS)
GENERATION = 1
CLIENT_ID = 7


class _Bodies:
    """Encode a batch once for every replica, as ``adapters._AppendBodies`` does, and count the requests."""

    def __init__(self) -> None:
        self.records: Sequence[Record] | None = None
        self.body = b""
        self.requests = 0

    def on_append(self, records: Sequence[Record]) -> None:
        self.requests += 1
        if records is not self.records:
            self.body = st.append_request_body(records)
            self.records = records
        # The request's prefix; the body goes to the socket as it is (``storage_client._encode_storage``).
        st.encode_append_request(1, 0, 0, b"")


class _Peer:
    """The client connection as the partition sees it: frames what it sends, counts the feed."""

    def __init__(self) -> None:
        self.closed = False
        self.drain_needed = False
        self._proto = ProtocolConnection(MAGIC_CLIENT, cs.SUPPORTED_VERSIONS, "bench")
        self._proto.send_hello()
        self._proto.negotiated_version = VERSION
        self.fed = 0
        self.last_id = -1
        self.lock_failures = 0
        self.partition: Partition | None = None
        self.wake = asyncio.Event()

    def send(self, msg: cs.Message) -> None:
        if isinstance(msg, cs.FeedSuspended) and self.partition is not None:
            # Open the next window as the client does: as soon as it can, which is after a round trip (a
            # later loop pass here), never within the send.
            asyncio.get_running_loop().call_soon(
                self.partition.feed_request, self, cs.FeedRequest(msg.req_id, self.last_id)
            )
        elif isinstance(msg, cs.MountResponse) and self.partition is not None:
            # Mounted: open the first feed window, as the client does.
            self.partition.feed_request(self, cs.FeedRequest(msg.req_id, self.last_id))
        elif isinstance(msg, cs.LockFailure):
            self.lock_failures += 1
            self.fed += 1
            self.wake.set()
        self._proto.frame(cs.encode(msg, VERSION))

    def send_feed(self, entries: Sequence[FeedEntry], frames: dict[int, bytes] | None = None) -> None:
        # As the server's connection does: framed once per version for every client of the batch.
        data = frames.get(VERSION) if frames is not None else None
        if data is None:
            data = cs.frame_feed_entries(entries, VERSION)
            if frames is not None:
                frames[VERSION] = data
        self.fed += len(entries)
        self.last_id = entries[-1][0]
        self.wake.set()

    async def drain(self) -> None:
        pass


_HWM = struct.Struct(">q")


def _payloads(n: int, locks: bool) -> list[bytearray]:
    data = bytes(512)
    out = []
    for i in range(n):
        rid = ReqId.of(CLIENT_ID, GENERATION, 0, i)
        wl = ((CLIENT_ID << 24) ^ i) & 0x7FFFFFFF
        msg = cs.AppendRequest.build(rid, -1, 0, data, write_locks=(wl,) if locks else ())
        out.append(bytearray(cs.encode(msg, VERSION)))
    return out


async def _run(args: argparse.Namespace) -> float:
    # Three replicas that hold nothing, encode each batch as the TCP connection does and acknowledge it
    # --ack-ms later.
    connector = NullConnector(args.ack_ms / 1000)
    bodies = _Bodies()
    connector.on_append = bodies.on_append
    store = StorePartition(
        0, GENERATION, ["s1", "s2", "s3"], connector=connector, metadata_store=MemoryMetadataStore()
    )
    part = Partition(0, store, feed_cache=FeedCache(), transaction_cache=TransactionCache())
    await part.start()
    await part.wait_ready()
    peer = _Peer()
    peer.partition = part
    session = ReqId.of(CLIENT_ID, GENERATION, 0, -1)
    await part.mount(peer, cs.MountRequest(session, -1, 1))
    warmup = args.appends // 5
    payloads = _payloads(args.appends + warmup, args.locks)
    # As server.py decodes them (a tree from before decode_append_fields decodes the message).
    decode = getattr(cs, "decode_append_fields", cs.decode_append_request)
    locks = args.locks
    # As server.py tells it whether more requests of the read follow (a tree from before takes no such word).
    tells_more = "more" in inspect.signature(part.append_nowait).parameters
    profile = cProfile.Profile() if args.profile else None
    sent = 0
    started = 0.0
    total = len(payloads)
    while peer.fed < total:
        if sent == warmup and not started:
            while peer.fed < warmup:
                peer.wake.clear()
                await peer.wake.wait()
            started = time.process_time()
            if profile is not None:
                profile.enable()
        room = min(args.in_flight - (sent - peer.fed), total - sent, args.burst)
        if sent < warmup:
            room = min(room, warmup - sent)
        if room > 0:
            # One socket read's worth of appends, handled as server.py's connection loop does.
            last = sent + room - 1
            for i, payload in enumerate(payloads[sent : sent + room], sent):
                if locks:
                    # The client's high-water mark goes with a locked append (its locks are checked
                    # against it): what the feed has delivered so far.
                    _HWM.pack_into(payload, 17, peer.last_id)
                msg = decode(payload, VERSION)
                more = (i < last,) if tells_more else ()
                if not part.append_nowait(peer, msg, *more):
                    raise SystemExit("append not taken")
            sent += room
            # The next read comes on a later loop iteration.
            await asyncio.sleep(0)
            continue
        peer.wake.clear()
        await peer.wake.wait()
    elapsed = time.process_time() - started
    if profile is not None:
        profile.disable()
        profile.dump_stats(args.profile)
    await part.close()
    if peer.lock_failures:
        print(f"lock failures: {peer.lock_failures}")
    per_request = total / max(1, bodies.requests / 3)
    return elapsed * 1e6 / args.appends, per_request


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--appends", type=int, default=100_000)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--burst", type=int, default=4, help="appends per simulated socket read")
    parser.add_argument("--ack-ms", type=float, default=1.0, help="a replica's time to acknowledge")
    parser.add_argument("--locks", action="store_true", help="one write lock per append, its own key")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile", default=None, metavar="PATH")
    args = parser.parse_args()
    import uvloop

    from waltz.runtime import tune_gc

    tune_gc()  # as `waltz server run` does

    runs = [uvloop.run(_run(args)) for _ in range(args.repeat)]
    results = [r for r, _ in runs]
    print(
        f"{'locked' if args.locks else 'plain'}: server path cpu us/append "
        + " ".join(f"{r:.2f}" for r in results)
        + f"  (min {min(results):.2f}); appends per replica request "
        + " ".join(f"{n:.1f}" for _, n in runs)
    )


if __name__ == "__main__":
    main()
