"""The partition -> server assignment policy: a pure function, no I/O.

``assign_partitions(current, live, num_partitions)`` returns, for every live server, the partitions it owns
and their generations. Guarantees (each is pinned by a unit or property test):

* **Complete and exclusive**: every partition ``0..N-1`` is owned by exactly one live server (when at least
  one server is live).
* **Balanced**: every server owns ``N // S`` or ``N // S + 1`` partitions (S = number of live servers).
* **Preferences first**: a server's preferred partitions go to it, as far as balance allows; when several
  servers prefer the same partition, the one with the smallest id wins.
* **Sticky**: after preferences, a server keeps as many of its current partitions as balance allows; only the
  rest is spread, each to the least-loaded server with room (ties: smallest id).
* **Generations**: a partition that stays on its server keeps its generation; one that moves or is placed
  for the first time gets ``previous generation + 1`` (a never-assigned partition counts as generation 0,
  so starts at 1). The previous generation is the highest one found in ``current``, including entries of
  servers that are gone, so generations never go backwards.
* **Deterministic**: the same inputs give the same output (the original shuffled per-server lists; nothing
  depends on list order here, so we do not).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

Assignment = dict[int, dict[int, int]]
"""server id -> {partition id: generation}"""


def assign_partitions(
    current: Mapping[int, Mapping[int, int]],
    live: Mapping[int, Iterable[int]],
    num_partitions: int,
) -> Assignment:
    """Compute the next assignment.

    ``current``: the published assignment (server id -> {partition: generation}), possibly naming dead
    servers. ``live``: live server id -> its preferred partitions (ids outside ``0..N-1`` are ignored).
    Returns an entry for every live server (possibly empty) and no entry for dead ones. With no live
    server, returns an empty assignment.
    """
    if num_partitions < 0:
        raise ValueError(f"negative number of partitions: {num_partitions}")
    servers = sorted(live)
    if not servers:
        return {}
    base, extra = divmod(num_partitions, len(servers))
    owner: dict[int, int] = {}
    counts = dict.fromkeys(servers, 0)
    plus_used = 0  # Servers holding base + 1 partitions; at most ``extra`` of them.

    def can_take(server: int) -> bool:
        return counts[server] < base or (counts[server] == base and plus_used < extra)

    def give(server: int, partition: int) -> None:
        nonlocal plus_used
        if counts[server] == base:
            plus_used += 1
        counts[server] += 1
        owner[partition] = server

    # 1. Preferred partitions, smallest server id first.
    for server in servers:
        for p in sorted(set(live[server])):
            if 0 <= p < num_partitions and p not in owner and can_take(server):
                give(server, p)

    # 2. Stickiness: live servers keep what they have, as far as balance allows.
    for server in servers:
        for p in sorted(current.get(server, {})):
            if 0 <= p < num_partitions and p not in owner and can_take(server):
                give(server, p)

    # 3. The rest, each to the least-loaded server with room.
    for p in range(num_partitions):
        if p in owner:
            continue
        candidates = [s for s in servers if can_take(s)]
        # Capacity is exactly N (see the counting above), so there is always a candidate.
        target = min(candidates, key=lambda s: (counts[s], s))
        give(target, p)

    previous_generation: dict[int, int] = {}
    previous_owner: dict[int, int] = {}
    for server, parts in current.items():
        for p, g in parts.items():
            if g >= previous_generation.get(p, g):
                previous_generation[p] = g
                previous_owner[p] = server

    result: Assignment = {s: {} for s in servers}
    for p, server in owner.items():
        old = previous_generation.get(p, 0)
        stays = p in current.get(server, {}) and previous_owner.get(p) == server
        result[server][p] = old if stays else old + 1
    return {s: dict(sorted(parts.items())) for s, parts in result.items()}


def moved_partitions(
    before: Mapping[int, Mapping[int, int]], after: Mapping[int, Mapping[int, int]]
) -> set[int]:
    """Partitions whose owner differs between two assignments (newly placed ones included)."""

    def owners(a: Mapping[int, Mapping[int, int]]) -> dict[int, int]:
        return {p: s for s, parts in a.items() for p in parts}

    old, new = owners(before), owners(after)
    return {p for p, s in new.items() if old.get(p) != s}
