"""Deterministic simulation of the replication core: every scenario x many seeds (see sim.py for invariants).

Seeds per scenario: ``WALTZ_SIM_SEEDS`` (default 80, in blocks of 20 so failures point at a block).
Replay one seed: ``WALTZ_SIM_SCENARIO=<name> WALTZ_SIM_SEED=<n> .venv/bin/pytest tests/fault -q -k <name>``.
"""

from __future__ import annotations

import logging
import os

import pytest

from tests.fault.scenarios import SCENARIOS
from tests.fault.sim import Scenario, run_seed

BLOCK = 20
SEEDS_PER_SCENARIO = int(os.environ.get("WALTZ_SIM_SEEDS", "80"))
ONLY_SEED = os.environ.get("WALTZ_SIM_SEED")
ONLY_SCENARIO = os.environ.get("WALTZ_SIM_SCENARIO")


def _cases() -> list[tuple[Scenario, range]]:
    scenarios = [s for s in SCENARIOS if ONLY_SCENARIO in (None, s.name)]
    if ONLY_SEED is not None:
        seed = int(ONLY_SEED)
        return [(s, range(seed, seed + 1)) for s in scenarios]
    return [
        (s, range(start, min(start + BLOCK, SEEDS_PER_SCENARIO)))
        for s in scenarios
        for start in range(0, SEEDS_PER_SCENARIO, BLOCK)
    ]


@pytest.mark.fault
@pytest.mark.parametrize(
    ("scenario", "seeds"),
    _cases(),
    ids=[f"{s.name}-seeds{r.start}-{r.stop - 1}" for s, r in _cases()],
)
def test_scenario(scenario: Scenario, seeds: range, caplog: pytest.LogCaptureFixture) -> None:
    # The store logs every session change at INFO; only warnings and errors are worth keeping per seed.
    caplog.set_level(logging.ERROR)
    for seed in seeds:
        caplog.clear()
        run_seed(scenario, seed)


@pytest.mark.fault
@pytest.mark.parametrize("name", ["mixed_faults", "lagging_replica_catches_up_from_a_trimmed_source"])
def test_the_same_seed_replays_identically(name: str) -> None:
    scenario = next(s for s in SCENARIOS if s.name == name)
    first = run_seed(scenario, 7)
    second = run_seed(scenario, 7)
    assert first.events == second.events
    assert first.checker.acked == second.checker.acked
    assert first.trim_point == second.trim_point
