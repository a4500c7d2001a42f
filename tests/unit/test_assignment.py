"""The partition assignment policy (a pure function): balance, preferences, stickiness, generations."""

from __future__ import annotations

from collections.abc import Mapping

from hypothesis import given, settings
from hypothesis import strategies as st

from waltz.cluster.assignment import assign_partitions, moved_partitions


def _owners(a: Mapping[int, Mapping[int, int]]) -> dict[int, int]:
    return {p: s for s, parts in a.items() for p in parts}


def test_first_server_gets_everything_at_generation_one() -> None:
    a = assign_partitions({}, {1: []}, 4)
    assert a == {1: {0: 1, 1: 1, 2: 1, 3: 1}}


def test_no_live_server_gives_empty_assignment() -> None:
    assert assign_partitions({1: {0: 3}}, {}, 4) == {}


def test_second_server_joins_only_moved_partitions_bump() -> None:
    before = {1: {0: 1, 1: 1, 2: 1, 3: 1}}
    after = assign_partitions(before, {1: [], 2: []}, 4)
    assert after == {1: {0: 1, 1: 1}, 2: {2: 2, 3: 2}}
    assert moved_partitions(before, after) == {2, 3}


def test_server_leaves_its_partitions_move_with_bump() -> None:
    before = {1: {0: 1, 1: 1}, 2: {2: 2, 3: 2}, 3: {4: 5}}
    after = assign_partitions(before, {1: [], 3: []}, 5)
    assert sorted(len(p) for p in after.values()) == [2, 3]
    for p in (0, 1):
        assert after[1][p] == 1
    assert after[3][4] == 5
    moved = {p: g for parts in after.values() for p, g in parts.items() if p in (2, 3)}
    assert moved == {2: 3, 3: 3}


def test_preferred_partitions_win_and_smallest_id_breaks_ties() -> None:
    before = {1: {0: 1, 1: 1, 2: 1, 3: 1}}
    after = assign_partitions(before, {1: [3], 2: [0, 3]}, 4)
    assert 3 in after[1]
    assert 0 in after[2]
    assert after[2][0] == 2
    assert after[1][3] == 1


def test_preferences_out_of_range_ignored() -> None:
    assert assign_partitions({}, {1: [9, -1]}, 2) == {1: {0: 1, 1: 1}}


def test_dead_server_generation_is_not_forgotten() -> None:
    # Partition 0 was at generation 7 on a dead server: the new owner must get 8, never 1.
    after = assign_partitions({9: {0: 7}}, {1: []}, 1)
    assert after == {1: {0: 8}}


def test_restarted_server_with_same_id_keeps_partitions() -> None:
    before = {1: {0: 1, 1: 1}, 2: {2: 1, 3: 1}}
    assert assign_partitions(before, {1: [], 2: []}, 4) == before


assignments = st.dictionaries(
    st.integers(0, 6), st.dictionaries(st.integers(0, 11), st.integers(0, 50), max_size=12), max_size=6
)


@settings(max_examples=300, deadline=None)
@given(
    current=assignments,
    live=st.dictionaries(
        st.integers(0, 6), st.lists(st.integers(-1, 12), max_size=4), min_size=1, max_size=6
    ),
    n=st.integers(0, 12),
)
def test_properties(current: dict[int, dict[int, int]], live: dict[int, list[int]], n: int) -> None:
    after = assign_partitions(current, live, n)
    assert set(after) == set(live)
    owners = _owners(after)
    # Complete and exclusive.
    assert sorted(owners) == list(range(n))
    assert sum(len(p) for p in after.values()) == n
    # Balanced.
    base = n // len(live)
    assert all(base <= len(p) <= base + 1 for p in after.values())
    # Generations: kept exactly when the partition stays with its highest-generation owner, else bumped.
    prev_gen: dict[int, int] = {}
    prev_owner: dict[int, int] = {}
    for s, parts in current.items():
        for p, g in parts.items():
            if g >= prev_gen.get(p, g):
                prev_gen[p], prev_owner[p] = g, s
    for p, s in owners.items():
        stays = prev_owner.get(p) == s and p in current.get(s, {})
        assert after[s][p] == (prev_gen[p] if stays else prev_gen.get(p, 0) + 1)
    # Deterministic, and a second run on its own output (same membership) changes nothing.
    assert assign_partitions(current, live, n) == after
    assert assign_partitions(after, live, n) == after


@settings(max_examples=200, deadline=None)
@given(
    owner=st.dictionaries(st.integers(0, 11), st.integers(0, 6), max_size=12),
    live=st.dictionaries(st.integers(0, 6), st.just([]), min_size=1, max_size=6),
    n=st.integers(0, 12),
)
def test_sticky_when_balance_allows(owner: dict[int, int], live: dict[int, list[int]], n: int) -> None:
    # Without preferences, a live server keeps at least min(what it had, N // S) of its partitions.
    current: dict[int, dict[int, int]] = {}
    for p, s in owner.items():
        current.setdefault(s, {})[p] = 1
    after = assign_partitions(current, live, n)
    base = n // len(live)
    for s in live:
        mine = {p for p in current.get(s, {}) if p < n}
        assert len(mine & set(after[s])) >= min(len(mine), base)
