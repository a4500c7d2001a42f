"""A seeded, deterministic simulation of the replication core under faults (in the spirit of TigerBeetle's
VOPR).

One run = one scenario x one seed, on :class:`~waltz.testing.VirtualTimeLoop` (virtual time, no I/O):

* a *world*: in-memory storage nodes (:class:`MemoryStorage`), a lossy/delaying network, a metadata store;
* one or more *servers*: :class:`StorePartition` instances (the real store code) with a generation each;
* a *workload*: a few concurrent appenders sending uniquely identified transactions to the newest server, each
  with up to 1..4 in flight, to servers with batches of 1..4 appends and up to 1..8 batches in flight (the
  seed picks all three);
* a *fault script* (the scenario) that crashes, restarts, isolates, restores nodes, crashes or duplicates
  servers and changes the replica set, at seeded random times;
* a *checker* that runs after every step of the event loop (``VirtualTimeLoop``'s ``after_step`` hook: so
  after every fault action, acknowledgement and message delivery) and at the end.

Invariants checked (:class:`Checker`):

1. An acknowledged transaction is never lost or changed: once ``append`` returned id ``i`` for record ``r``,
   no replica ever holds anything but ``r`` at ``i`` at or below a committed point, and at the end every
   replica holds ``r`` at ``i``. No id is acknowledged twice; no request is acknowledged at two ids.
2. Replicas never disagree at or below committed points: a replica's records at or below its persisted
   low-water mark, and a participant's records at or below its open session's high-water mark, agree with each
   other and with every acknowledgement.
3. Ids stay dense: a storage node never had to refuse an out-of-order append, an open session's batches in
   flight (at most ``max_inflight_batches``) are dense and in order from its high-water mark + 1, and at the
   end the log is ``0..hwm`` with the same records on every replica of the final set.
4. An old session never writes after a newer one fenced it: on every node, the session ids of processed writes
   (append, truncate, set-low-water-mark) never decrease.
5. A definite failure (QuorumLostError) is true: that request is not in the final log.
6. A server's high-water mark never decreases; the store code never hit an internal error.
7. Liveness: once every fault is healed, a session including every replica of the final set opens and commits
   a final append within a bounded (virtual) time, and every replica of the final set holds the partition's
   trim point.
8. Trim points (scenarios that trim, as ``waltz cluster trim`` does: ZooKeeper's value, then the owners):
   nothing is trimmed that was not committed (a replica's trim point is never above the highest committed
   id + 1, so nothing acknowledged at or above it can be lost); a replica restarts its log only at its trim
   point, never above it, so the max id it reports for a vote is backed by records at and above its trim
   point, which invariants 1-3 compare like any other (below it every id is committed and no one reads).
   Recovery never needs what is below the trim point: a read there fails (TrimmedError), so a recovery that
   needed it could not finish and the liveness check (7) fails. Below a replica's trim point nothing is
   compared (a replica that restarted there holds nothing of it).

A failing run raises :class:`SimulationFailure` with the seed, the scenario, the violated invariant, the
recent events and the command that replays it.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from waltz.errors import QuorumLostError, WaltzError
from waltz.protocol.records import Record, ReqId, crc32
from waltz.server.store.store_partition import StorePartition
from waltz.server.store.support import StoreConfig
from waltz.testing import run_virtual
from waltz.testing.store import (
    MemoryConnector,
    MemoryMetadataStore,
    MemoryNetwork,
    MemoryStorage,
    StorageSnapshot,
)

PARTITION = 0
MAX_EVENTS = 60
FINAL_DEADLINE_S = 600.0
"""Virtual seconds the healed cluster gets to open a session with every replica and commit a final append."""


class SimulationFailure(AssertionError):
    """An invariant was violated (or the healed cluster made no progress)."""


@dataclass(frozen=True)
class WorldParams:
    """The knobs of one scenario (the seed picks the rest)."""

    replicas: int = 3
    spare_storages: int = 0
    appenders: int = 3
    appends_per_appender: int = 12
    min_delay_ms: float = 0.2
    max_delay_ms: float = 4.0
    fsync_ms: tuple[float, float] = (0.2, 2.0)
    loss_probability: float = 0.0
    checkpoint_interval: int = 250_000
    max_batch_size: int | None = None
    """Appends per batch; None: the seed picks 1..4 (a batch is sent while others are in flight only when
    full, so small batches mean deep pipelines)."""
    max_inflight_batches: int | None = None
    """Batches a store session keeps in flight; None: the seed picks 1..8."""
    appender_window: int | None = None
    max_pending_batches: int = StoreConfig.max_pending_batches
    """Committed batches a replica may owe before it counts as unable to keep up (the server uses 64)."""
    damage_poll_interval_ms: int = StoreConfig.damage_poll_interval_ms
    """How often an open session asks its replicas for damage their scrub found."""
    """Appends each appender keeps in flight; None: the seed picks 1..4."""


@dataclass(eq=False)
class Server:
    partition: StorePartition
    generation: int
    name: str
    last_hwm: int = -1


@dataclass
class Append:
    req_id: ReqId
    header: int
    data: bytes
    checksum: int


class Checker:
    """The invariants (see the module docstring); every violation raises SimulationFailure via ``fail``."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.acked: dict[int, Record] = {}
        self.acked_req: dict[ReqId, int] = {}
        self.failed: set[ReqId] = set()
        self.canonical: dict[int, Record] = {}
        self._mutations_checked: dict[str, int] = {}
        self._verified: dict[str, tuple[int, int]] = {}
        self.max_committed = -1
        """The highest high-water mark any server reached (every id at or below it is committed)."""
        """Per storage: (its partition's ``rewrites``, how many leading durable records were checked)."""

    def fail(self, message: str) -> None:
        raise SimulationFailure(message)

    def on_ack(self, server: Server, req: Append, txn: int) -> None:
        record = Record(txn, req.req_id, req.header, req.data, req.checksum)
        if txn in self.acked and self.acked[txn] != record:
            self.fail(f"id {txn} acknowledged twice: {self.acked[txn]!r} then {record!r} (by {server.name})")
        if req.req_id in self.acked_req and self.acked_req[req.req_id] != txn:
            self.fail(f"{req.req_id!r} acknowledged at {self.acked_req[req.req_id]} and {txn}")
        self.acked[txn] = record
        self.acked_req[req.req_id] = txn
        self._agree(txn, record, f"acknowledgement by {server.name}")

    def on_definite_failure(self, req: Append) -> None:
        if req.req_id in self.acked_req:
            self.fail(f"{req.req_id!r} acknowledged and then failed")
        self.failed.add(req.req_id)

    def _agree(self, txn: int, record: Record, where: str) -> None:
        known = self.canonical.setdefault(txn, record)
        if known != record:
            self.fail(f"disagreement at committed id {txn} ({where}): {known!r} vs {record!r}")

    def _agree_up_to(self, storage: MemoryStorage, bound: int, where: Callable[[], str]) -> None:
        """Check the storage's durable records at ids <= ``bound`` against the canonical ones. Incremental:
        a prefix already checked is skipped while the storage has only appended since (see ``rewrites``)."""
        part = storage.partitions[PARTITION]
        rewrites, verified = self._verified.get(storage.name, (-1, 0))
        if rewrites != part.rewrites:
            verified = 0
        end = min(bound + 1, part.synced)
        # Below the replica's trim point it holds nothing to compare (or fillers, if it restarted there).
        for i in range(max(verified, part.trim_point), end):
            if self.canonical.setdefault(i, part.records[i]) != part.records[i]:
                self._agree(i, part.records[i], where())
        self._verified[storage.name] = (part.rewrites, max(verified, end))

    def check_step(self) -> None:
        world = self.world
        for server in world.servers:
            self.max_committed = max(self.max_committed, server.partition.high_water_mark)
        for storage in world.storages.values():
            part = storage.partitions[PARTITION]
            self._check_trim(storage)
            lwm = part.low_water_mark
            self._agree_up_to(
                storage, lwm, lambda s=storage, m=lwm: f"{s.name} at or below its low-water mark {m}"
            )
            sessions = part.mutation_sessions
            start = self._mutations_checked.get(storage.name, 1)
            for k in range(max(start, 1), len(sessions)):
                if sessions[k] < sessions[k - 1]:
                    self.fail(
                        f"{storage.name} processed a write of session {sessions[k]} after {sessions[k - 1]}"
                    )
            self._mutations_checked[storage.name] = len(sessions)
            if storage.out_of_order_appends:
                self.fail(f"{storage.name} refused an out-of-order append: ids not dense")
        for server in world.servers:
            partition = server.partition
            if partition.internal_errors:
                self.fail(f"{server.name} internal error: {partition.internal_errors[0]!r}")
            if partition.high_water_mark < server.last_hwm:
                self.fail(
                    f"{server.name} high-water mark fell: {server.last_hwm} -> {partition.high_water_mark}"
                )
            server.last_hwm = partition.high_water_mark
            session = partition.session
            if session is None or not session.is_open:
                continue
            batches = session.batches_in_flight
            if len(batches) > session.config.max_inflight_batches:
                self.fail(f"{session!r} has {len(batches)} batches in flight")
            expected = session.high_water_mark + 1  # in flight: dense from the high-water mark, in order
            for batch in batches:
                if batch.first != expected:
                    self.fail(f"{session!r}: batch {batch.first} in flight, expected {expected}")
                expected = batch.last + 1
            if expected != session.next_id:
                self.fail(f"{session!r}: batches in flight end at {expected - 1}, next id {session.next_id}")
            for participant in session.participants:
                self._agree_up_to(
                    world.storages[participant.storage],
                    session.high_water_mark,
                    lambda p=participant, s=session: f"{p.storage}, participant of {s!r}",
                )

    def _check_trim(self, storage: MemoryStorage) -> None:
        part = storage.partitions[PARTITION]
        if part.trim_point > self.max_committed + 1:
            self.fail(
                f"{storage.name} trimmed below {part.trim_point}, above the highest committed id "
                f"{self.max_committed} + 1"
            )
        if part.log_start > part.trim_point:
            self.fail(
                f"{storage.name} restarted its log at {part.log_start}, above its trim point "
                f"{part.trim_point}: it would claim ids it never held"
            )

    def check_final(self, server: Server) -> None:
        world = self.world
        hwm = server.partition.high_water_mark
        logs = {name: world.storages[name].durable_records(PARTITION) for name in server.partition.replicas}
        trims = {name: world.storages[name].partitions[PARTITION].trim_point for name in logs}
        present: set[ReqId] = set()
        for name, log in logs.items():
            if len(log) - 1 != hwm:
                self.fail(f"final: {name} holds 0..{len(log) - 1}, the high-water mark is {hwm}")
            if trims[name] != world.trim_point:
                self.fail(f"final: {name} has trim point {trims[name]}, the partition's {world.trim_point}")
            for i, record in enumerate(log[trims[name] :], start=trims[name]):
                if record.transaction_id != i:
                    self.fail(f"final: {name} holds id {record.transaction_id} at position {i}")
                self._agree(i, record, f"final log of {name}")
                present.add(record.req_id)
            for txn, acked in self.acked.items():
                if txn >= trims[name] and log[txn] != acked:
                    self.fail(f"final: acknowledged {acked!r} lost on {name}, which holds {log[txn]!r}")
        if self.acked and max(self.acked) > hwm:
            self.fail(f"final: acknowledged id {max(self.acked)} above the high-water mark {hwm}")
        wrongly_failed = sorted(self.failed & present)
        if wrongly_failed:
            self.fail(f"final: {wrongly_failed[0]!r} was reported failed but is in the log")
        self.check_step()


