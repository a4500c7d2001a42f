"""The bulk append check (records of one size, checked and converted without a Python loop per record) against
the per-record loop, on random requests with random damage: the same stored run, or the same error."""

from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as hs

from waltz.errors import WaltzError
from waltz.protocol import storage as st
from waltz.protocol.records import Record, ReqId
from waltz.protocol.storage import WireRecordList
from waltz.storage.segment import append_wire_run

PID = 3


def _records(first: int, sizes: list[int]) -> list[Record]:
    return [
        Record.build(
            first + k, ReqId.of(1, 2, PID, first + k), k % 5, bytes((k * 7 + i) & 0xFF for i in range(n))
        )
        for k, n in enumerate(sizes)
    ]


def _outcome(records: WireRecordList, first: int) -> tuple[str, object]:
    parts: list[bytes | memoryview] = [b"lead"]
    ends: list[int] = [4]
    try:
        append_wire_run(parts, ends, records, first)
    except WaltzError as e:
        return type(e).__name__, (str(e), b"".join(parts), ends)
    return "ok", (b"".join(parts), ends)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    count=hs.integers(0, 300),
    size=hs.sampled_from([0, 1, 7, 16, 100]),
    other=hs.lists(hs.tuples(hs.integers(0, 299), hs.integers(0, 20)), max_size=2),
    damage=hs.lists(hs.tuples(hs.integers(0, 1 << 20), hs.integers(1, 255)), max_size=3),
    first=hs.sampled_from([0, 5, 999, 1 << 40]),
    shift=hs.sampled_from([0, 0, 0, 1, -1]),
)
def test_bulk_check_is_the_per_record_loop(
    count: int,
    size: int,
    other: list[tuple[int, int]],
    damage: list[tuple[int, int]],
    first: int,
    shift: int,
) -> None:
    sizes = [size] * count
    for at, n in other:  # a record or two of another size, sometimes
        if at < count:
            sizes[at] = n
    raw = bytearray(st.encode(st.AppendRequest(1, 1, PID, _records(first, sizes), False)))
    lo = len(raw) - sum(36 + n for n in sizes)  # the record list's bytes: damage lands in them
    for where, xor in damage:
        if len(raw) > lo:
            raw[lo + where % (len(raw) - lo)] ^= xor
    try:
        msg = st.decode(bytes(raw))
    except WaltzError:
        return  # a torn length: the decoder refuses the request before any check
    assert isinstance(msg, st.AppendRequest)
    wire = msg.records
    assert isinstance(wire, WireRecordList)
    loop_only = WireRecordList(wire.buffer, list(wire.starts))
    assert loop_only.record_bytes == 0
    # The request's first id is what the node expects (or one off): the check must say the same either way.
    got = _outcome(wire, first + shift)
    event(f"{got[0]} bulk={bool(wire.record_bytes)}")
    assert got == _outcome(loop_only, first + shift)
    if wire.record_bytes:
        assert len({b - a for a, b in zip(wire.starts, wire.starts[1:], strict=False)}) == 1
