"""Fault scenarios with trims (``waltz cluster trim``) racing failovers, recoveries and lagging replicas.

Each trim is set as the command sets it (at most the owner's committed high-water mark + 1, written to
ZooKeeper, then learnt by each owner after a seeded watch delay): see ``World.trim`` and invariant 8 of
``sim.py``.
"""

from __future__ import annotations

from tests.fault.sim import PARTITION, Scenario, World, WorldParams

WAIT_STEP_MS = 5.0
MAX_WAIT_STEPS = 400
"""A scenario waits at most this many steps (2 virtual seconds) for the log to grow past a lagging replica."""


async def _wait_for_hwm(world: World, above: int) -> None:
    """Wait (bounded) until the newest owner committed beyond ``above``; the workload may end first."""
    for _ in range(MAX_WAIT_STEPS):
        if world.servers and world.newest.partition.high_water_mark > above:
            return
        await world.sleep_ms(WAIT_STEP_MS, WAIT_STEP_MS)


def _max_id(world: World, name: str) -> int:
    return world.storages[name].partitions[PARTITION].max_transaction_id


async def trim_raised_while_the_owner_fails_over(world: World) -> None:
    """A trim is set while the owner crashes and a new one (next generation) recovers the partition: the
    old owner may or may not have told the replicas, the new one learns it from ZooKeeper at start or from
    its watch during recovery."""
    for _ in range(world.rng.randint(2, 3)):
        await world.sleep_ms(5, 40)
        world.trim(at_head=world.rng.random() < 0.3)
        await world.sleep_ms(0, 4)  # within the watch delay: the owners may not know it yet
        await world.stop_server(world.newest, "crash")
        world.check()
        await world.sleep_ms(0, 20)
        await world.start_server()
        if world.rng.random() < 0.5:
            await world.sleep_ms(0, 5)  # during the new owner's recovery
            world.trim()
        world.check()


async def trim_raised_during_recovery_while_a_replica_is_down(world: World) -> None:
    """A replica crashes, a new owner recovers with the other two and a trim is set during that recovery; the
    crashed replica comes back behind the trim point and must restart there."""
    for _ in range(world.rng.randint(1, 2)):
        await world.sleep_ms(5, 40)
        victim = world.rng.choice(world.replicas)
        world.crash(victim)
        await _wait_for_hwm(world, _max_id(world, victim) + 3)
        await world.stop_server(world.newest, "crash")
        await world.start_server()
        await world.sleep_ms(0, 10)
        world.trim(at_head=world.rng.random() < 0.5)
        world.check()
        await world.sleep_ms(0, 60)
        world.restart(victim)
        world.check()


async def lagging_replica_catches_up_from_a_trimmed_source(world: World) -> None:
    """One replica is cut off while the log grows, then the log is trimmed above everything it holds: its
    catch-up source answers TrimmedError and it restarts at the trim point (sometimes while the owner fails
    over, or a new session opens, during that catch-up)."""
    laggard = world.rng.choice(world.replicas)
    await world.sleep_ms(0, 20)
    world.isolate(laggard)
    await _wait_for_hwm(world, _max_id(world, laggard) + 5)
    world.trim(at_head=world.rng.random() < 0.5)
    await world.sleep_ms(0, 20)
    world.heal(laggard)
    world.check()
    action = world.rng.randrange(3)
    await world.sleep_ms(0, 15)
    if action == 0:
        await world.stop_server(world.newest, "crash")
        await world.start_server()
    elif action == 1:
        world.newest.partition.request_new_session()
    else:
        # Cut off again once it restarted: it recovers again in the same session, whose recovered high-water
        # mark may be below its log's start.
        await _wait_for_restart(world, laggard)
        world.isolate(laggard)
        await world.sleep_ms(0, 30)
        world.heal(laggard)
    await world.sleep_ms(5, 40)
    world.trim()


async def _wait_for_restart(world: World, name: str) -> None:
    part = world.storages[name].partitions[PARTITION]
    for _ in range(MAX_WAIT_STEPS):
        if part.log_start > 0:
            return
        await world.sleep_ms(WAIT_STEP_MS / 5, WAIT_STEP_MS / 5)


async def replica_added_after_a_trim_starts_at_the_trim_point(world: World) -> None:
    """A new, empty replica is added after the log was trimmed: nothing below the trim point can be copied to
    it, so it starts there; a second trim races its catch-up."""
    await _wait_for_hwm(world, 8)
    world.trim(at_head=world.rng.random() < 0.5)
    await world.sleep_ms(0, 10)
    world.set_replicas([*world.initial_replicas, world.spares[0]])
    world.check()
    await world.sleep_ms(0, 30)
    world.trim()
    if world.rng.random() < 0.5:
        victim = world.rng.choice(world.initial_replicas)
        world.crash(victim)
        await world.sleep_ms(5, 60)
        world.restart(victim)


TRIM_SCENARIOS = [
    Scenario("trim_raised_while_the_owner_fails_over", trim_raised_while_the_owner_fails_over),
    Scenario(
        "trim_raised_during_recovery_while_a_replica_is_down",
        trim_raised_during_recovery_while_a_replica_is_down,
    ),
    Scenario(
        "lagging_replica_catches_up_from_a_trimmed_source",
        lagging_replica_catches_up_from_a_trimmed_source,
        WorldParams(appends_per_appender=20),
    ),
    Scenario(
        "replica_added_after_a_trim_starts_at_the_trim_point",
        replica_added_after_a_trim_starts_at_the_trim_point,
        WorldParams(spare_storages=1),
    ),
]
