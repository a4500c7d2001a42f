"""Record runs (waltz.protocol.record_run): layout, round trips, and that damage is always caught."""

from __future__ import annotations

import itertools
import struct
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from waltz.errors import DataChecksumError, LocalProtocolError, RemoteProtocolError
from waltz.protocol import record_run
from waltz.protocol.record_run import (
    RecordRun,
    _id_lane,
    _run_bounds_loop,
    encode_run,
    run_bounds,
    run_columns,
    run_first_id,
    run_records,
    scan_run,
    stored_size,
    uniform_run_verifies,
)
from waltz.protocol.records import Record, ReqId, crc32
from waltz.storage.segment import encode_record

pytestmark = pytest.mark.timeout(120)

REC = Record(5, ReqId.of(1, 2, 3, 4), 7, b"ab", crc32(b"ab"))
# id · ReqId · header · length · data checksum · data · CRC-32 of the 38 bytes before it.
REC_HEX = "0000000000000005 0000000100000002 0000000300000004 00000007 00000002 9e83486d 6162 a9ca30ac"


def records(first: int, sizes: list[int]) -> list[Record]:
    return [
        Record.build(first + i, ReqId.of(9, 1, 0, first + i), i - 3, bytes((i + j) & 0xFF for j in range(n)))
        for i, n in enumerate(sizes)
    ]


def test_golden_bytes() -> None:
    run = encode_run([REC])
    assert run == bytes.fromhex(REC_HEX)
    assert stored_size(REC) == len(run) == 42
    assert run_first_id(run) == 5
    assert run_records(run, 5, 1) == [REC]


def test_a_run_is_the_segment_layout() -> None:
    recs = records(10, [0, 1, 100, 7])
    assert encode_run(recs) == b"".join(encode_record(r) for r in recs)


def test_columns() -> None:
    recs = records(3, [4, 0, 2])
    cols = RecordRun(3, 3, encode_run(recs)).columns()
    assert (cols.first, cols.num_records) == (3, 3)
    assert cols.headers == [r.header for r in recs]
    assert cols.req_ids == b"".join(r.req_id.to_bytes() for r in recs)
    assert cols.data_offsets == [0, 4, 4, 6]
    assert cols.data == b"".join(r.data for r in recs)
    no_data = run_columns(encode_run(recs), 3, 3, include_data=False)
    assert (no_data.data, no_data.data_offsets, no_data.headers) == (b"", [], cols.headers)


def test_empty_run() -> None:
    assert encode_run([]) == b""
    scan_run(b"", 0, 0)
    assert run_records(b"", 7, 0) == []
    assert RecordRun(7, 0, b"").end == 7


def test_shape_errors() -> None:
    run = encode_run(records(0, [3, 3]))
    with pytest.raises(RemoteProtocolError, match="expected 1"):
        scan_run(run, 1, 2)
    with pytest.raises(RemoteProtocolError, match="cannot hold"):
        scan_run(run, 0, 3)
    with pytest.raises(RemoteProtocolError, match="left over"):
        scan_run(run, 0, 1)
    with pytest.raises(RemoteProtocolError, match="left over"):
        run_records(run + b"\x00", 0, 2)
    with pytest.raises(RemoteProtocolError, match="holds no record"):
        run_first_id(run[:10])
    with pytest.raises(LocalProtocolError, match="out of range"):
        encode_run([Record(2**63, REC.req_id, 0, b"", 0)])


def test_checksum_errors_name_the_transaction() -> None:
    recs = records(20, [8, 8, 8])
    run = bytearray(encode_run(recs))
    run[stored_size(recs[0]) + 36 + 2] ^= 1  # a data byte of record 21
    with pytest.raises(DataChecksumError, match="transaction 21: record checksum"):
        run_records(bytes(run), 20, 3)
    # A record whose data matches its record checksum but not the client's data checksum (a storage node
    # that stored what it was not given) is caught too.
    forged = Record(20, recs[0].req_id, recs[0].header, recs[0].data, recs[0].checksum ^ 1)
    with pytest.raises(DataChecksumError, match="transaction 20: data does not match"):
        run_columns(encode_run([forged]), 20, 1)


sizes = st.lists(st.integers(min_value=0, max_value=300), max_size=30)


