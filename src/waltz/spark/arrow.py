"""Record runs -> Arrow record batches, the form ``read()`` yields."""

from __future__ import annotations

import array
import sys
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from waltz.errors import RemoteProtocolError
from waltz.protocol.record_run import STORED_HEADER_BYTES, RecordRun, run_bounds
from waltz.protocol.wire import I32_MAX

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
# Where the fields sit in a stored record (see waltz.protocol.record_run): the ReqId at bytes 8-23, the
# header at 24-27, the data from byte 36 to 4 bytes before the record's end (its record checksum).
_REQ_ID = (8, 24)
_HEADER = (24, 28)
_CHECKSUM_BYTES = 4


def arrow_schema(include_data: bool) -> Any:
    return _FULL if include_data else _NO_DATA


def _fixed_width(records: Any, start: int, stop: int) -> Any:
    """Bytes ``start:stop`` of every record, back to back (a buffer of ``len(records) * (stop - start)``)."""
    field = pc.binary_slice(records, start, stop)
    size = len(records) * (stop - start)
    if size == 0:
        return b""
    # The first value's offset: 0 for a fresh array, but read rather than assumed (Arrow is little-endian).
    first = int.from_bytes(field.buffers()[1].slice(field.offset * 4, 4).to_pybytes(), "little")
    return field.buffers()[2].slice(first, size)


def to_arrow(partition: int, run: RecordRun, include_data: bool = True) -> Any:
    """One ``pyarrow.RecordBatch`` of the records of ``run`` of ``partition``, every checksum verified.

    Python touches each record once, in :func:`~waltz.protocol.record_run.run_bounds`, which verifies the
    run and finds where each record starts. The columns are then cut out of the run by Arrow's C++ kernels:
    the run itself becomes a binary array whose values are whole records (the bounds are its offsets), and
    ``binary_slice`` takes the request ids, headers and data out of every value at once; the ids and the
    partition, being consecutive and constant, are built without reading the run.
    """
    n = run.count
    if len(run.run) > I32_MAX:  # pragma: no cover - a run is one frame, far below 2 GiB
        raise RemoteProtocolError(f"a run of {len(run.run)} bytes is too large for 32-bit Arrow offsets")
    bounds = run_bounds(run.run, run.first, n)
    records = pa.Array.from_buffers(
        pa.binary(), n, [None, pa.array(bounds, pa.int32()).buffers()[1], pa.py_buffer(run.run)]
    )
    headers = array.array("i")
    headers.frombytes(_fixed_width(records, *_HEADER))
    if sys.byteorder == "little":
        headers.byteswap()  # stored big-endian
    columns = [
        pa.repeat(pa.scalar(partition, pa.int32()), n),
        pa.array(range(run.first, run.first + n), pa.int64()),
        pa.Array.from_buffers(pa.int32(), n, [None, pa.py_buffer(headers)]),
        pc.binary_slice(records, *_REQ_ID),
    ]
    if include_data:
        columns.append(pc.binary_slice(records, STORED_HEADER_BYTES, -_CHECKSUM_BYTES))
    return pa.RecordBatch.from_arrays(columns, schema=arrow_schema(include_data))