class World:
    """Storages, network, metadata store, servers, workload and fault helpers of one run."""

    def __init__(self, scenario: str, seed: int, params: WorldParams) -> None:
        self.scenario = scenario
        self.seed = seed
        self.params = params
        master = random.Random(f"{scenario}:{seed}")
        self.rng = random.Random(master.getrandbits(64))
        self.workload_rng = random.Random(master.getrandbits(64))
        self.network = MemoryNetwork(
            random.Random(master.getrandbits(64)),
            min_delay_ms=params.min_delay_ms,
            max_delay_ms=params.max_delay_ms,
            loss_probability=params.loss_probability,
        )
        names = [f"storage-{i}:7000" for i in range(params.replicas + params.spare_storages)]
        self.storages = {
            name: MemoryStorage(
                name, 1, self.network, fsync_ms=params.fsync_ms, rng=random.Random(master.getrandbits(64))
            )
            for name in names
        }
        self.initial_replicas = names[: params.replicas]
        self.spares = names[params.replicas :]
        self.metadata = MemoryMetadataStore(
            delay=lambda: self.rng.uniform(0.5, 3.0), rng=random.Random(master.getrandbits(64))
        )
        self.connector = MemoryConnector(self.network)
        self.server_rng_seed = master.getrandbits(64)
        inflight = params.max_inflight_batches
        self.appender_window = params.appender_window or master.randint(1, 4)
        batch = params.max_batch_size or master.randint(1, 4)
        self.config = StoreConfig(
            max_batch_size=batch,
            max_queued_appends=2 * batch,
            checkpoint_interval=params.checkpoint_interval,
            catch_up_batch_size=5,
            max_inflight_batches=inflight if inflight is not None else master.randint(1, 8),
            join_max_lag=2 * batch,
            max_pending_batches=params.max_pending_batches,
            damage_poll_interval_ms=params.damage_poll_interval_ms,
        )
        self.servers: list[Server] = []
        self.retired_servers: list[Server] = []
        self.events: list[str] = []
        self.checker = Checker(self)
        self.next_generation = 1
        self.replicas = list(self.initial_replicas)
        self.violated = False
        self.trim_point = 0
        """The partition's trim point as ZooKeeper holds it (see ``trim``): owners learn it after a delay."""

    # -- helpers for scenarios -------------------------------------------------------------------------------

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def event(self, text: str) -> None:
        self.events.append(f"t={self.now():9.4f}s {text}")
        del self.events[:-MAX_EVENTS]

    async def sleep_ms(self, low: float, high: float) -> None:
        await asyncio.sleep(self.rng.uniform(low, high) / 1000)

    @property
    def newest(self) -> Server:
        return self.servers[-1]

    async def start_server(
        self, *, replicas: list[str] | None = None, generation: int | None = None
    ) -> Server:
        """Start a new owner, in the next generation unless ``generation`` is given (a server that lost its
        ZooKeeper session and was given its partition back in the same generation)."""
        if generation is None:
            generation = self.next_generation
            self.next_generation += 1
        partition = StorePartition(
            PARTITION,
            generation,
            replicas if replicas is not None else self.replicas,
            connector=self.connector,
            metadata_store=self.metadata,
            rng=random.Random(self.server_rng_seed + generation),
            config=self.config,
        )
        same = sum(s.generation == generation for s in [*self.servers, *self.retired_servers])
        server = Server(partition, generation, f"server-g{generation}" + (f"-{same + 1}" if same else ""))
        self.servers.append(server)
        partition.set_trim_point(self.trim_point)  # as a server does from its copy of ZooKeeper's trim points
        await partition.start()
        self.event(f"start {server.name} with {list(partition.replicas)}")
        return server

    async def stop_server(self, server: Server, why: str) -> None:
        self.event(f"stop {server.name}: {why}")
        if server in self.servers:
            self.servers.remove(server)
        self.retired_servers.append(server)
        await server.partition.close()

    def crash(self, name: str) -> None:
        storage = self.storages[name]
        if storage.up:
            unsynced = len(storage.partitions[PARTITION].records) - storage.partitions[PARTITION].synced
            self.event(f"crash {name} ({unsynced} unsynced records)")
            storage.crash()

    def restart(self, name: str) -> None:
        storage = self.storages[name]
        if not storage.up:
            self.event(f"restart {name}")
            storage.restart()

    def isolate(self, name: str) -> None:
        self.event(f"isolate {name}")
        self.network.isolate(name)

    def heal(self, name: str) -> None:
        if self.network.is_isolated(name):
            self.event(f"heal {name}")
            self.network.heal(name)

    def set_replicas(self, replicas: list[str]) -> None:
        self.replicas = list(replicas)
        self.event(f"set replicas {replicas}")
        for server in self.servers:
            server.partition.set_replicas(replicas)

    def snapshot(self, name: str) -> StorageSnapshot:
        self.event(f"snapshot {name} at {self.storages[name].session_info(PARTITION)}")
        return self.storages[name].snapshot()

    def restore(self, name: str, snapshot: StorageSnapshot) -> None:
        self.event(f"restore {name} from a snapshot")
        self.storages[name].restore(snapshot)

    def lose_zookeeper(self) -> None:
        self.event("ZooKeeper connection lost (metadata calls fail; a write in flight may or may not apply)")
        self.metadata.disconnect()

    def restore_zookeeper(self) -> None:
        if not self.metadata.connected:
            self.event("ZooKeeper connection back")
            self.metadata.reconnect()

    def damage(self, name: str, transaction_id: int) -> None:
        self.event(f"{name}'s stored copy of {transaction_id} is damaged (its scrub finds it)")
        self.storages[name].damage(PARTITION, transaction_id)

    def slow_disk(self, name: str, fsync_ms: tuple[float, float]) -> None:
        self.event(f"{name} fsyncs now take {fsync_ms[0]:g}..{fsync_ms[1]:g} ms")
        self.storages[name].fsync_ms = fsync_ms

    def trim(self, *, at_head: bool = False) -> int:
        """Raise the trim point as ``waltz cluster trim`` does: checked against the owner's committed
        high-water mark H (at most H + 1; ``at_head``: exactly that), written to ZooKeeper, then learnt by
        each live owner after its watch fires (a seeded delay, so it races whatever the scenario does).
        Returns the new trim point (the old one if there was nothing committed above it)."""
        hwm = max((s.partition.high_water_mark for s in self.servers), default=-1)
        if hwm + 1 <= self.trim_point:
            return self.trim_point
        low = hwm + 1 if at_head else self.trim_point + 1
        self.trim_point = self.rng.randint(low, hwm + 1)
        self.event(f"trim point set to {self.trim_point} in ZooKeeper (high-water mark {hwm})")
        loop = asyncio.get_running_loop()
        for server in self.servers:
            loop.call_later(self.rng.uniform(0, 5) / 1000, self._watch_fired, server, self.trim_point)
        return self.trim_point

    def _watch_fired(self, server: Server, trim_point: int) -> None:
        if server in self.servers:
            self.event(f"{server.name} learns trim point {trim_point}")
            server.partition.set_trim_point(trim_point)

    def check(self) -> None:
        self.checker.check_step()

    def heal_everything(self) -> None:
        self.network.loss_probability = 0.0
        self.restore_zookeeper()
        for storage in self.storages.values():
            storage.fsync_ms = self.params.fsync_ms
        for name in self.storages:
            self.heal(name)
            self.restart(name)

    # -- workload --------------------------------------------------------------------------------------------

    async def appender(self, index: int) -> None:
        # Up to appender_window appends of this client at once, so sessions have several batches in flight.
        slots = asyncio.Semaphore(self.appender_window)
        appends: list[asyncio.Future[None]] = []
        for seq in range(self.params.appends_per_appender):
            await slots.acquire()
            appends.append(asyncio.ensure_future(self._append_then_release(index, seq, slots)))
            await asyncio.sleep(self.workload_rng.uniform(0, 8) / 1000)
        await asyncio.gather(*appends)

    async def _append_then_release(self, client: int, seq: int, slots: asyncio.Semaphore) -> None:
        try:
            await self.append_one(client, seq)
        finally:
            slots.release()

    async def append_one(self, client: int, seq: int) -> None:
        # Send to the newest server, as a client would after the cluster manager moved the partition; a client
        # that last saw an older owner sometimes still sends there.
        while not self.servers:  # noqa: ASYNC110 - polling virtual time between an owner's crash and successor
            await asyncio.sleep(0.005)
        server = self.newest
        if len(self.servers) > 1 and self.workload_rng.random() < 0.3:
            server = self.servers[0]
        data = self.workload_rng.randbytes(self.workload_rng.randint(0, 24))
        req = Append(ReqId.of(client, server.generation, PARTITION, seq), client, data, crc32(data))
        try:
            txn = await server.partition.append(req)
        except QuorumLostError:
            self.checker.on_definite_failure(req)
            return
        except WaltzError:
            return  # outcome unknown to this client (closed, moved): it would learn it from the feed
        self.checker.on_ack(server, req, txn)

    def after_step(self) -> None:
        """The loop's hook: check every invariant after every step of any task (until the first violation,
        which ends the run; the loop's own clean-up steps must not raise it again)."""
        if self.violated:
            return
        try:
            self.check()
        except SimulationFailure:
            self.violated = True
            raise

    # -- the run ---------------------------------------------------------------------------------------------

    async def run(self, faults: Callable[[World], Awaitable[None]]) -> None:
        config, window = self.config, self.appender_window
        self.event(
            f"batches of up to {config.max_batch_size}, up to {config.max_inflight_batches} in flight; "
            f"{window} appends in flight per appender"
        )
        await self.start_server()
        try:
            workload = [asyncio.ensure_future(self.appender(i)) for i in range(self.params.appenders)]
            await faults(self)
            self.check()
            self.heal_everything()
            self.event("healed")
            self.check()
            async with asyncio.timeout(FINAL_DEADLINE_S):
                for task in workload:
                    await task
                await self.final_phase()
        except TimeoutError:
            self.checker.fail(
                "liveness: the healed cluster did not finish the workload and open a full session"
            )
        finally:
            for server in list(self.servers):
                await server.partition.close()
        self.checker.check_step()

    async def final_phase(self) -> None:
        for old in self.servers[:-1]:
            await self.stop_server(old, "the final phase keeps only the newest server")
        server = self.newest
        if list(server.partition.replicas) != self.replicas:
            server.partition.set_replicas(self.replicas)
        server.partition.request_new_session()
        while True:
            session = server.partition.session
            if session is not None and session.is_open and len(session.participants) == len(self.replicas):
                break
            await asyncio.sleep(0.01)
        self.event(f"final session {session.session_id} open with every replica")
        await self.append_one(99, 0)
        await server.partition.flush()
        # Let every participant finish writing the last batch before comparing logs.
        while True:
            session = server.partition.session
            if session is None or not session.is_open:
                self.checker.fail("liveness: the final session ended")
                return
            if all(p.max_id >= server.partition.high_water_mark for p in session.participants):
                break
            await asyncio.sleep(0.01)
        # A replica that was down or lagging learns the trim point when the final session opens.
        while any(  # noqa: ASYNC110 - polling virtual time, as above
            self.storages[name].partitions[PARTITION].trim_point < self.trim_point for name in self.replicas
        ):
            await asyncio.sleep(0.01)
        self.check()
        self.checker.check_final(server)


