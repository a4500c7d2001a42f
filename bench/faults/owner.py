"""Owner changes in the fault suite: a returning owner, and the rule that no client is left behind.

Two fault kinds make a server lose its ZooKeeper session while it goes on running, so that another server
takes its partitions over (at a higher generation) and the old owner comes back to find them gone:

* ``cut-server-zookeeper``: every link between one server and ZooKeeper is cut (its storage and client links
  stay up) for longer than the session timeout. Each server reaches ZooKeeper through its own
  :class:`~bench.faults.proxy.LinkProxy` (:func:`start_zookeeper_link`, named in its
  ``zookeeper.connectString``), so the cut isolates that server alone: it is SUSPENDED, its session expires
  on ZooKeeper's side, and once the link is back it learns LOST, registers again and reconciles.
* ``zombie-server``: one server is stopped (SIGSTOP) for longer than the session timeout, then continued: a
  zombie owner that resumes with the state of an owner, its client connections and store sessions open, and
  answers whatever is queued on its sockets before it hears from ZooKeeper.

Both last 1-4 s longer than the session (:func:`owner_fault_s`).

The rule (:func:`check_stranded`): through the quiet period after the last heal, every client that is
appending must get acknowledgements on every partition that acknowledges anyone's appends. A client stranded
on a partition (told ``CLIENT_AHEAD`` by an incarnation whose generation was over, then refused every submit
with ``ClientAheadError``) fails the run even though the partition, serving the others, is not stuck.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from bench.faults.proxy import LinkProxy

OWNER_KINDS = ("cut-server-zookeeper", "zombie-server")


def owner_fault_s(rng: random.Random, session_s: float) -> float:
    """How long an owner fault lasts: 1-4 s past the session timeout, so the session surely expires."""
    return rng.uniform(session_s + 1, session_s + 4)


async def start_zookeeper_link(server_name: str, zookeeper_port: int) -> LinkProxy:
    """A relay from a free loopback port to ZooKeeper, for one server's ``zookeeper.connectString``."""
    return await LinkProxy.start(f"zookeeper-{server_name}", 0, zookeeper_port)


def app_of(tag: str) -> int:
    """The app that sent a tagged transaction (``fault:<app>:<n>``, see ``bench.faults.app.tag_of``)."""
    return int(tag.split(":")[1])


def check_stranded(
    acks: Mapping[str, tuple[int, float]], since: float, apps: int, partitions: int
) -> list[str]:
    """Problems: an app that got no acknowledgement on a partition after ``since`` (the last heal, wall
    clock) while other apps did. ``acks`` is ``{tag: (partition, acknowledged at)}``. A partition that
    acknowledged nobody is not reported here (it is stuck, which the suite reports on its own)."""
    counts: dict[int, dict[int, int]] = {}
    for tag, (partition, t) in acks.items():
        if t > since:
            per_app = counts.setdefault(partition, {})
            app = app_of(tag)
            per_app[app] = per_app.get(app, 0) + 1
    problems = []
    for partition in range(partitions):
        by_app = counts.get(partition)
        if not by_app:
            continue
        others = ", ".join(f"app {a}: {n}" for a, n in sorted(by_app.items()))
        problems += [
            f"stranded: app {app} got no acknowledgement on partition {partition} after the last heal, while "
            f"others did ({others})"
            for app in range(apps)
            if app not in by_app
        ]
    return problems


def stranded_pairs(acks: Mapping[str, tuple[int, float]], since: float, apps: int, partitions: int) -> int:
    """How many (app, partition) pairs have no acknowledgement after ``since`` yet (0: the quiet period has
    shown every app making progress on every partition)."""
    seen = {(app_of(tag), partition) for tag, (partition, t) in acks.items() if t > since}
    return apps * partitions - len(seen)
