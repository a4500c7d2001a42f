"""Fault scenarios, each named after the exact fault it injects (the seed picks times, victims and delays)."""

from __future__ import annotations

from tests.fault.sim import Scenario, World, WorldParams
from tests.fault.trim_scenarios import TRIM_SCENARIOS
from waltz.cluster.partition_metadata import UNRESOLVED

LAGGING_CLIENT = 60
"""Client id of the appends a scenario makes itself (the workload's appenders are 0..2, the final one 99)."""


def _f(replicas: int) -> int:
    """Replicas that may be down at once while a quorum stays up."""
    return (replicas - 1) // 2


async def _crash_and_restart_some(world: World, rounds: int, *, within_tolerance: bool = True) -> None:
    for _ in range(rounds):
        await world.sleep_ms(2, 40)
        replicas = world.replicas
        count = world.rng.randint(1, max(1, _f(len(replicas)) if within_tolerance else len(replicas)))
        victims = world.rng.sample(replicas, count)
        for name in victims:
            world.crash(name)
        world.check()
        await world.sleep_ms(5, 200)
        for name in victims:
            world.restart(name)
        world.check()


async def storage_crash_loses_unsynced_tail_during_append(world: World) -> None:
    """Replicas (up to a minority at once) crash mid-append, keeping a random prefix of their unsynced
    records."""
    await _crash_and_restart_some(world, rounds=4)


async def all_storages_crash_at_once(world: World) -> None:
    """Every replica crashes at the same moment (unsynced tails lost), then they come back one by one."""
    for _ in range(2):
        await world.sleep_ms(5, 40)
        for name in world.replicas:
            world.crash(name)
        world.check()
        for name in world.rng.sample(world.replicas, len(world.replicas)):
            await world.sleep_ms(1, 100)
            world.restart(name)
        world.check()


async def lost_messages_break_connections(world: World) -> None:
    """Messages are lost at random (the connection breaks; the request may or may not have been applied)."""
    await world.sleep_ms(100, 300)
    world.network.loss_probability = 0.0


async def storage_isolated_during_recovery_is_undecidable(world: World) -> None:
    """One replica is isolated, then another crashes while the new session recovers without the first."""
    a, b = world.rng.sample(world.replicas, 2)
    await world.sleep_ms(5, 30)
    world.isolate(a)
    await world.sleep_ms(1, 20)
    world.crash(b)
    world.check()
    await world.sleep_ms(10, 150)
    world.restart(b)
    await world.sleep_ms(0, 100)
    world.heal(a)
    world.check()
    await _crash_and_restart_some(world, rounds=1)


async def server_crash_restarts_partition_with_new_generation(world: World) -> None:
    """The owning server crashes mid-write (its in-flight messages still land); a new owner starts."""
    for _ in range(world.rng.randint(1, 3)):
        await world.sleep_ms(5, 60)
        await world.stop_server(world.newest, "crash")
        world.check()
        await world.sleep_ms(0, 30)
        await world.start_server()
        if world.rng.random() < 0.5:
            world.crash(world.rng.choice(world.replicas))
            await world.sleep_ms(5, 50)
            world.restart(world.replicas[0])
            for name in world.replicas:
                world.restart(name)


async def two_servers_race_old_owner_is_fenced(world: World) -> None:
    """A new owner starts while the old one keeps writing; clients still send to both; the old must be
    fenced."""
    await world.sleep_ms(5, 40)
    await world.start_server()
    world.check()
    await world.sleep_ms(0, 40)
    if world.rng.random() < 0.5:
        world.crash(world.rng.choice(world.replicas))
        await world.sleep_ms(5, 60)
        for name in world.replicas:
            world.restart(name)
    await world.sleep_ms(20, 150)
    await world.stop_server(world.servers[0], "the old owner finally notices and closes")


async def _change_replicas(world: World, new: list[str]) -> None:
    await world.sleep_ms(5, 50)
    world.set_replicas(new)
    world.check()
    if world.rng.random() < 0.5:
        # A fault while the new replicas catch up.
        await world.sleep_ms(0, 40)
        victim = world.rng.choice(sorted(set(new) | set(world.initial_replicas)))
        world.crash(victim)
        await world.sleep_ms(5, 80)
        world.restart(victim)
    await world.sleep_ms(10, 80)


async def replica_added_single(world: World) -> None:
    """Seed example 1: one replica is added (3 -> 4) while writes continue."""
    await _change_replicas(world, [*world.initial_replicas, world.spares[0]])


async def replicas_added_multiple(world: World) -> None:
    """Seed example 2: several replicas are added (3 -> 5) while writes continue."""
    await _change_replicas(world, [*world.initial_replicas, *world.spares[:2]])


async def replica_removed_single(world: World) -> None:
    """Seed example 3: one replica is removed (4 -> 3)."""
    keep = world.rng.sample(world.initial_replicas, len(world.initial_replicas) - 1)
    await _change_replicas(world, sorted(keep))


async def replicas_removed_multiple(world: World) -> None:
    """Seed example 4: several replicas are removed (5 -> 3)."""
    keep = world.rng.sample(world.initial_replicas, len(world.initial_replicas) - 2)
    await _change_replicas(world, sorted(keep))