@settings(max_examples=200, deadline=None)
@given(first=st.integers(min_value=0, max_value=2**62), sizes=sizes)
def test_round_trip(first: int, sizes: list[int]) -> None:
    recs = records(first, sizes)
    run = encode_run(recs)
    scan_run(run, first, len(recs))
    assert run_records(run, first, len(recs)) == recs
    bounds = run_bounds(run, first, len(recs))
    assert [run[a:b] for a, b in itertools.pairwise(bounds)] == [encode_run([r]) for r in recs]
    cols = run_columns(run, first, len(recs))
    assert [cols.data[a:b] for a, b in zip(cols.data_offsets, cols.data_offsets[1:], strict=False)] == [
        r.data for r in recs
    ]


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(min_value=0, max_value=64), min_size=1, max_size=8), data=st.data())
def test_any_damage_is_caught(sizes: list[int], data: st.DataObject) -> None:
    recs = records(100, sizes)
    run = bytearray(encode_run(recs))
    position = data.draw(st.integers(min_value=0, max_value=len(run) - 1))
    run[position] ^= data.draw(st.integers(min_value=1, max_value=255))
    with pytest.raises((RemoteProtocolError, DataChecksumError)):
        run_records(bytes(run), 100, len(recs))
    with pytest.raises((RemoteProtocolError, DataChecksumError)):
        run_columns(bytes(run), 100, len(recs))
    with pytest.raises((RemoteProtocolError, DataChecksumError)):
        run_bounds(bytes(run), 100, len(recs))


@settings(max_examples=300, deadline=None)
@given(blob=st.binary(max_size=200), first=st.integers(min_value=-5, max_value=5), count=st.integers(-2, 6))
def test_garbage_raises_only_protocol_errors(blob: bytes, first: int, count: int) -> None:
    for unpack in (scan_run, run_bounds, run_records, run_columns):
        try:
            unpack(blob, first, count)
        except (RemoteProtocolError, DataChecksumError):
            pass


def uniform(first: int, count: int, size: int) -> list[Record]:
    return records(first, [size] * count)


@settings(max_examples=300, deadline=None)
@given(
    count=st.integers(min_value=16, max_value=40),
    size=st.integers(min_value=0, max_value=80),
    data=st.data(),
)
def test_a_run_of_one_record_size_is_verified_whole_and_any_damage_is_caught(
    count: int, size: int, data: st.DataObject
) -> None:
    """Runs of records of one size are checked without a loop over the records (CRC-32 linearity, see
    record_run); they must accept exactly what the per-record loop accepts and refuse one damaged byte
    anywhere, with the loop's error; a run received as a view of a payload (a memoryview) takes the same
    fast check."""
    first = data.draw(st.integers(min_value=0, max_value=2**40))
    run = encode_run(uniform(first, count, size))
    stride = size + 40
    assert uniform_run_verifies(run, first, stride, count)
    assert run_bounds(run, first, count) == list(range(0, len(run) + 1, stride))
    assert run_bounds(run, first, count) == _run_bounds_loop(run, first, count)
    payload = b"head" + run
    assert run_bounds(memoryview(payload)[4:], first, count) == run_bounds(run, first, count)
    assert uniform_run_verifies(memoryview(payload)[4:], first, stride, count)
    damaged = bytearray(run)
    position = data.draw(st.integers(min_value=0, max_value=len(run) - 1))
    damaged[position] ^= data.draw(st.integers(min_value=1, max_value=255))
    assert not uniform_run_verifies(bytes(damaged), first, stride, count)
    # The record checksum covers every byte but itself, so the check without data checksums refuses it too.
    assert not uniform_run_verifies(bytes(damaged), first, stride, count, data_checksums=False)
    with pytest.raises((RemoteProtocolError, DataChecksumError)) as fast:
        run_bounds(bytes(damaged), first, count)
    with pytest.raises((RemoteProtocolError, DataChecksumError)) as loop:
        _run_bounds_loop(damaged, first, count)
    assert str(fast.value) == str(loop.value)
    assert not uniform_run_verifies(memoryview(damaged), first, stride, count)
    with pytest.raises((RemoteProtocolError, DataChecksumError)) as view:
        run_bounds(memoryview(damaged), first, count)
    assert str(view.value) == str(loop.value)