@dataclass(frozen=True)
class Scenario:
    """A named fault (the name says exactly which) with its world and script."""

    name: str
    faults: Callable[[World], Awaitable[None]]
    params: WorldParams = field(default_factory=WorldParams)


def replay_command(scenario: str, seed: int) -> str:
    return (
        f"WALTZ_SIM_SCENARIO={scenario} WALTZ_SIM_SEED={seed} .venv/bin/pytest tests/fault -q -k {scenario}"
    )


def run_seed(scenario: Scenario, seed: int) -> World:
    """Run one seed; on a violation raise SimulationFailure with the seed, events and the replay command."""
    world = World(scenario.name, seed, scenario.params)
    try:
        run_virtual(world.run(scenario.faults), after_step=world.after_step)
    except SimulationFailure as e:
        raise SimulationFailure(_report(world, str(e))) from e
    except Exception as e:
        raise SimulationFailure(_report(world, f"unexpected {e!r}")) from e
    return world


def _report(world: World, problem: str) -> str:
    events = "\n    ".join(world.events[-MAX_EVENTS:])
    return (
        f"scenario {world.scenario!r} seed {world.seed}: {problem}\n"
        f"  recent events:\n    {events}\n"
        f"  replay: {replay_command(world.scenario, world.seed)}"
    )


def seeds_from_env(default: range) -> list[int]:
    """WALTZ_SIM_SEED=n runs only seed n; WALTZ_SIM_SEEDS=k runs seeds 0..k-1 of every block."""
    single = os.environ.get("WALTZ_SIM_SEED")
    if single is not None:
        return [int(single)]
    return list(default)