async def replica_replaced_then_readded(world: World) -> None:
    """A replica is swapped for a spare, then added back with its stale (possibly dirty) log."""
    old = world.rng.choice(world.initial_replicas)
    swapped = [world.spares[0] if r == old else r for r in world.initial_replicas]
    await _change_replicas(world, swapped)
    await _change_replicas(world, [*swapped, old])


async def _recorded_clean_after(world: World, victim: str, taken_in: int) -> bool:
    """Force new sessions until ZooKeeper records ``victim`` clean in a session later than ``taken_in`` and
    every replica healthy (clean in the newest session, persisted so on its storage, and writing in the open
    session); False if that never happens.

    A restore is only detectable once ZooKeeper records the replica clean in a later session than the
    snapshot's, and recovery can only find the committed tail if the other replicas are healthy
    (docs/replication.md)."""
    for _ in range(200):
        metadata = world.metadata.peek(0)[0]
        state = metadata.replicas.get(victim)
        healthy = all(
            s.session_id == metadata.session_id and s.closing_high_water_mark == UNRESOLVED
            for s in metadata.replicas.values()
        )
        session = world.newest.partition.session
        if (
            state is not None
            and state.session_id > taken_in
            and healthy
            and len(metadata.replicas) == 3
            and session is not None
            and session.is_open
            and session.session_id == metadata.session_id
            and len(session.participants) == 3
            and all(
                world.storages[n].session_info(0).session_id == metadata.session_id for n in metadata.replicas
            )
        ):
            return True
        ending = session.session_id if session is not None else None
        world.newest.partition.request_new_session()
        # Wait for the next session to open: the one asked to end may still look healthy while it drains.
        for _ in range(100):
            await world.sleep_ms(5, 20)
            session = world.newest.partition.session
            if session is not None and session.is_open and session.session_id != ending:
                break
    return False


async def replica_restored_from_old_snapshot(world: World) -> None:
    """A replica's disk is replaced by an older snapshot (taken before its last recorded clean session)."""
    victim = world.rng.choice(world.initial_replicas)
    await world.sleep_ms(0, 30)
    snapshot = world.snapshot(victim)
    if not await _recorded_clean_after(world, victim, snapshot.partitions[0][1]):
        return
    world.crash(victim)
    world.restore(victim, snapshot)
    await world.sleep_ms(1, 50)
    world.restart(victim)
    world.check()
    await world.sleep_ms(5, 60)


async def replica_restored_from_old_copy_while_another_lags(world: World) -> None:
    """Storage C's disk is replaced by an old copy while B, a slow replica that crashed, missed the newest
    commits: only A holds them. B and C (with its stale max id) would be a quorum for a lower high-water mark,
    so counting C in the vote would truncate acknowledged transactions away; C must count as unknown, which
    leaves the vote undecidable until B catches up from A."""
    b, c = world.rng.sample(world.initial_replicas, 2)  # A is the third
    await world.sleep_ms(0, 30)
    snapshot = world.snapshot(c)
    if not await _recorded_clean_after(world, c, snapshot.partitions[0][1]):
        return
    # B's disk stalls: the session commits with A and C while B's appends queue behind a long fsync.
    world.slow_disk(b, (400.0, 600.0))
    for seq in range(world.rng.randint(3, 6)):
        await world.append_one(LAGGING_CLIENT, seq)
    world.check()
    # B crashes (its queued appends are lost) and C goes down at the same moment, so no later session can
    # record B as closed: the next recovery finds A and B voting and C restored from its copy.
    world.crash(b)
    world.crash(c)
    world.slow_disk(b, world.params.fsync_ms)
    world.restore(c, snapshot)
    await world.sleep_ms(1, 30)
    world.restart(b)
    world.restart(c)
    world.check()
    await world.sleep_ms(20, 200)


async def zookeeper_session_lost_partition_reopens_in_same_generation(world: World) -> None:
    """The owner loses ZooKeeper (metadata calls fail; a write in flight may or may not apply) long enough for
    its session to expire, maybe while a replica crashes; it closes the partition and gets it back in the
    **same generation** (issue 14 section 1), sometimes opening the new partition before the old one has
    finished closing. Nothing acknowledged may be lost and the partition must write again."""
    for _ in range(world.rng.randint(1, 3)):
        await world.sleep_ms(5, 60)
        world.lose_zookeeper()
        crashed = None
        if world.rng.random() < 0.5:
            # A session ending now cannot start another one until ZooKeeper is back.
            await world.sleep_ms(0, 20)
            crashed = world.rng.choice(world.replicas)
            world.crash(crashed)
        await world.sleep_ms(10, 120)
        old = world.newest
        # Kazoo reports LOST only once it reaches ZooKeeper again; the server may close before or after that.
        reconnect_first = world.rng.random() < 0.5
        if reconnect_first:
            world.restore_zookeeper()
        if world.rng.random() < 0.5:
            await world.stop_server(old, "ZooKeeper session lost")
            await world.start_server(generation=old.generation)
        else:
            await world.start_server(generation=old.generation)
            await world.sleep_ms(0, 40)
            await world.stop_server(old, "ZooKeeper session lost (closed after the new one opened)")
        world.check()
        if not reconnect_first:
            await world.sleep_ms(0, 40)
            world.restore_zookeeper()
        if crashed is not None:
            await world.sleep_ms(0, 60)
            world.restart(crashed)
        world.check()


