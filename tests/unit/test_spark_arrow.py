"""Record runs -> Arrow batches (waltz.spark.arrow): every column equals the records, damage is caught."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from waltz.errors import DataChecksumError, RemoteProtocolError
from waltz.protocol.record_run import RecordRun, encode_run
from waltz.protocol.records import Record, ReqId
from waltz.spark.arrow import arrow_schema, to_arrow

pytestmark = pytest.mark.timeout(120)


def records(first: int, fields: list[tuple[int, int]]) -> list[Record]:
    return [
        Record.build(first + i, ReqId.of(9, i, 7, first + i), header, bytes((i + j) & 0xFF for j in range(n)))
        for i, (header, n) in enumerate(fields)
    ]


def expected_rows(partition: int, recs: list[Record], include_data: bool) -> list[dict[str, object]]:
    rows = []
    for r in recs:
        row: dict[str, object] = {
            "partition": partition,
            "transactionId": r.transaction_id,
            "header": r.header,
            "reqId": r.req_id.to_bytes(),
        }
        if include_data:
            row["data"] = r.data
        rows.append(row)
    return rows


headers = st.integers(min_value=-(2**31), max_value=2**31 - 1)
fields = st.lists(st.tuples(headers, st.integers(min_value=0, max_value=300)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(
    first=st.integers(min_value=0, max_value=2**62),
    fields=fields,
    partition=st.integers(min_value=0, max_value=2**31 - 1),
    include_data=st.booleans(),
)
def test_columns_are_the_records(
    first: int, fields: list[tuple[int, int]], partition: int, include_data: bool
) -> None:
    recs = records(first, fields)
    batch = to_arrow(partition, RecordRun(first, len(recs), encode_run(recs)), include_data)
    assert batch.schema == arrow_schema(include_data)
    assert batch.to_pylist() == expected_rows(partition, recs, include_data)


def test_extreme_headers_and_empty_data() -> None:
    recs = records(5, [(-(2**31), 0), (2**31 - 1, 3), (-1, 0)])
    batch = to_arrow(1, RecordRun(5, 3, encode_run(recs)))
    assert batch.column(2).to_pylist() == [-(2**31), 2**31 - 1, -1]
    assert batch.column(4).to_pylist() == [b"", bytes([1, 2, 3]), b""]


def test_empty_run() -> None:
    batch = to_arrow(0, RecordRun(9, 0, b""))
    assert batch.num_rows == 0
    assert batch.schema == arrow_schema(True)


@settings(max_examples=200, deadline=None)
@given(fields=st.lists(st.tuples(headers, st.integers(0, 64)), min_size=1, max_size=8), data=st.data())
def test_any_damage_is_caught(fields: list[tuple[int, int]], data: st.DataObject) -> None:
    recs = records(100, fields)
    run = bytearray(encode_run(recs))
    position = data.draw(st.integers(min_value=0, max_value=len(run) - 1))
    run[position] ^= data.draw(st.integers(min_value=1, max_value=255))
    with pytest.raises((RemoteProtocolError, DataChecksumError)):
        to_arrow(0, RecordRun(100, len(recs), bytes(run)), include_data=False)


def test_a_record_whose_data_fails_its_client_checksum_is_refused() -> None:
    (rec,) = records(20, [(0, 8)])
    forged = Record(20, rec.req_id, rec.header, rec.data, rec.checksum ^ 1)
    with pytest.raises(DataChecksumError, match="transaction 20: data does not match"):
        to_arrow(0, RecordRun(20, 1, encode_run([forged])))
