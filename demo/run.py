"""``python -m demo.run``: start a real storage node, append and read back through StorageClient, verify.

A temporary stand-in for the full Waltz demo. It starts ``waltz storage run`` as a subprocess on free
loopback ports with a temporary directory, assigns a partition over the admin port, appends records in
batches (each acknowledged only after the node's fsync), reads them back, checks every checksum and the
payloads, prints a short summary and stops the node. Exit status 0 on success, 1 on any failure.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from waltz.protocol.records import Record, ReqId
from waltz.storage.client import AdminClient, StorageClient

CLUSTER_KEY = uuid.uuid4()
NUM_PARTITIONS = 2
PARTITION = 0
SESSION = 0
RECORDS = 1000
BATCH = 50
READY_TIMEOUT_S = 30.0


def start_node(base: Path) -> tuple[subprocess.Popen[bytes], int, int]:
    """Start the node and return it with its data and admin ports (from the JSON line it prints)."""
    config = base / "storage.yaml"
    config.write_text(
        "storage.port: 0\nstorage.admin.port: 0\n"
        f"storage.directory: {base / 'data'}\n"
        f"storage.cluster.key: {CLUSTER_KEY}\nstorage.cluster.numPartitions: {NUM_PARTITIONS}\n",
        encoding="utf-8",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "waltz.cli.main", "storage", "run", "--config", str(config)],
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the node prints it once serving, or exits
    if not line:
        proc.wait(READY_TIMEOUT_S)
        raise RuntimeError(f"storage node exited with status {proc.returncode} before serving")
    ready = json.loads(line)
    return proc, int(ready["port"]), int(ready["admin_port"])


def payload(i: int) -> bytes:
    return f"demo transaction {i}: transfer {i % 97} coins".encode()


async def round_trip(port: int, admin_port: int) -> dict[str, float]:
    async with await AdminClient.connect("127.0.0.1", admin_port, CLUSTER_KEY, NUM_PARTITIONS) as admin:
        await admin.set_assigned([PARTITION], True)
    async with await StorageClient.connect("127.0.0.1", port, CLUSTER_KEY, NUM_PARTITIONS) as client:
        start = time.perf_counter()
        appends = []
        for first in range(0, RECORDS, BATCH):
            batch = [
                Record.build(i, ReqId(1 << 32, i), i % 3, payload(i)) for i in range(first, first + BATCH)
            ]
            appends.append(client.append(SESSION, PARTITION, batch))
        await asyncio.gather(*appends)  # sent in order; each Success means fsynced
        append_s = time.perf_counter() - start
        max_id = await client.max_transaction_id(SESSION, PARTITION)
        if max_id != RECORDS - 1:
            raise RuntimeError(f"max transaction id is {max_id}, expected {RECORDS - 1}")
        start = time.perf_counter()
        got: list[Record] = []
        while len(got) < RECORDS:
            chunk = await client.read_records(SESSION, PARTITION, len(got), 250)
            if not chunk:
                raise RuntimeError(f"read stopped at {len(got)} of {RECORDS} records")
            got += chunk
        read_s = time.perf_counter() - start
        for i, rec in enumerate(got):
            if rec.transaction_id != i or not rec.verify() or rec.data != payload(i):
                raise RuntimeError(f"record {i} does not verify: {rec!r}")
    return {"append_s": append_s, "read_s": read_s}


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="waltz-demo-") as tmp:
        try:
            proc, port, admin_port = start_node(Path(tmp))
        except Exception as e:  # noqa: BLE001 - any failure to start is reported as one line
            print(f"demo: FAILED to start the storage node: {e}", file=sys.stderr)
            return 1
        try:
            stats = asyncio.run(round_trip(port, admin_port))
        except Exception as e:  # noqa: BLE001 - any failure of the round trip fails the demo
            print(f"demo: FAILED: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        print(f"storage node on 127.0.0.1:{port} (admin {admin_port}), directory {tmp}")
        print(
            f"appended {RECORDS} records in {RECORDS // BATCH} fsynced batches in "
            f"{stats['append_s'] * 1000:.0f} ms; read back and verified all {RECORDS} "
            f"in {stats['read_s'] * 1000:.0f} ms"
        )
        print(f"node stopped with status {proc.returncode}; demo OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
