"""What a storage node knows it lost, and what it refuses to throw away.

A replica is **damaged** when the node's control file says the partition is assigned here but the files do not
hold what the control file says they held: the partition directory is missing, it holds no segment, or the
log ends below the *local low-water mark* (the replica's own max id, fsynced, when its last low-water mark was
set). A power cut that drops an un-fsynced directory entry, a wiped or replaced disk, or files deleted by hand
do that. A damaged replica is never taken for a new, empty one: the node persists the DAMAGED flag in the
control file, logs one ERROR line, reports it in ``/health`` and the admin metrics, and answers
LastSessionInfo with the damaged flag, so recovery does not count it in a vote (``docs/replication.md``).

It is **repaired** once a low-water mark was set after the damage was found (by a store session's recovery,
which resolved the mark without counting this replica, or by ``waltz storage recover-partition``) and the
replica holds every record up to that mark, fsynced: it then holds exactly the committed log up to it, as a
replica that was merely behind does. The node clears the flag durably and logs one INFO line.

A **truncation** below the persisted low-water mark would cut records a quorum committed (recovery never
asks for it: every mark it truncates to is at or above the replica's own). The node refuses it with an ERROR
line unless the request carries the operator-repair flag, which only the operator's repair tools set.
"""

from __future__ import annotations

import os

from waltz.storage.controlfile import PartitionInfo
from waltz.storage.fileio import FileSystem
from waltz.storage.segment import parse_segment_name

__all__ = ["lost_below_mark", "missing_log", "truncation_refusal"]


def missing_log(fs: FileSystem, storage_directory: str, partition_id: int) -> str | None:
    """Why an assigned partition's files are missing (its directory, or every segment), or None."""
    directory = os.path.join(storage_directory, str(partition_id))
    if not fs.exists(directory):
        return f"its directory {directory} is missing"
    if not any(parse_segment_name(name) is not None for name in fs.listdir(directory)):
        return f"its directory {directory} holds no segment"
    return None


def lost_below_mark(max_transaction_id: int, info: PartitionInfo) -> str | None:
    """Why a replica whose log ends at ``max_transaction_id`` lost records it held, or None."""
    if max_transaction_id < info.local_low_water_mark:
        return (
            f"its log ends at transaction {max_transaction_id}, below {info.local_low_water_mark}, the max "
            "id it held (fsynced) when its low-water mark was set"
        )
    return None


def truncation_refusal(
    partition_id: int, info: PartitionInfo, max_transaction_id: int, transaction_id: int
) -> str | None:
    """Why truncating to ``transaction_id`` would cut committed records (below the persisted low-water
    mark), or None. A truncation that cuts nothing (the log ends at or below the target) is never refused."""
    if transaction_id >= max_transaction_id or transaction_id >= info.low_water_mark:
        return None
    return (
        f"refusing to truncate partition {partition_id} from {max_transaction_id} to {transaction_id}: below "
        f"its low-water mark {info.low_water_mark}, so it would cut records a quorum committed; only an "
        "operator's repair tool may (its operator-repair flag)"
    )
