"""TrimPoints (``<root>/store/trim``): golden bytes, strict decoding, and the rules a trim is checked by."""

from __future__ import annotations

import pytest

from waltz.cluster.trim_points import TrimEntry, TrimPoints, trim_refusal
from waltz.errors import MetadataError


def test_golden_bytes_and_round_trip() -> None:
    points = TrimPoints({3: TrimEntry(100, 1_600_000_000_000), 0: TrimEntry(7, 1)})
    raw = points.encode()
    assert raw.hex() == (
        "0100000002000000000000000000000007000000000000000100000003000000000000006400000174876e8000"
    )
    assert TrimPoints.decode(raw) == points
    assert points.of(3) == 100
    assert points.of(1) == 0  # not listed: nothing trimmed


@pytest.mark.parametrize(
    "hex_",
    [
        "0200000000",  # unknown version
        "01000000010000000000000000000000000000000000000001",  # trim point 0 is never written
        "0100000002" + ("0000000100000000000000050000000000000001") * 2,  # a partition twice
        "010000000100000000",  # truncated
        "010000000000",  # trailing byte
    ],
)
def test_bad_values_are_refused(hex_: str) -> None:
    with pytest.raises(MetadataError):
        TrimPoints.decode(bytes.fromhex(hex_))


def test_refusals_name_the_partition_and_say_why() -> None:
    assert trim_refusal(2, 500, high_water_mark=1999, min_kept_transactions=1000) is None
    assert trim_refusal(2, 1000, high_water_mark=1999, min_kept_transactions=1000) is None
    assert "above the high-water mark 1999" in (trim_refusal(2, 2001, 1999, 0) or "")
    assert trim_refusal(2, 2000, 1999, 0) is None  # everything committed may go when no grace is kept
    grace = trim_refusal(2, 1001, 1999, 1000) or ""
    assert grace.startswith("partition 2: trim point 1001 would keep fewer than the 1000 most recent")
    assert "the highest trim point allowed now is 1000" in grace
    assert "negative" in (trim_refusal(2, -1, 1999, 0) or "")