def test_a_run_of_one_size_with_two_damaged_records_is_refused() -> None:
    recs = uniform(0, 64, 24)
    run = bytearray(encode_run(recs))
    stride = stored_size(recs[0])
    for i in (3, 40):  # the same damage in two records: a shift by a whole number of records cannot cancel it
        run[i * stride + 50] ^= 0x10
    assert not uniform_run_verifies(bytes(run), 0, stride, 64)
    with pytest.raises(DataChecksumError, match="transaction 3: record checksum"):
        run_bounds(bytes(run), 0, 64)


def test_the_fast_check_refuses_what_the_loop_refuses_beyond_checksums() -> None:
    recs = uniform(7, 20, 10)
    run = encode_run(recs)
    stride = stored_size(recs[0])
    # Ids out of sequence, and a data checksum that is not the data's (with a record checksum that verifies:
    # a storage node that stored what it was not given).
    assert not uniform_run_verifies(run, 8, stride, 20)
    forged = [r if r.transaction_id != 15 else r._replace(checksum=r.checksum ^ 1) for r in recs]
    run_forged = encode_run(forged)
    assert uniform_run_verifies(run_forged, 7, stride, 20, data_checksums=False)
    assert not uniform_run_verifies(run_forged, 7, stride, 20)
    with pytest.raises(DataChecksumError, match="transaction 15: data does not match"):
        run_bounds(run_forged, 7, 20)
    # Sizes and counts that do not describe the run are refused (the caller then runs its loop).
    assert not uniform_run_verifies(run, 7, stride, 19)
    assert not uniform_run_verifies(run[: 39 * 20], 7, 39, 20)
    # Records of several sizes take the loop, and verify.
    mixed = records(0, [10] * 10 + [11] * 10)
    assert run_records(encode_run(mixed), 0, 20) == mixed


def test_the_fast_check_reuses_its_scratch_copy_without_carrying_anything_over() -> None:
    """The copy the fast check makes is kept per thread for the next run of the same length (a fresh
    megabyte buffer per run page-faulted); what one run leaves in it never decides the next one."""
    good = encode_run(uniform(0, 32, 20))
    bad = bytearray(good)
    bad[3 * 60 + 45] ^= 1
    stride = 60
    for _ in range(3):
        assert uniform_run_verifies(good, 0, stride, 32)
        assert not uniform_run_verifies(bytes(bad), 0, stride, 32)
    results: list[bool] = []

    def other_thread() -> None:
        for _ in range(50):
            results.append(uniform_run_verifies(good, 0, stride, 32))
            results.append(not uniform_run_verifies(bytes(bad), 0, stride, 32))

    threads = [threading.Thread(target=other_thread) for _ in range(3)]
    for t in threads:
        t.start()
    for _ in range(50):
        assert uniform_run_verifies(good, 0, stride, 32)
    for t in threads:
        t.join()
    assert results == [True] * 300


@pytest.mark.parametrize("first", [0, 200, 255, 65_000, 2**24 - 100, 2**40 - 1, 2**62 + 12_345])
def test_the_fast_check_builds_the_expected_ids_lane_by_lane(first: int) -> None:
    """The ids are compared one byte lane at a time against lanes built from runs of equal bytes; across
    byte boundaries (first + count crossing 256, 65,536, ...) they must be the ids' big-endian bytes."""
    count = 70_000
    want = struct.pack(f">{count}q", *range(first, first + count))
    for j in range(8):
        assert _id_lane(first, count, 8 * (7 - j)) == want[j::8]
    recs = uniform(first, 300, 0)
    assert run_bounds(encode_run(recs), first, 300) == list(range(0, 300 * 40 + 1, 40))


def test_the_fast_check_leaves_ids_past_the_i64_range_to_the_loop() -> None:
    run = encode_run(uniform(2**63 - 20, 20, 4))
    assert not uniform_run_verifies(run, 2**63 - 10, 44, 20)  # ids that would pass 2**63: no struct error
    assert uniform_run_verifies(run, 2**63 - 20, 44, 20)
    with pytest.raises(RemoteProtocolError, match="expected"):
        run_bounds(run, 2**63 - 10, 20)


def _loop_accepts(run: bytes, first: int, count: int) -> bool:
    try:
        _run_bounds_loop(run, first, count)
    except (RemoteProtocolError, DataChecksumError):
        return False
    return True


