"""Several real clients share counters through optimistic write locks, and lock kinds behave as the
server's lock table says (REFERENCE §4.3): real ZooKeeper, storage node and server processes on loopback."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from kazoo.client import KazooClient

from tests.integration.client_cluster import (
    ClientTestCluster,
    CounterApp,
    Increment,
    Outcome,
    wait_until,
)
from waltz import PartitionLocalLock, TransactionBuilder, WaltzClient
from waltz.client.reader import LogReader

pytestmark = pytest.mark.integration

NUM_CLIENTS = 3
INCREMENTS_PER_CLIENT = 20
NUM_PARTITIONS = 2


@pytest.mark.timeout(240)
def test_clients_incrementing_shared_counters_lose_no_update_and_see_one_order(
    tmp_path: Path, zk: KazooClient, zk_connect_string: str
) -> None:
    async def main() -> None:
        async with ClientTestCluster(
            tmp_path, zk, zk_connect_string, num_partitions=NUM_PARTITIONS
        ) as cluster:
            apps = [CounterApp(NUM_PARTITIONS) for _ in range(NUM_CLIENTS)]
            clients = [await asyncio.to_thread(WaltzClient, app, cluster.client_config()) for app in apps]
            try:

                def work(client: WaltzClient, app: CounterApp) -> list[Increment]:
                    contexts = [Increment(app, i % NUM_PARTITIONS) for i in range(INCREMENTS_PER_CLIENT)]
                    for context in contexts:
                        client.submit(context)
                    client.flush_transactions(120)
                    return contexts

                runs = await asyncio.gather(
                    *(asyncio.to_thread(work, c, a) for c, a in zip(clients, apps, strict=True))
                )
                contexts = [c for run in runs for c in run]
                assert all(c.completed is True for c in contexts), [c.exception for c in contexts]
                per_partition = NUM_CLIENTS * INCREMENTS_PER_CLIENT // NUM_PARTITIONS
                await wait_until(
                    lambda: all(
                        len(a.applied[p]) == per_partition for a in apps for p in range(NUM_PARTITIONS)
                    ),
                    60,
                    "every client to apply every transaction",
                )
            finally:
                for client in clients:
                    await asyncio.to_thread(client.close)

            expected = [str(n).encode() for n in range(1, per_partition + 1)]
            for p in range(NUM_PARTITIONS):
                # No lost update: each increment read the value the previous one wrote.
                assert apps[0].data(p) == expected
                # One order: every client applied the same transactions with the same ids.
                for app in apps[1:]:
                    assert app.applied[p] == apps[0].applied[p]
            assert not [e for a in apps for e in a.errors]
            # Contention was real: some increments were computed from a stale counter and retried.
            assert sum(c.lock_failures for c in contexts) > 0
            # The log itself, read without mounting, holds the same transactions.
            async with LogReader(cluster.client_config()) as reader:
                for p in range(NUM_PARTITIONS):
                    assert await reader.high_water_mark(p) == per_partition - 1
                    records = [r async for r in reader.read(p, batch_size=7)]
                    assert [(r.transaction_id, r.data) for r in records] == apps[0].applied[p]

    asyncio.run(main())


class Gated(Outcome):
    """A context whose first ``execute`` waits at a gate, so another client can commit meanwhile."""

    def __init__(
        self,
        tag: str,
        *,
        write: tuple[str, ...] = (),
        read: tuple[str, ...] = (),
        append: tuple[str, ...] = (),
        gated: bool = True,
    ) -> None:
        super().__init__()
        self.tag = tag
        self.locks = (write, read, append)
        self.entered = threading.Event()
        self.gate = threading.Event()
        if not gated:
            self.gate.set()

    def partition_id(self, num_partitions: int) -> int:
        return 0

    def execute(self, builder: TransactionBuilder) -> bool:
        self.executions += 1
        if self.executions == 1:
            self.entered.set()
            if not self.gate.wait(30):
                raise TimeoutError("the test never opened the gate")
        write, read, append = self.locks
        builder.set_transaction_data(self.tag.encode())
        builder.set_write_locks([PartitionLocalLock(n, 1) for n in write])
        builder.set_read_locks([PartitionLocalLock(n, 1) for n in read])
        builder.set_append_locks([PartitionLocalLock(n, 1) for n in append])
        return True


# (victim's locks, intruder's locks, lock failures the victim must see)
LOCK_CASES: list[tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]], int]] = [
    ({"read": ("x",)}, {"write": ("x",)}, 1),  # a read lock fails after a conflicting write
    ({"read": ("x",)}, {"read": ("x",)}, 0),  # read locks take nothing
    ({"read": ("x",)}, {"append": ("x",)}, 1),  # an append lock invalidates read locks...
    ({"write": ("x",)}, {"append": ("x",)}, 1),  # ... and write locks
    ({"append": ("x",)}, {"write": ("x",)}, 0),  # but is never checked itself
    ({"write": ("x",)}, {"write": ("y",)}, 0),  # unrelated locks do not conflict
]


@pytest.mark.timeout(240)
def test_read_write_and_append_locks_conflict_as_the_lock_table_defines(
    tmp_path: Path, zk: KazooClient, zk_connect_string: str
) -> None:
    async def main() -> None:
        async with ClientTestCluster(tmp_path, zk, zk_connect_string) as cluster:
            victim_app, intruder_app = CounterApp(1), CounterApp(1)
            victim_client = await asyncio.to_thread(WaltzClient, victim_app, cluster.client_config())
            intruder_client = await asyncio.to_thread(WaltzClient, intruder_app, cluster.client_config())
            try:
                for n, (victim_locks, intruder_locks, failures) in enumerate(LOCK_CASES):
                    # Both clients have applied everything so far, so only the intruder can conflict. The
                    # application's counter moves inside apply_transaction, before the client hears that it
                    # returned: the next execute's high-water mark is the client's, so wait for that
                    # (wait_applied), or the intruder's append carries the previous id and fails its lock
                    # check against the victim's last commit.
                    synced = 2 * n - 1
                    for client in (victim_client, intruder_client):
                        await asyncio.to_thread(client.wait_applied, 0, synced, 30)
                        assert client.applied_high_water_mark(0) == synced
                    assert victim_app.hwm[0] == intruder_app.hwm[0] == synced
                    victim = Gated(f"victim-{n}", **victim_locks)
                    submitted = asyncio.ensure_future(asyncio.to_thread(victim_client.submit, victim))
                    assert await asyncio.to_thread(victim.entered.wait, 30)
                    intruder = Gated(f"intruder-{n}", gated=False, **intruder_locks)
                    await asyncio.to_thread(intruder_client.submit, intruder)
                    await asyncio.to_thread(intruder_client.flush_transactions, 30)
                    assert intruder.completed is True
                    assert intruder.lock_failures == 0
                    victim.gate.set()
                    await submitted
                    await asyncio.to_thread(victim_client.flush_transactions, 30)
                    case = f"case {n}: victim {victim_locks}, intruder {intruder_locks}"
                    assert victim.completed is True, (case, victim.exception)
                    assert victim.lock_failures == failures, case
                    assert victim.executions == failures + 1, case
            finally:
                await asyncio.to_thread(victim_client.close)
                await asyncio.to_thread(intruder_client.close)

    asyncio.run(main())
