"""What a storage node takes for a damaged replica, and which truncations it refuses."""

from __future__ import annotations

import uuid

from waltz.storage.controlfile import FLAG_ASSIGNED, PartitionInfo
from waltz.storage.fileio import make_dirs_durable
from waltz.storage.partition import PartitionLog
from waltz.storage.replica_check import lost_below_mark, missing_log, truncation_refusal
from waltz.testing.crashfs import CrashFS

INFO = PartitionInfo(session_id=5, low_water_mark=100, local_low_water_mark=80, flags=FLAG_ASSIGNED)


def test_missing_directory_or_segments_is_damage() -> None:
    fs = CrashFS()
    make_dirs_durable(fs, "/data")
    assert missing_log(fs, "/data", 3) == "its directory /data/3 is missing"
    make_dirs_durable(fs, "/data/3")
    assert missing_log(fs, "/data", 3) == "its directory /data/3 holds no segment"
    fs.open("/data/3/notes.txt", create=True).close()
    assert missing_log(fs, "/data", 3) == "its directory /data/3 holds no segment"
    PartitionLog.open("/data", uuid.UUID(int=1), 3, fs=fs).close()
    assert missing_log(fs, "/data", 3) is None


def test_a_log_below_its_local_mark_lost_records_but_one_behind_its_mark_did_not() -> None:
    assert lost_below_mark(79, INFO) is not None
    assert lost_below_mark(80, INFO) is None  # behind its low-water mark 100: catching up, not damaged
    assert lost_below_mark(150, INFO) is None


def test_only_a_cut_below_the_low_water_mark_is_refused() -> None:
    assert truncation_refusal(0, INFO, 150, 120) is None  # above the mark
    assert truncation_refusal(0, INFO, 150, 100) is None  # down to the mark
    assert truncation_refusal(0, INFO, 90, 95) is None  # cuts nothing (the log ends below the target)
    assert truncation_refusal(0, INFO, 90, 90) is None
    refusal = truncation_refusal(0, INFO, 150, 99)
    assert refusal is not None
    assert "refusing to truncate partition 0 from 150 to 99: below its low-water mark 100" in refusal
    assert truncation_refusal(0, INFO, 90, 40) is not None  # behind the mark, still committed records
    fresh = PartitionInfo(flags=FLAG_ASSIGNED)
    assert truncation_refusal(0, fresh, 10, -1) is None  # a new partition's mark is -1: anything goes
