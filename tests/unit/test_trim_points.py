"""TrimPoints (``<root>/store/trim``): golden bytes, strict decoding, the rules a trim is checked by, and the
grace: a trim point is pending until its time comes, then in force (virtual time: a plain clock value)."""

from __future__ import annotations

import pytest

from waltz.cluster.trim_points import (
    PendingTrim,
    TrimEntry,
    TrimPoints,
    TrimSource,
    describe_entry,
    next_entry,
    trim_refusal,
)
from waltz.errors import MetadataError

HOUR_MS = 3_600_000


def test_golden_bytes_and_round_trip() -> None:
    points = TrimPoints(
        {
            3: TrimEntry(100, 1_600_000_000_000),
            0: TrimEntry(7, 1, PendingTrim(9, 2, 5, TrimSource.POLICY)),
        }
    )
    raw = points.encode()
    assert raw.hex() == (
        "0200000002"
        + "00000000" + "0000000000000007" + "0000000000000001"
        + "01" + "0000000000000009" + "0000000000000002" + "0000000000000005" + "03"
        + "00000003" + "0000000000000064" + "00000174876e8000" + "00"
    )  # fmt: skip
    assert TrimPoints.decode(raw) == points
    assert points.of(3) == 100
    assert points.of(1) == 0  # not listed: nothing trimmed


def test_with_nothing_pending_it_is_written_in_format_1_as_waltz_0_1_0_reads_it() -> None:
    points = TrimPoints({3: TrimEntry(100, 1_600_000_000_000), 0: TrimEntry(7, 1)})
    assert points.encode().hex() == (
        "0100000002000000000000000000000007000000000000000100000003000000000000006400000174876e8000"
    )


def test_format_1_reads_as_trim_points_in_force() -> None:
    raw = bytes.fromhex(
        "0100000002000000000000000000000007000000000000000100000003000000000000006400000174876e8000"
    )
    assert TrimPoints.decode(raw) == TrimPoints({3: TrimEntry(100, 1_600_000_000_000), 0: TrimEntry(7, 1)})


@pytest.mark.parametrize(
    "hex_",
    [
        "0300000000",  # unknown version
        "0200000001" + "00000000" + "0000000000000000" + "0000000000000000" + "00",  # says nothing
        "0200000001" + "00000000" + "0000000000000005" + "0000000000000001" + "02",  # bad pending flag
        # pending at or below the trim point in force
        "0200000001" + "00000000" + "0000000000000005" + "0000000000000001" + "01"
        + "0000000000000005" + "0000000000000001" + "0000000000000002" + "01",
        # takes effect before it was set
        "0200000001" + "00000000" + "0000000000000005" + "0000000000000001" + "01"
        + "0000000000000006" + "0000000000000009" + "0000000000000002" + "01",
        # unknown source
        "0200000001" + "00000000" + "0000000000000005" + "0000000000000001" + "01"
        + "0000000000000006" + "0000000000000001" + "0000000000000002" + "07",
        "0200000002" + ("00000001" + "0000000000000005" + "0000000000000001" + "00") * 2,  # twice
        "020000000100000000",  # truncated
        "020000000000",  # trailing byte
    ],
)  # fmt: skip
def test_bad_values_are_refused(hex_: str) -> None:
    with pytest.raises(MetadataError):
        TrimPoints.decode(bytes.fromhex(hex_))


def test_refusals_name_the_partition_and_say_why() -> None:
    assert trim_refusal(2, 500, high_water_mark=1999, min_kept_transactions=1000) is None
    assert trim_refusal(2, 1000, high_water_mark=1999, min_kept_transactions=1000) is None
    assert "above the high-water mark 1999" in (trim_refusal(2, 2001, 1999, 0) or "")
    assert trim_refusal(2, 2000, 1999, 0) is None  # everything committed may go when no head is kept
    guard = trim_refusal(2, 1001, 1999, 1000) or ""
    assert guard.startswith("partition 2: trim point 1001 would keep fewer than the 1000 most recent")
    assert "the highest trim point allowed now is 1000" in guard
    assert "negative" in (trim_refusal(2, -1, 1999, 0) or "")


def test_a_trim_point_is_pending_for_the_grace_then_in_force() -> None:
    t0 = 1_700_000_000_000
    entry = next_entry(TrimEntry(0, 0), 500, t0, HOUR_MS, TrimSource.OPERATOR)
    assert entry == TrimEntry(0, 0, PendingTrim(500, t0, t0 + HOUR_MS, TrimSource.OPERATOR))
    assert entry.in_force(t0) == 0
    assert entry.in_force(t0 + HOUR_MS - 1) == 0  # nothing is deleted during the grace
    assert entry.in_force(t0 + HOUR_MS) == 500
    assert entry.settled(t0 + HOUR_MS) == TrimEntry(500, t0)
    assert TrimPoints({4: entry}).next_change_ms() == t0 + HOUR_MS
    assert "pending 500 (set by an operator" in describe_entry(4, entry, t0)
    assert describe_entry(4, entry, t0 + HOUR_MS) == "partition 4: trim point 500"


def test_a_higher_trim_point_replaces_the_pending_one_and_waits_its_own_grace() -> None:
    t0 = 1_700_000_000_000
    first = next_entry(TrimEntry(100, 1), 500, t0, HOUR_MS, TrimSource.CLIENT)
    assert first is not None
    assert next_entry(first, 400, t0 + 10, HOUR_MS, TrimSource.OPERATOR) is None  # below: a no-op
    assert next_entry(first, 900, t0 + 10, HOUR_MS, TrimSource.POLICY, replace_pending=False) is None
    second = next_entry(first, 900, t0 + 10, HOUR_MS, TrimSource.OPERATOR)
    assert second is not None
    assert second.in_force(t0 + HOUR_MS) == 100  # deletion is delayed, never hastened
    assert second.in_force(t0 + 10 + HOUR_MS) == 900


def test_no_grace_puts_a_trim_point_in_force_at_once() -> None:
    assert next_entry(TrimEntry(0, 0), 50, 7, 0, TrimSource.OPERATOR) == TrimEntry(50, 7)
    assert next_entry(TrimEntry(50, 7), 50, 8, 0, TrimSource.OPERATOR) is None
