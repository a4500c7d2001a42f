"""Record runs -> Arrow record batches, the form ``read()`` yields, with the columns the read asked for.

The source's schema is :data:`READ_SCHEMA_DDL` (``READ_SCHEMA_NO_DATA_DDL`` with ``includeData=false``). A
user may give Spark a schema of their own (``spark.read.format("waltz").schema("data BINARY")``): any subset
of those columns, in any order, with the same types; the tasks then build and ship only those columns
(:func:`read_columns`). PySpark 4.3 prunes no columns for Python sources by itself, so this is how a query
that needs only the payload avoids paying for the others.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.compute as pc

from waltz.errors import ConfigError, RemoteProtocolError
from waltz.protocol.record_run import STORED_HEADER_BYTES, RecordRun, run_bounds
from waltz.protocol.wire import I32_MAX

__all__ = [
    "ALL_COLUMNS",
    "READ_SCHEMA_DDL",
    "READ_SCHEMA_NO_DATA_DDL",
    "Column",
    "arrow_schema",
    "columns_arrow_schema",
    "read_columns",
    "to_arrow",
]

_TYPES = {
    "partition": pa.int32(),
    "transactionId": pa.int64(),
    "header": pa.int32(),
    "reqId": pa.binary(),
    "data": pa.binary(),
}
# Spark's simple type names of the columns, as a user-specified StructType spells them.
_SPARK_TYPES = {
    "partition": "int",
    "transactionId": "bigint",
    "header": "int",
    "reqId": "binary",
    "data": "binary",
}
_BY_LOWER = {name.lower(): name for name in _TYPES}

READ_SCHEMA_DDL = ", ".join(f"{name} {kind.upper()}" for name, kind in _SPARK_TYPES.items())
READ_SCHEMA_NO_DATA_DDL = ", ".join(
    f"{name} {kind.upper()}" for name, kind in _SPARK_TYPES.items() if name != "data"
)


class Column(NamedTuple):
    """One output column: which field of a record (``source``), and its name and nullability as the read's
    schema spells them (Spark checks a batch's Arrow schema against the read's, names included)."""

    source: str
    name: str
    nullable: bool = True


ALL_COLUMNS = tuple(Column(name, name) for name in _TYPES)
_NO_DATA_COLUMNS = ALL_COLUMNS[:4]

# Where the fields sit in a stored record (see waltz.protocol.record_run): the ReqId at bytes 8-23, the
# header at 24-27, the data from byte 36 to 4 bytes before the record's end (its record checksum).
_REQ_ID = (8, 24)
_HEADER = (24, 28)
_CHECKSUM_BYTES = 4


def columns_arrow_schema(columns: Sequence[Column]) -> Any:
    return pa.schema([pa.field(c.name, _TYPES[c.source], c.nullable) for c in columns])


_FULL = columns_arrow_schema(ALL_COLUMNS)
_NO_DATA = columns_arrow_schema(_NO_DATA_COLUMNS)


def arrow_schema(include_data: bool) -> Any:
    return _FULL if include_data else _NO_DATA


def read_columns(schema: Any, include_data: bool) -> tuple[Column, ...]:
    """The columns a read with Spark schema ``schema`` (a ``StructType``: the source's own, or one the user
    gave) produces, in its order. Raises ConfigError, naming every problem, for a field that is not one of
    the source's columns (matched case-insensitively, as Spark does), has another type, or appears twice,
    and for ``data`` with ``includeData=false``."""
    problems = []
    out: list[Column] = []
    seen: set[str] = set()
    for f in schema.fields:
        source = _BY_LOWER.get(f.name.lower())
        if source is None:
            problems.append(f"{f.name!r} is not a column of the waltz source ({', '.join(_TYPES)})")
            continue
        if source in seen:
            problems.append(f"column {source!r} appears twice")
            continue
        seen.add(source)
        given = f.dataType.simpleString()
        if given != _SPARK_TYPES[source]:
            problems.append(f"column {f.name!r} is {_SPARK_TYPES[source].upper()}, not {given.upper()}")
        if source == "data" and not include_data:
            problems.append("column 'data' with includeData=false (drop one or the other)")
        out.append(Column(source, f.name, bool(f.nullable)))
    if not out and not problems:
        problems.append("the schema names no column")
    if problems:
        raise ConfigError("waltz data source: bad schema: " + "; ".join(problems))
    return tuple(out)


def _fixed_width(records: Any, start: int, stop: int) -> Any:
    """Bytes ``start:stop`` of every record, back to back (a buffer of ``len(records) * (stop - start)``)."""
    field = pc.binary_slice(records, start, stop)
    size = len(records) * (stop - start)
    if size == 0:
        return b""
    # The first value's offset: 0 for a fresh array, but read rather than assumed (Arrow is little-endian).
    first = int.from_bytes(field.buffers()[1].slice(field.offset * 4, 4).to_pybytes(), "little")
    return field.buffers()[2].slice(first, size)


def _headers(records: Any, n: int) -> Any:
    headers = array.array("i")
    headers.frombytes(_fixed_width(records, *_HEADER))
    if sys.byteorder == "little":
        headers.byteswap()  # stored big-endian
    return pa.Array.from_buffers(pa.int32(), n, [None, pa.py_buffer(headers)])


def to_arrow(
    partition: int, run: RecordRun, include_data: bool = True, columns: Sequence[Column] | None = None
) -> Any:
    """One ``pyarrow.RecordBatch`` of the records of ``run`` of ``partition``, every checksum verified:
    ``columns`` (see :func:`read_columns`), by default the source's whole schema (without ``data`` unless
    ``include_data``).

    Python touches each record once, in :func:`~waltz.protocol.record_run.run_bounds`, which verifies the
    run whole (whatever columns are asked for) and finds where each record starts. The columns are then cut
    out of the run by Arrow's C++ kernels: the run itself becomes a binary array whose values are whole
    records (the bounds are its offsets), and ``binary_slice`` takes the request ids, headers and data out of
    every value at once; the ids and the partition, being consecutive and constant, are built without
    reading the run. Only the columns asked for are built.
    """
    if columns is None:
        columns = ALL_COLUMNS if include_data else _NO_DATA_COLUMNS
    n = run.count
    if len(run.run) > I32_MAX:  # pragma: no cover - a run is one frame, far below 2 GiB
        raise RemoteProtocolError(f"a run of {len(run.run)} bytes is too large for 32-bit Arrow offsets")
    bounds = run_bounds(run.run, run.first, n)
    # Offsets and ids through array.array (native 32- and 64-bit, as Arrow's buffers): half the cost of
    # pa.array on a list or a range (~50 ns per record less for the ids).
    records = pa.Array.from_buffers(
        pa.binary(), n, [None, pa.py_buffer(array.array("i", bounds)), pa.py_buffer(run.run)]
    )
    arrays = []
    for column in columns:
        match column.source:
            case "partition":
                arrays.append(pa.repeat(pa.scalar(partition, pa.int32()), n))
            case "transactionId":
                ids = array.array("q", range(run.first, run.first + n))
                arrays.append(pa.Array.from_buffers(pa.int64(), n, [None, pa.py_buffer(ids)]))
            case "header":
                arrays.append(_headers(records, n))
            case "reqId":
                arrays.append(pc.binary_slice(records, *_REQ_ID))
            case "data":
                arrays.append(pc.binary_slice(records, STORED_HEADER_BYTES, -_CHECKSUM_BYTES))
            case other:  # pragma: no cover - read_columns admits only the names above
                raise ValueError(f"unknown column {other!r}")
    return pa.RecordBatch.from_arrays(arrays, schema=columns_arrow_schema(columns))