_DAMAGE_KINDS = ("swap", "duplicate", "swap_bodies", "copy_body", "zero_same_bytes", "flip_bytes", "rotate")


@settings(max_examples=400, deadline=None)
@given(
    count=st.integers(min_value=16, max_value=40),
    size=st.integers(min_value=0, max_value=48),
    same_payloads=st.booleans(),
    kind=st.sampled_from(_DAMAGE_KINDS),
    data=st.data(),
)
def test_the_fast_check_agrees_with_the_loop_on_multi_record_damage(
    count: int, size: int, same_payloads: bool, kind: str, data: st.DataObject
) -> None:
    """The fast check of a run of one record size accepts exactly what the per-record loop accepts, also
    for damage spread over several records: records swapped, duplicated or rotated (the ids must still
    ascend), record bodies moved under the ids, the same bytes zeroed in two records (a torn-page pattern;
    with identical payloads the deltas are identical too) and bytes flipped in several records."""
    first = data.draw(st.integers(min_value=0, max_value=2**40))
    if same_payloads:
        recs = [Record.build(first + i, ReqId.of(9, 1, 0, 0), 5, bytes(size)) for i in range(count)]
    else:
        recs = uniform(first, count, size)
    stride = size + 40
    run = bytearray(encode_run(recs))
    pick = st.integers(min_value=0, max_value=count - 1)
    i, j = data.draw(pick), data.draw(pick)

    def rec(k: int) -> bytes:
        return bytes(run[k * stride : (k + 1) * stride])

    def put(k: int, value: bytes, start: int = 0) -> None:
        run[k * stride + start : (k + 1) * stride] = value[start:]

    a, b = rec(i), rec(j)
    if kind == "swap":
        put(i, b)
        put(j, a)
    elif kind == "duplicate":
        put(j, a)
    elif kind == "swap_bodies":
        put(i, b, 8)
        put(j, a, 8)
    elif kind == "copy_body":
        put(j, a, 8)
    elif kind == "zero_same_bytes":
        lo = data.draw(st.integers(min_value=0, max_value=stride - 1))
        hi = data.draw(st.integers(min_value=lo + 1, max_value=stride))
        for k in (i, j):
            run[k * stride + lo : k * stride + hi] = bytes(hi - lo)
    elif kind == "flip_bytes":
        for k in data.draw(st.lists(pick, min_size=1, max_size=4)):
            run[k * stride + data.draw(st.integers(0, stride - 1))] ^= data.draw(st.integers(1, 255))
    else:  # rotate the records from i to j by one
        lo, hi = min(i, j), max(i, j)
        body = bytes(run[lo * stride : (hi + 1) * stride])
        run[lo * stride : (hi + 1) * stride] = body[stride:] + body[:stride]
    damaged = bytes(run)
    loop = _loop_accepts(damaged, first, count)
    assert uniform_run_verifies(damaged, first, stride, count) == loop
    assert uniform_run_verifies(memoryview(b"head" + damaged)[4:], first, stride, count) == loop
    # Without data checksums (the storage node's check after its pread): ids, lengths and record checksums.
    shape_and_record_crcs = all(
        struct.unpack_from(">q20xi", damaged, k * stride) == (first + k, size)
        and crc32(damaged[k * stride : (k + 1) * stride - 4])
        == struct.unpack_from(">I", damaged, (k + 1) * stride - 4)[0]
        for k in range(count)
    )
    assert uniform_run_verifies(damaged, first, stride, count, data_checksums=False) == shape_and_record_crcs
    assert (run_bounds(damaged, first, count) == list(range(0, len(damaged) + 1, stride))) if loop else True
    if not loop:
        with pytest.raises((RemoteProtocolError, DataChecksumError)):
            run_bounds(damaged, first, count)


def test_a_run_received_as_a_view_takes_the_fast_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decoders hand runs out as views of the payload (no copy of the megabytes): they must not fall back to
    the per-record loop, which costs several times the fast check."""
    recs = uniform(100, 32, 30)
    payload = b"head" + encode_run(recs)

    def no_loop(*args: object) -> list[int]:
        raise AssertionError("the per-record loop ran")

    monkeypatch.setattr(record_run, "_run_bounds_loop", no_loop)
    assert run_bounds(memoryview(payload)[4:], 100, 32) == list(range(0, len(payload) - 4 + 1, 70))
