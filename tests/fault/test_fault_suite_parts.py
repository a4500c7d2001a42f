"""The fault suite's own parts (bench/faults): the log checker, the stranded-client rule, the schedule and the
cuttable proxy."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools

import pytest
from bench.faults.owner import OWNER_KINDS, check_stranded, stranded_pairs
from bench.faults.proxy import LinkProxy
from bench.faults.suite import ALL_KINDS, KNOWN_KINDS, ZK_SESSION_TIMEOUT_MS, Options, check_log, schedule

from waltz.protocol.records import Record, ReqId

pytestmark = pytest.mark.fault


def _log(*tags: str) -> list[Record]:
    return [Record.build(i, ReqId.of(1, 1, 0, i), 0, tag.encode()) for i, tag in enumerate(tags)]


def test_a_clean_log_has_no_problems() -> None:
    assert check_log({0: _log("a", "b"), 1: _log("c")}, {"a": 0, "c": 1}) == []


def test_the_checker_finds_a_lost_acknowledgement_a_duplicate_a_gap_and_a_misplaced_tag() -> None:
    gap = _log("x", "y")
    gap[1] = gap[1]._replace(transaction_id=2)
    problems = check_log({0: _log("a", "a"), 1: gap, 2: _log("m")}, {"lost": 0, "x": 1, "m": 0}, ["m", "q"])
    assert problems == [
        "partition 1: id 2 where 1 belongs",
        "committed twice: a at [(0, 0), (0, 1)]",
        "acknowledged but not in the log: lost (partition 0)",
        "m sent to partition 0 but committed in 2",
        "unresolved: m neither committed nor failed for its client (committed at [(2, 0)])",
        "unresolved: q neither committed nor failed for its client (not in the log)",
    ]


def test_the_seed_decides_the_schedule_and_short_zookeeper_pauses_stay_below_the_session_timeout() -> None:
    opts = Options(fault_phase_s=120, long_zk_pauses=False)
    assert schedule(5, opts) == schedule(5, opts)
    assert schedule(5, opts) != schedule(6, opts)
    pauses = [f for s in range(40) for f in schedule(s, opts) if f.kind == "sigstop-zookeeper"]
    assert pauses
    assert all(f.duration_s < ZK_SESSION_TIMEOUT_MS / 1000 for f in pauses)
    long = dataclasses.replace(opts, long_zk_pauses=True)
    pauses = [f for s in range(40) for f in schedule(s, long) if f.kind == "sigstop-zookeeper"]
    assert any(f.duration_s > ZK_SESSION_TIMEOUT_MS / 1000 for f in pauses)
    ci = dataclasses.replace(long, each_kind_once=True)
    assert all(
        f.duration_s > ZK_SESSION_TIMEOUT_MS / 1000 for f in schedule(1, ci) if f.kind == "sigstop-zookeeper"
    )
    for seed in range(40):
        faults = schedule(seed, opts)
        for a, b in itertools.pairwise(faults):
            assert a.at_s + a.duration_s < b.at_s  # each fault is healed before the next
        assert all(len(set(f.targets)) == 2 for f in faults if f.kind == "two-storages-down")


def test_power_cuts_are_drawn_only_when_named_and_target_a_storage_node() -> None:
    assert not any(k.startswith("power-") for k in ALL_KINDS)
    assert {"power-storage", "power-cluster"} <= set(KNOWN_KINDS)
    opts = Options(fault_phase_s=120, kinds=("power-storage", "power-cluster"))
    faults = [f for s in range(20) for f in schedule(s, opts)]
    assert {f.kind for f in faults} == {"power-storage", "power-cluster"}
    assert {f.targets for f in faults if f.kind == "power-storage"} == {(0,), (1,), (2,)}


def test_the_proxy_relays_cuts_refuses_and_restores() -> None:
    async def main() -> None:
        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while data := await reader.read(1024):
                writer.write(data)
                await writer.drain()
            writer.close()

        server = await asyncio.start_server(echo, "127.0.0.1", 0)
        target = server.sockets[0].getsockname()[1]
        probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        listen = probe.sockets[0].getsockname()[1]
        probe.close()
        await probe.wait_closed()
        proxy = await LinkProxy.start("echo", listen, target)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", listen)
            writer.write(b"ping")
            assert await reader.readexactly(4) == b"ping"
            proxy.cut()
            assert await reader.read(10) == b""  # the relayed connection dies at once
            writer.close()
            reader, writer = await asyncio.open_connection("127.0.0.1", listen)
            assert await reader.read(10) == b""  # refused while cut
            writer.close()
            proxy.restore()
            reader, writer = await asyncio.open_connection("127.0.0.1", listen)
            writer.write(b"pong")
            assert await reader.readexactly(4) == b"pong"
            writer.close()
            assert (proxy.cuts, proxy.relayed) == (1, 2)
        finally:
            await proxy.aclose()
            server.close()
            await server.wait_closed()

    asyncio.run(asyncio.wait_for(main(), 10))


def _acks(*history: tuple[int, int, float]) -> dict[str, tuple[int, float]]:
    """``{tag: (partition, time)}`` from ``(app, partition, time)`` acknowledgements, tagged as apps do."""
    return {f"fault:{app}:{n}": (partition, t) for n, (app, partition, t) in enumerate(history)}


def test_the_stranded_rule_fails_a_client_left_without_acknowledgements_on_a_partition_others_use() -> None:
    # Healed at t=100. App 1 had partition 2 acknowledged before the heal only (then CLIENT_AHEAD, say, and
    # every submit refused), while apps 0 and 2 went on there: the partition is not stuck, the client is.
    healed = 100.0
    before = [(app, p, 90.0) for app in range(3) for p in range(3)]
    after = [(app, p, 101.0 + app) for app in range(3) for p in range(3) if (app, p) != (1, 2)]
    acks = _acks(*before, *after, (0, 2, 110.0))
    assert check_stranded(acks, healed, apps=3, partitions=3) == [
        "stranded: app 1 got no acknowledgement on partition 2 after the last heal, while others did "
        "(app 0: 2, app 2: 1)"
    ]
    assert stranded_pairs(acks, healed, apps=3, partitions=3) == 1
    # Once app 1 is acknowledged there too, nothing is wrong.
    acks = _acks(*before, *after, (1, 2, 130.0))
    assert check_stranded(acks, healed, apps=3, partitions=3) == []
    assert stranded_pairs(acks, healed, apps=3, partitions=3) == 0


def test_the_stranded_rule_leaves_a_partition_nobody_is_acknowledged_on_to_the_stuck_rule() -> None:
    acks = _acks((0, 0, 101.0), (1, 0, 101.0), (0, 1, 99.0), (1, 1, 99.0))
    assert check_stranded(acks, 100.0, apps=2, partitions=2) == []
    assert stranded_pairs(acks, 100.0, apps=2, partitions=2) == 2


def test_owner_faults_outlast_the_session_and_hit_a_server() -> None:
    session_s = ZK_SESSION_TIMEOUT_MS / 1000
    opts = Options(fault_phase_s=120, kinds=OWNER_KINDS)
    faults = [f for s in range(20) for f in schedule(s, opts)]
    assert {f.kind for f in faults} == set(OWNER_KINDS)
    assert all(session_s + 1 <= f.duration_s <= session_s + 4 for f in faults)
    assert {f.targets for f in faults} == {(0,), (1,)}
    ci = Options(each_kind_once=True)
    assert set(OWNER_KINDS) <= {f.kind for f in schedule(1, ci)}
