"""The scrub: every stored record verified in the background, at a bounded rate."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import TYPE_CHECKING

from waltz.errors import (
    CorruptionError,
    WaltzError,
)
from waltz.storage.segment import (
    RecordCorruptionError,
)
from waltz.storage.work import MAX_LIST_RECORDS

if TYPE_CHECKING:
    from waltz.storage.services import NodeServices
    from waltz.storage.worker import StoragePartition

log = logging.getLogger(__name__)

SCRUB_CHUNK_BYTES = 256 * 1024
"""Bytes one scrub step reads (in the partition's worker, between its requests: small, so writes barely
wait)."""


async def scrub_forever(node: NodeServices) -> None:
    """Verify every stored record, partition by partition, at ``storage.scrub.bytesPerSecond``, then pause
    and start again: damage (a flipped bit, a torn page) is found and reported before a reader needs the
    record. Each step is a bounded read run through the partition's worker, ordered with its requests."""
    rate = node.config.scrub_bytes_per_second
    while True:
        started = time.monotonic()
        scanned = 0
        for part in node.partitions:
            txn: int | None = -1
            while txn is not None:
                try:
                    step = await node.on_partition(
                        part.partition_id, functools.partial(scrub_step, part, txn)
                    )
                except WaltzError as e:  # An I/O error, say: the partition's own requests report it too.
                    log.warning("partition %d: scrub skipped the rest: %r", part.partition_id, e)
                    break
                if step is None:
                    break
                txn, nbytes = step
                scanned += nbytes
                await asyncio.sleep(nbytes / rate)
        log.debug("scrub pass: %d bytes in %.1f s", scanned, time.monotonic() - started)
        await asyncio.sleep(node.config.scrub_pause_ms / 1000)


def scrub_step(part: StoragePartition, after: int) -> tuple[int, int] | None:
    """Verify the records stored after ``after`` (a bounded run); ``(last id checked, bytes read)``, or
    None when there is nothing after it. A damaged record is noted (see :meth:`note_damage`)."""
    plog = part.log
    if plog is None:
        return None
    firsts = plog.segment_first_ids
    txn = max(after + 1, firsts[0] if firsts else 0)
    if txn > plog.max_transaction_id:
        return None
    try:
        count, run = plog.read_run(txn, MAX_LIST_RECORDS, max_bytes=SCRUB_CHUNK_BYTES)
    except RecordCorruptionError as e:
        part.note_damage(e.transaction_id, str(e))
        return e.transaction_id, SCRUB_CHUNK_BYTES
    except CorruptionError as e:
        # Not one record but a structure (an index): nothing to skip to; the next pass tries again.
        log.error("partition %d: scrub stopped at transaction %d: %s", part.partition_id, txn, e)
        return None
    if count == 0:
        return None
    return txn + count - 1, len(run)
