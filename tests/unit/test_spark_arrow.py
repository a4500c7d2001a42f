"""Record runs -> Arrow batches (waltz.spark.arrow): every column equals the records, damage is caught."""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from waltz.errors import ConfigError, DataChecksumError, RemoteProtocolError
from waltz.protocol.record_run import RecordRun, encode_run
from waltz.protocol.records import Record, ReqId
from waltz.spark.arrow import (
    ALL_COLUMNS,
    READ_SCHEMA_DDL,
    READ_SCHEMA_NO_DATA_DDL,
    Column,
    arrow_schema,
    read_columns,
    to_arrow,
)

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


# -- a user-specified schema: any subset of the columns, in any order (column pruning the user asks for)


def test_a_user_schema_builds_only_its_columns_in_its_order() -> None:
    from pyspark.sql.types import BinaryType, LongType, StructField, StructType

    recs = records(40, [(3, 5), (-4, 0), (9, 17)])
    schema = StructType(
        [StructField("DATA", BinaryType(), False), StructField("transactionid", LongType(), True)]
    )
    columns = read_columns(schema, include_data=True)
    assert columns == (Column("data", "DATA", False), Column("transactionId", "transactionid", True))
    batch = to_arrow(2, RecordRun(40, 3, encode_run(recs)), columns=columns)
    # Named and typed as the user's schema says: PySpark compares the batch's Arrow schema with it.
    assert batch.schema == pa.schema(
        [pa.field("DATA", pa.binary(), False), pa.field("transactionid", pa.int64(), True)]
    )
    assert batch.to_pylist() == [{"DATA": r.data, "transactionid": r.transaction_id} for r in recs]


def test_a_user_schema_still_verifies_the_whole_run() -> None:
    from pyspark.sql.types import IntegerType, StructField, StructType

    recs = records(20, [(0, 8), (0, 8)])
    run = bytearray(encode_run(recs))
    run[36 + 3] ^= 1  # a data byte of record 20, a column the schema leaves out
    columns = read_columns(StructType([StructField("partition", IntegerType())]), include_data=True)
    with pytest.raises(DataChecksumError, match="transaction 20"):
        to_arrow(0, RecordRun(20, 2, bytes(run)), columns=columns)


def test_a_bad_user_schema_names_every_problem() -> None:
    from pyspark.sql.types import BinaryType, IntegerType, StringType, StructField, StructType

    schema = StructType(
        [
            StructField("data", StringType()),
            StructField("offset", IntegerType()),
            StructField("header", IntegerType()),
            StructField("HEADER", IntegerType()),
        ]
    )
    with pytest.raises(ConfigError) as e:
        read_columns(schema, include_data=True)
    assert "column 'data' is BINARY, not STRING" in str(e.value)
    assert "'offset' is not a column of the waltz source" in str(e.value)
    assert "column 'header' appears twice" in str(e.value)
    with pytest.raises(ConfigError, match="includeData=false"):
        read_columns(StructType([StructField("data", BinaryType())]), include_data=False)
    with pytest.raises(ConfigError, match="names no column"):
        read_columns(StructType([]), include_data=True)


def test_the_source_schema_reads_every_column() -> None:
    from pyspark.sql.types import BinaryType, IntegerType, LongType, StructField, StructType

    assert READ_SCHEMA_DDL == "partition INT, transactionId BIGINT, header INT, reqId BINARY, data BINARY"
    assert READ_SCHEMA_NO_DATA_DDL == "partition INT, transactionId BIGINT, header INT, reqId BINARY"
    fields = [
        StructField("partition", IntegerType()),
        StructField("transactionId", LongType()),
        StructField("header", IntegerType()),
        StructField("reqId", BinaryType()),
    ]
    assert read_columns(StructType(fields), False) == ALL_COLUMNS[:4]
    assert read_columns(StructType([*fields, StructField("data", BinaryType())]), True) == ALL_COLUMNS
