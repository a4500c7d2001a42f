"""The TCP replica adapter's append encoding: a batch's records are encoded once for all its replicas."""

from __future__ import annotations

from waltz.protocol import storage as st
from waltz.protocol.records import Record, ReqId, crc32
from waltz.server.adapters import _AppendBodies
from waltz.server.storage_client import EncodedAppend, _encode_storage


def _records(first: int, n: int) -> tuple[Record, ...]:
    return tuple(
        Record(first + i, ReqId.of(1, 1, 0, first + i), 0, b"x" * i, crc32(b"x" * i)) for i in range(n)
    )


def test_the_same_records_object_is_encoded_once_and_others_again() -> None:
    bodies = _AppendBodies()
    batch = _records(0, 3)
    body = bodies.body_of(batch)
    assert body == st.append_request_body(batch)
    assert bodies.body_of(batch) is body  # the next replica of the same batch: no second encoding
    # An equal but distinct records object (a replica catching up joins batches into a new tuple) and the
    # next batch are encoded for what they hold.
    joined = tuple(batch)
    assert bodies.body_of(list(joined)) == body
    later = _records(3, 2)
    assert bodies.body_of(later) == st.append_request_body(later)
    assert st.decode(st.encode_append_request(5, 6, 0, bodies.body_of(later))) == st.AppendRequest(
        5, 6, 0, later, False
    )


def test_an_encoded_append_goes_as_its_prefix_and_the_shared_body_unjoined() -> None:
    records = _records(7, 4)
    body = st.append_request_body(records)
    head, sent_body = _encode_storage(EncodedAppend(5, 6, 0, body))
    assert sent_body is body  # every replica's request carries the one body object, not a copy
    assert st.decode(head + sent_body) == st.AppendRequest(5, 6, 0, records, False)
    # Any other storage message is one payload, as before.
    request = st.MaxTransactionIdRequest(5, 7, 0, False)
    assert _encode_storage(request) == st.encode(request)
