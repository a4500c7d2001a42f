"""The sink's task side without Spark (waltz.spark.writer): Arrow batches -> rows, and the submit window."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest

from waltz.client.mock import MockDriver
from waltz.errors import ClientError
from waltz.spark.options import parse_options
from waltz.spark.writer import MARKER_HEADER, _Session, _to_write_row, rows_of_batch

pytestmark = pytest.mark.timeout(60)

LOCKS = pa.list_(pa.string())
SCHEMA = pa.schema(
    [
        ("data", pa.binary()),
        ("partition", pa.int32()),
        ("header", pa.int32()),
        ("writeLocks", LOCKS),
        ("readLocks", LOCKS),
        ("appendLocks", LOCKS),
    ]
)
OPTIONS = {"waltz.zookeeper.connectString": "127.0.0.1:1", "waltz.cluster.root": "/unit"}


def test_a_batch_gives_the_rows_the_row_path_gives() -> None:
    rows: list[dict[str, Any]] = [
        {"data": b"a", "partition": 1, "header": -5, "writeLocks": ["acct:1"], "readLocks": None},
        {"data": b"", "partition": None, "header": None, "appendLocks": ["log:2", "log:3"]},
        {"data": b"xyz", "partition": 0, "header": 2**31 - 1, "writeLocks": [], "readLocks": ["r:0"]},
    ]
    batch = pa.RecordBatch.from_pylist(rows, schema=SCHEMA)
    assert rows_of_batch(batch, default_partition=2, num_partitions=3) == [_to_write_row(r, 2) for r in rows]


def test_absent_columns_take_the_defaults() -> None:
    batch = pa.RecordBatch.from_pydict({"data": [b"p", b"q"]}, schema=pa.schema([("data", pa.binary())]))
    assert rows_of_batch(batch, default_partition=4) == [(4, 0, b"p", (), (), ()), (4, 0, b"q", (), (), ())]
    assert rows_of_batch(batch.slice(0, 0), default_partition=4) == []


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"data": None}, "null data column"),
        ({"data": b"x", "partition": 3}, "partition 3, which does not exist"),
        ({"data": b"x", "partition": -1}, "partition -1, which does not exist"),
        ({"data": b"x", "header": MARKER_HEADER}, "reserved for the exactly-once markers"),
        ({"data": b"x", "writeLocks": ["no-id"]}, "is not 'name:id'"),
        ({"data": b"x", "appendLocks": ["a:b"]}, "is not 'name:id'"),
    ],
)
def test_a_bad_row_fails_its_whole_batch(row: dict[str, Any], message: str) -> None:
    batch = pa.RecordBatch.from_pylist([{"data": b"fine"}, row], schema=SCHEMA)
    with pytest.raises(ClientError, match=message):
        rows_of_batch(batch, default_partition=0, num_partitions=3)


def test_the_window_is_never_exceeded_and_every_row_lands() -> None:
    driver = MockDriver(num_partitions=2, seed=7)
    driver.set_max_delay(2)  # appends stay in flight for a while, so the window fills
    options = parse_options({**OPTIONS, "waltz.client.maxConcurrentTransactions": "16"})
    handed: list[tuple[int, int]] = []  # (contexts handed to the client, in flight before)
    with _Session(options, driver=driver) as session:
        submit_many = session.client.submit_many

        def recording(contexts: Any) -> None:
            contexts = list(contexts)
            handed.append((len(contexts), session.submitted - session.outcome.ended))
            submit_many(contexts)

        session.client.submit_many = recording  # type: ignore[method-assign]
        rows = [(i % 2, 0, b"%d" % i, (), (), ()) for i in range(300)]
        session.submit_many(rows)
        assert session.finish() == 300
    assert {n for n, _ in handed} == {4}  # a quarter of the window at a time
    assert max(n + in_flight for n, in_flight in handed) <= 16
    logs = [driver.cluster.records(p) for p in (0, 1)]
    assert sorted(r.data for log in logs for r in log) == sorted(b"%d" % i for i in range(300))
    assert [r.data for r in logs[0]] == [b"%d" % i for i in range(0, 300, 2)]  # in row order
