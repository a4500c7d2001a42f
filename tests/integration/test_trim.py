"""Trimming a partition on a real cluster (issue 26): ``waltz cluster trim`` refuses bad input with a clear
error and changes nothing; a trim is recorded in ZooKeeper, the owning server passes it to every replica,
which records it in its control file and deletes the segments below it; reads below it fail with
TrimmedError on the storage nodes and through the server, and appends go on."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from tests.integration.conftest import ClusterFactory
from tests.integration.raw_client import RawClient
from tests.integration.server_process import wait_until
from waltz.cli.main import main as waltz_main
from waltz.cluster.membership import ClusterWatcher
from waltz.cluster.retention import update_retention
from waltz.cluster.trim_points import read_trim_points
from waltz.errors import MetadataError, TrimmedError
from waltz.ops.servers import ADMIN_CLIENT_ID, query
from waltz.ops.trim import trim_partition
from waltz.protocol import client_server as cs
from waltz.protocol.records import ReqId
from waltz.storage.controlfile import CONTROL_FILE_NAME, read_control_file_with_trims
from waltz.storage.segment import parse_segment_name

pytestmark = [pytest.mark.integration]

RECORDS = 600


def first_segment(directory: object) -> int:
    names = os.listdir(os.path.join(str(directory), "0"))
    return min(p[0] for p in map(parse_segment_name, names) if p is not None)


@pytest.mark.timeout(180)
def test_trim_reaches_every_replica_and_reads_below_fail(
    cluster_factory: ClusterFactory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = cluster_factory(storage_config={"storage.segment.size.threshold": 4096})
    cli_yaml = tmp_path / "cli.yaml"
    cli_yaml.write_text(f"zookeeper.connectString: {cluster.zk_connect}\ncluster.root: {cluster.root}\n")

    async def cli(*argv: str) -> tuple[int, str, str]:
        code = await asyncio.to_thread(waltz_main, ["cluster", "trim", "-c", str(cli_yaml), *argv])
        out, err = capsys.readouterr()
        return code, out, err

    async def main() -> None:
        await cluster.start(storages=3, servers=1)
        # No grace: trims are in force at once (test_retention covers the grace).
        update_retention(cluster.zk, cluster.root, grace_ms=0)
        async with ClusterWatcher(cluster.zk, cluster.root) as watcher:
            writer = await RawClient(watcher, 1).start()
            try:
                futures = [await writer.append(b"record-%04d" % i + b"x" * 80) for i in range(RECORDS)]
                assert await asyncio.gather(*futures) == list(range(RECORDS))
                await check_bad_input()
                outcome = await asyncio.to_thread(
                    trim_partition, cluster.zk, cluster.root, 0, to=300, min_kept_transactions=100
                )
                assert (outcome.before, outcome.after) == (0, 300)
                code, out, _ = await cli("-p", "0", "--to", "200", "--min-kept", "100")
                assert (code, out) == (0, "partition 0: already trimmed to 300; nothing to do for 200\n")
                code, _, err = await cli("-p", "0", "--keep-last", "10")  # the default grace keeps 1000
                assert code == 1
                assert "would keep fewer than the 1000 most recent transactions" in err
                assert read_trim_points(cluster.zk, cluster.root).of(0) == 300

                for sp in cluster.storages:
                    path = os.path.join(sp.directory, CONTROL_FILE_NAME)
                    await wait_until(
                        lambda p=path: read_control_file_with_trims(p)[2][0] == 300,
                        30,
                        f"{sp.name} to record the trim point",
                    )
                    await wait_until(
                        lambda d=sp.directory: 0 < first_segment(d) <= 300,
                        30,
                        f"{sp.name} to delete the segments below 300",
                    )
                    async with await cluster.admin(sp) as admin:
                        with pytest.raises(TrimmedError, match="transaction 5 is below the trim point 300"):
                            await admin.read_records(0, 5, 10)
                        assert (await admin.read_records(0, 300, 1))[0].data.startswith(b"record-0300")
                # Through the server: a data read below the trim point fails naming it; one above works.
                await check_data_reads()
                # Appends go on; reads at and above the trim point work through the server.
                assert await writer.append_and_wait(b"after the trim") == RECORDS
                assert await writer.high_water_mark() == RECORDS
            finally:
                await writer.aclose()
        assert "trim point 300 sent to replicas" in cluster.servers[0].log_text()
        for sp in cluster.storages:
            assert "trim point raised from 0 to 300" in sp.log_text()
            assert "trimmed segment(s) below transaction" in sp.log_text()

    async def check_data_reads() -> None:
        server = cluster.servers[0]
        below, above = await query(
            f"127.0.0.1:{server.port}",
            [
                cs.TransactionDataRequest(ReqId.of(ADMIN_CLIENT_ID, 1, 0, 1), 5),
                cs.TransactionDataRequest(ReqId.of(ADMIN_CLIENT_ID, 1, 0, 2), 300),
            ],
        )
        assert isinstance(below, cs.TransactionDataResponse)
        assert below.data is None
        trimmed = TrimmedError.from_message(below.error or "")
        assert trimmed is not None
        assert (trimmed.partition_id, trimmed.transaction_id, trimmed.trim_point) == (0, 5, 300)
        assert isinstance(above, cs.TransactionDataResponse)
        assert (above.data or b"").startswith(b"record-0300")

    async def check_bad_input() -> None:
        def trim(**kw: object) -> object:
            return trim_partition(cluster.zk, cluster.root, kw.pop("partition", 0), **kw)  # type: ignore[arg-type]

        cases = [
            ({"to": 10_000}, "partition 0: trim point 10000 is above the high-water mark 599"),
            ({"to": 300}, "would keep fewer than the 1000 most recent transactions"),
            ({"partition": 7, "to": 1}, "partition 7 does not exist"),
            ({"keep_last": 0}, "partition 0: --keep-last 0 would trim everything"),
        ]
        for kwargs, message in cases:
            with pytest.raises(MetadataError, match=message):
                await asyncio.to_thread(trim, **kwargs)
        assert read_trim_points(cluster.zk, cluster.root).of(0) == 0

    asyncio.run(main())
