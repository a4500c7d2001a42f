"""Quorum arithmetic: the write vote of one batch, and the recovery vote on the closing high-water mark.

Write quorum (seed 002 "Quorum Writes"): a batch is committed once a majority of the partition's replicas have
fsynced it. :class:`Voting` counts those acknowledgements for one batch.

Recovery vote (seed 000 "Quorum Checking in the Recovery Process"): each replica of the previous session votes
for every high-water mark at or below its own. The resolved high-water mark is the highest one a quorum votes
for, but only if the replicas we cannot hear from could not change the answer. We walk the voted high-water
marks in descending order; at each one, if the votes do not reach the quorum but votes + unknown replicas do,
the answer is *undecidable* and we must wait (for a replica to come back, or for a laggard to catch up).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

__all__ = ["Voting", "quorum_of", "resolve_high_water_mark"]


def quorum_of(num_replicas: int) -> int:
    """The majority of ``num_replicas``: ``n // 2 + 1``."""
    return num_replicas // 2 + 1


class Voting:
    """The write vote of one batch among ``voters`` replicas, needing ``quorum`` acknowledgements.

    Succeeds as soon as ``votes >= quorum``; fails as soon as ``abstentions > voters - quorum`` (so it fails
    at once if ``voters < quorum``). ``on_decided`` is called once, with the outcome, when it is decided (from
    the constructor if it fails at once). Once decided, further votes and abstentions are counted but change
    nothing.
    """

    __slots__ = ("_on_decided", "abstentions", "outcome", "quorum", "voters", "votes")

    def __init__(self, quorum: int, voters: int, on_decided: Callable[[bool], None] | None = None) -> None:
        if quorum <= 0:
            raise ValueError(f"quorum must be positive, got {quorum}")
        self.quorum = quorum
        self.voters = voters
        self.votes = 0
        self.abstentions = 0
        self.outcome: bool | None = None
        """True once a quorum voted, False once a quorum became impossible, None while undecided (read
        only: a plain attribute, read for every batch)."""
        self._on_decided = on_decided
        if voters < quorum:  # _check with no votes and no abstentions (the one call per batch spared)
            self._check()

    def add_voter(self) -> None:
        """One more replica will vote (a replica joined the writes while this batch was in flight)."""
        self.voters += 1

    def vote(self) -> None:
        """One replica acknowledged (fsynced) the batch."""
        self.votes += 1
        # _check's first test, inlined (once per replica of every batch): a vote can only reach the quorum.
        # It cannot make a quorum impossible, and had abstentions done so, the vote would be decided already.
        if self.votes >= self.quorum and self.outcome is None:
            self.outcome = True
            if self._on_decided is not None:
                self._on_decided(True)

    def abstain(self) -> None:
        """One replica will not acknowledge the batch (it failed or fell behind)."""
        self.abstentions += 1
        self._check()

    def _check(self) -> None:
        if self.outcome is not None:
            return
        if self.votes >= self.quorum:
            self.outcome = True
        elif self.abstentions > self.voters - self.quorum:
            self.outcome = False
        else:
            return
        if self._on_decided is not None:
            self._on_decided(self.outcome)


def resolve_high_water_mark(known: Iterable[int], num_replicas: int) -> int | None:
    """The closing high-water mark of the previous session, or None while it is undecidable.

    ``known`` holds the high-water mark of each replica of the previous session we have heard from (one entry
    per replica, duplicates allowed); the other ``num_replicas - len(known)`` replicas are unknown (offline,
    not classified yet, or restored from a backup so that their old state is lost). A replica supports every
    candidate at or below its own high-water mark. With no previous replicas the log is empty: -1.

    Undecidability: while walking the candidates from the highest down, a candidate without a quorum of
    supporters that *could* reach one with the unknown replicas makes the answer unknowable, so we return None
    instead of settling for a lower candidate. (If fewer than a quorum are known the lowest candidate is
    always undecidable.)
    """
    hwms = sorted(known, reverse=True)
    if num_replicas <= 0:
        return -1
    if len(hwms) > num_replicas:
        raise ValueError(f"{len(hwms)} known high-water marks for {num_replicas} replicas")
    quorum = quorum_of(num_replicas)
    unknown = num_replicas - len(hwms)
    # hwms is sorted descending, so the supporters of hwms[i] are exactly hwms[0..j] where j is the last index
    # holding the same value; checking each distinct value once, highest first, is the seed's walk.
    i = 0
    while i < len(hwms):
        candidate = hwms[i]
        supporters = i + 1
        while supporters < len(hwms) and hwms[supporters] == candidate:
            supporters += 1
        if supporters >= quorum:
            return candidate
        if supporters + unknown >= quorum:
            return None
        i = supporters
    return None
