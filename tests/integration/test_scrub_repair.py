"""Damage that only the background scrub found is repaired by the partition's owner, with no read issued by
anyone (issue 15, item 5): a flipped byte in a committed record below the last index checkpoint of one
replica is reported by that node's scrub, the server's damage poll notices it and rewrites the record from a
good replica, while another client keeps committing.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import ClusterFactory
from tests.integration.raw_client import RawClient
from tests.integration.server_process import wait_until
from tests.integration.storage_process import StorageProcess
from tests.integration.test_security_probes import _flip_byte
from waltz.cluster.membership import ClusterWatcher
from waltz.errors import SessionFencedError
from waltz.protocol.records import Record, ReqId

pytestmark = [pytest.mark.integration]

RECORDS = 1_100
"""Past the index checkpoint at id 1000, so the damaged record 17 is below the last checkpoint (a restart
would not rescan it either: only the scrub can find it)."""


def _get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        return str(r.read().decode())


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and 'partition="0"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.timeout(120)
def test_damage_only_the_scrub_found_is_repaired_by_the_owner_without_any_read(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(
        storage_config={"storage.scrub.bytesPerSecond": 10_000_000, "storage.scrub.pauseMs": 100},
        server_config={"storage.damagePollInterval": 200},
    )

    async def main() -> None:
        await cluster.start(storages=3, servers=1)
        bad = cluster.storages[1]
        server = cluster.servers[0]
        async with ClusterWatcher(cluster.zk, cluster.root) as watcher:
            writer = await RawClient(watcher, 1).start()
            other = await RawClient(watcher, 2).start()
            try:
                futures = [await writer.append(b"record-%04d" % i) for i in range(RECORDS)]
                assert await asyncio.gather(*futures) == list(range(RECORDS))
                _flip_byte(bad, 0, b"record-0017")

                stop = asyncio.Event()

                async def keep_committing() -> int:
                    n = 0
                    while not stop.is_set():
                        await asyncio.wait_for(other.append_and_wait(b"other-%d" % n), 15)
                        n += 1
                    return n

                committer = asyncio.create_task(keep_committing())

                async def damaged() -> list[int]:
                    async with await cluster.admin(bad) as admin:
                        metrics = json.loads(await admin.metrics_json())
                    return list(metrics["partitions"]["0"]["damagedTransactions"])

                await wait_until(
                    lambda: "stored transaction 17 is damaged" in bad.log_text(), 30, "the scrub to find 17"
                )

                async def clean() -> bool:
                    return await damaged() == []

                await wait_until(clean, 30, "the owner to repair the record the scrub reported")
                stop.set()
                committed = await committer
                assert committed > 0
                assert writer.violations == []
                assert other.violations == []
            finally:
                await writer.aclose()
                await other.aclose()
        # The copy on disk verifies again and holds the committed data.
        async with await cluster.admin(bad) as admin:
            (rec,) = await admin.read_records(0, 17, 1)
        assert rec.data == b"record-0017"
        assert rec.verify()
        server_log = server.log_text()
        assert "repairing 1 damaged record(s) 17 reported by " + cluster.address(bad) in server_log
        assert "repaired 1 damaged record(s) 17 on " + cluster.address(bad) in server_log
        assert "repaired 1 damaged record(s) from another replica's copy (17..17)" in bad.log_text()
        # No read met the damage: the server never read around it (that path reports damaged replica reads).
        health: dict[str, Any] = json.loads(await asyncio.to_thread(_get, server.http_port, "/health"))
        assert health["damagedReplicaReads"] == {}
        # The repair shows on /health too: done, nothing running or failing.
        assert health["scrubRepairs"] == {
            "0": {"started": 1, "finished": 1, "failed": 0, "records": 1, "inProgress": {}, "failing": {}}
        }
        metrics = await asyncio.to_thread(_get, server.http_port, "/metrics")
        assert _metric(metrics, "waltz_server_scrub_repairs_started_total") == 1
        assert _metric(metrics, "waltz_server_scrub_repairs_finished_total") == 1
        assert _metric(metrics, "waltz_server_scrub_repaired_records_total") == 1
        assert _metric(metrics, "waltz_server_scrub_repairs_failed_total") == 0

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_storage_node_tells_the_current_session_which_records_its_scrub_found_damaged(
    tmp_path: Path,
) -> None:
    config = {"storage.scrub.bytesPerSecond": 10_000_000, "storage.scrub.pauseMs": 100}
    with StorageProcess(tmp_path, config=config).start() as sp:

        async def main() -> None:
            admin = await sp.admin_client()
            data = await sp.data_client()
            async with admin, data:
                await admin.set_assigned([0], True)
                batch = [Record.build(i, ReqId.of(1, 1, 0, i), 0, b"polled-%04d" % i) for i in range(200)]
                await data.append(0, 0, batch)
                assert await data.damaged_records(0, 0, 1000) == []
                _flip_byte(sp, 0, b"polled-0040")
                _flip_byte(sp, 0, b"polled-0150")

                async def reported() -> bool:
                    return await data.damaged_records(0, 0, 1000) == [40, 150]

                await wait_until(reported, 20, "the scrub to report 40 and 150 to the session")
                assert await data.damaged_records(0, 0, 1) == [40]  # at most what was asked
                # Only the current session learns them: a newer one fences the old.
                assert await data.max_transaction_id(1, 0) == 199
                with pytest.raises(SessionFencedError):
                    await data.damaged_records(0, 0, 1000)
                # Truncated records are no longer held, so no longer reported.
                assert await data.truncate(1, 0, 100) == 100
                assert await data.damaged_records(1, 0, 1000) == [40]
                await data.repair(1, 0, batch[40:41])
                assert await data.damaged_records(1, 0, 1000) == []

        asyncio.run(main())