async def checkpoint_interval_forces_new_sessions(world: World) -> None:
    """A tiny checkpoint interval starts a new session every few transactions, while replicas crash."""
    await _crash_and_restart_some(world, rounds=3)


async def scrub_finds_damaged_records_on_one_replica_during_crashes(world: World) -> None:
    """One replica at a time has durable records damaged (as a scrub finds them: nobody reads them), while
    replicas crash and restart; the owner's damage poll must repair every damaged copy from a good replica,
    and nothing acknowledged may be lost."""
    for _ in range(3):
        await world.sleep_ms(5, 60)
        name = world.rng.choice(world.replicas)
        held = len(world.storages[name].durable_records(0))
        for txn in sorted(world.rng.sample(range(held), min(held, world.rng.randint(1, 3)))):
            world.damage(name, txn)
        world.check()
        await _crash_and_restart_some(world, rounds=1)
    world.heal_everything()
    for _ in range(1000):  # virtual time: 5 s at most
        if not any(storage.partitions[0].damaged for storage in world.storages.values()):
            return
        await world.sleep_ms(5, 5)
    left = {n: sorted(s.partitions[0].damaged) for n, s in world.storages.items() if s.partitions[0].damaged}
    world.checker.fail(f"liveness: damaged copies not repaired: {left}")


async def mixed_faults(world: World) -> None:
    """Everything at once: crashes beyond tolerance, isolation, server restarts and replica-set changes."""
    for _ in range(6):
        await world.sleep_ms(2, 40)
        action = world.rng.randrange(6)
        if action == 0:
            await _crash_and_restart_some(world, rounds=1, within_tolerance=False)
        elif action == 1:
            name = world.rng.choice(world.replicas)
            world.isolate(name)
            await world.sleep_ms(5, 80)
            world.heal(name)
        elif action == 2:
            await world.stop_server(world.newest, "crash")
            await world.start_server()
        elif action == 3 and len(world.servers) == 1:
            await world.start_server()
        elif action == 4:
            pool = world.initial_replicas + world.spares
            size = world.rng.randint(3, len(pool))
            world.set_replicas(sorted(world.rng.sample(pool, size)))
        else:
            world.newest.partition.request_new_session()
        world.check()
    for server in world.servers[:-1]:
        await world.stop_server(server, "old owner closes")


SCENARIOS = [
    Scenario(
        "storage_crash_loses_unsynced_tail_during_append", storage_crash_loses_unsynced_tail_during_append
    ),
    Scenario("all_storages_crash_at_once", all_storages_crash_at_once),
    Scenario(
        "lost_messages_break_connections",
        lost_messages_break_connections,
        WorldParams(loss_probability=0.01),
    ),
    Scenario(
        "storage_isolated_during_recovery_is_undecidable",
        storage_isolated_during_recovery_is_undecidable,
        WorldParams(replicas=3),
    ),
    Scenario(
        "server_crash_restarts_partition_with_new_generation",
        server_crash_restarts_partition_with_new_generation,
    ),
    Scenario("two_servers_race_old_owner_is_fenced", two_servers_race_old_owner_is_fenced),
    Scenario("replica_added_single", replica_added_single, WorldParams(replicas=3, spare_storages=1)),
    Scenario("replicas_added_multiple", replicas_added_multiple, WorldParams(replicas=3, spare_storages=2)),
    Scenario("replica_removed_single", replica_removed_single, WorldParams(replicas=4)),
    Scenario("replicas_removed_multiple", replicas_removed_multiple, WorldParams(replicas=5)),
    Scenario("replica_replaced_then_readded", replica_replaced_then_readded, WorldParams(spare_storages=1)),
    Scenario("replica_restored_from_old_snapshot", replica_restored_from_old_snapshot),
    Scenario(
        "replica_restored_from_old_copy_while_another_lags",
        replica_restored_from_old_copy_while_another_lags,
        # The server's limit: the slow replica stays a participant (recorded clean) while it lags.
        WorldParams(max_pending_batches=64),
    ),
    Scenario(
        "zookeeper_session_lost_partition_reopens_in_same_generation",
        zookeeper_session_lost_partition_reopens_in_same_generation,
    ),
    Scenario(
        "checkpoint_interval_forces_new_sessions",
        checkpoint_interval_forces_new_sessions,
        WorldParams(checkpoint_interval=5),
    ),
    Scenario(
        "scrub_finds_damaged_records_on_one_replica_during_crashes",
        scrub_finds_damaged_records_on_one_replica_during_crashes,
        WorldParams(damage_poll_interval_ms=20),
    ),
    Scenario(
        "mixed_faults",
        mixed_faults,
        WorldParams(replicas=3, spare_storages=2, loss_probability=0.003, checkpoint_interval=30),
    ),
    *TRIM_SCENARIOS,
]
