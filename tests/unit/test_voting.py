"""Write-quorum voting and the recovery vote on the closing high-water mark (seed 000's figure cases)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from waltz.server.store.voting import Voting, quorum_of, resolve_high_water_mark

# The seed's figure: replica B is ahead of A, which is ahead of C (A votes {H_A, H_C}, B votes all three,
# C votes {H_C}).
H_C, H_A, H_B = 10, 20, 30


def test_quorum_is_a_majority() -> None:
    assert [quorum_of(n) for n in range(1, 8)] == [1, 2, 2, 3, 3, 4, 4]


class TestWriteVoting:
    def test_succeeds_as_soon_as_a_quorum_voted(self) -> None:
        voting = Voting(quorum=2, voters=3)
        voting.vote()
        assert voting.outcome is None
        voting.vote()
        assert voting.outcome is True
        voting.abstain()
        voting.abstain()
        assert voting.outcome is True

    def test_fails_as_soon_as_abstentions_exceed_the_slack(self) -> None:
        voting = Voting(quorum=2, voters=3)
        voting.abstain()
        assert voting.outcome is None
        voting.abstain()
        assert voting.outcome is False
        voting.vote()
        voting.vote()
        assert voting.outcome is False

    def test_fails_immediately_with_fewer_voters_than_the_quorum(self) -> None:
        assert Voting(quorum=3, voters=2).outcome is False

    def test_on_decided_is_called_once_with_the_outcome(self) -> None:
        decided: list[tuple[str, bool]] = []
        ok = Voting(quorum=2, voters=3, on_decided=lambda outcome: decided.append(("ok", outcome)))
        bad = Voting(quorum=2, voters=2, on_decided=lambda outcome: decided.append(("bad", outcome)))
        ok.vote()
        bad.abstain()
        assert decided == [("bad", False)]
        ok.vote()
        ok.vote()
        bad.abstain()
        assert decided == [("bad", False), ("ok", True)]

    def test_on_decided_is_called_from_the_constructor_without_a_quorum_of_voters(self) -> None:
        decided: list[bool] = []
        Voting(quorum=2, voters=1, on_decided=decided.append)
        assert decided == [False]

    def test_an_added_voter_widens_the_slack(self) -> None:
        voting = Voting(quorum=2, voters=2)
        voting.add_voter()
        voting.abstain()
        assert voting.outcome is None
        voting.vote()
        voting.vote()
        assert voting.outcome is True

    def test_rejects_a_non_positive_quorum(self) -> None:
        with pytest.raises(ValueError):
            Voting(quorum=0, voters=1)


class TestRecoveryVote:
    def test_all_online_resolves_to_h_a(self) -> None:
        assert resolve_high_water_mark([H_A, H_B, H_C], 3) == H_A

    def test_b_offline_is_undecidable(self) -> None:
        # H_A has one vote; one vote + one offline replica reaches the quorum of two: B might hold H_A.
        assert resolve_high_water_mark([H_A, H_C], 3) is None

    def test_b_back_online_is_decidable(self) -> None:
        assert resolve_high_water_mark([H_A, H_C, H_B], 3) == H_A

    def test_c_catching_up_with_a_makes_it_decidable(self) -> None:
        assert resolve_high_water_mark([H_A, H_A], 3) == H_A

    def test_a_laggard_catching_up_raises_the_decision(self) -> None:
        # All online, C behind: H_A. Once C catches up with B, H_B has a quorum.
        assert resolve_high_water_mark([H_A, H_B, H_C], 3) == H_A
        assert resolve_high_water_mark([H_A, H_B, H_B], 3) == H_B

    def test_the_top_candidate_undecidable_blocks_lower_ones(self) -> None:
        # Five replicas, quorum 3: {30, 20, 20} known, two offline. 30 has 1 vote (+2 offline = 3):
        # undecidable, although 20 already has a quorum of three supporters (30, 20, 20).
        assert resolve_high_water_mark([30, 20, 20], 5) is None
        # With one offline replica left, 30 can reach at most two votes: 20 is decided.
        assert resolve_high_water_mark([30, 20, 20, 10], 5) == 20

    def test_fewer_than_a_quorum_known_is_undecidable(self) -> None:
        assert resolve_high_water_mark([], 3) is None
        assert resolve_high_water_mark([5], 3) is None
        assert resolve_high_water_mark([5, 5], 5) is None

    def test_no_previous_replicas_means_an_empty_log(self) -> None:
        assert resolve_high_water_mark([], 0) == -1

    def test_single_replica(self) -> None:
        assert resolve_high_water_mark([7], 1) == 7
        assert resolve_high_water_mark([], 1) is None

    def test_empty_replicas_vote_minus_one(self) -> None:
        assert resolve_high_water_mark([-1, -1, -1], 3) == -1

    def test_more_known_than_replicas_is_an_error(self) -> None:
        with pytest.raises(ValueError):
            resolve_high_water_mark([1, 2], 1)


@given(
    st.lists(st.integers(-1, 50), min_size=1, max_size=7).flatmap(
        lambda hwms: st.tuples(st.just(hwms), st.lists(st.booleans(), min_size=len(hwms), max_size=len(hwms)))
    )
)
def test_a_decision_never_depends_on_the_unknown_replicas(case: tuple[list[int], list[bool]]) -> None:
    """Whatever the unknown replicas hold, a decision made without them is the one made with them."""
    hwms, online = case
    n = len(hwms)
    known = [h for h, up in zip(hwms, online, strict=True) if up]
    decided = resolve_high_water_mark(known, n)
    full = resolve_high_water_mark(hwms, n)
    assert full is not None
    if decided is not None:
        assert decided == full
    # The full decision is the highest mark a quorum holds.
    assert sum(1 for h in hwms if h >= full) >= quorum_of(n)
    assert all(sum(1 for h in hwms if h >= c) < quorum_of(n) for c in hwms if c > full)
