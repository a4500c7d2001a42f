"""Record runs -> Arrow record batches, the form ``read()`` yields."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from waltz.protocol.record_run import RecordRun

__all__ = ["READ_SCHEMA_DDL", "READ_SCHEMA_NO_DATA_DDL", "arrow_schema", "to_arrow"]

READ_SCHEMA_DDL = "partition INT, transactionId BIGINT, header INT, reqId BINARY, data BINARY"
READ_SCHEMA_NO_DATA_DDL = "partition INT, transactionId BIGINT, header INT, reqId BINARY"

_FULL = pa.schema(
    [
        ("partition", pa.int32()),
        ("transactionId", pa.int64()),
        ("header", pa.int32()),
        ("reqId", pa.binary()),
        ("data", pa.binary()),
    ]
)
_NO_DATA = pa.schema(list(_FULL)[:4])
_REQ_ID_BYTES = 16


def arrow_schema(include_data: bool) -> Any:
    return _FULL if include_data else _NO_DATA


def _binary(count: int, offsets: Any, data: bytes) -> Any:
    return pa.Array.from_buffers(pa.binary(), count, [None, offsets, pa.py_buffer(data)])


def to_arrow(partition: int, run: RecordRun, include_data: bool = True) -> Any:
    """One ``pyarrow.RecordBatch`` of the records of ``run`` of ``partition``, every checksum verified.

    The run is unpacked straight into columns (:meth:`RecordRun.columns`): the binary columns are built from
    one joined buffer and an offsets array each, not from a Python object per value, and the ids, being
    consecutive, from a range.
    """
    cols = run.columns(include_data=include_data)
    n = cols.num_records
    columns = [
        pa.array([partition] * n, pa.int32()),
        pa.array(range(run.first, run.first + n), pa.int64()),
        pa.array(cols.headers, pa.int32()),
        _binary(
            n,
            pa.array(range(0, _REQ_ID_BYTES * (n + 1), _REQ_ID_BYTES), pa.int32()).buffers()[1],
            cols.req_ids,
        ),
    ]
    if include_data:
        columns.append(_binary(n, pa.array(cols.data_offsets, pa.int32()).buffers()[1], cols.data))
    return pa.RecordBatch.from_arrays(columns, schema=arrow_schema(include_data))
