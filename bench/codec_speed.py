"""Codec throughput on the hot paths: storage AppendRequest batches, client AppendRequest and FeedData.

Run: ``.venv/bin/python bench/codec_speed.py``. Prints records (or messages) per second for encode+decode;
figures are recorded in docs/BENCHMARKS.md. Not a test: speed is measured here, never asserted in unit tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from waltz.protocol import client_server as cs
from waltz.protocol import storage as st
from waltz.protocol.records import Record, ReqId


def rate(label: str, count_per_round: int, fn: Callable[[], object], min_seconds: float = 1.0) -> float:
    rounds = 0
    start = time.perf_counter()
    while True:
        fn()
        rounds += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            break
    per_s = rounds * count_per_round / elapsed
    print(f"{label:<48} {per_s:>14,.0f} /s")
    return per_s


def main() -> None:
    records = tuple(Record.build(i, ReqId.of(1, 2, 3, i), i, bytes(512)) for i in range(500))
    batch = st.AppendRequest(1, 2, 3, records, False)
    rate("storage AppendRequest encode+decode (records)", len(records), lambda: st.decode(st.encode(batch)))
    append = cs.AppendRequest.build(ReqId.of(1, 2, 3, 4), 10, 0, bytes(512), write_locks=(1, 2))
    rate(
        "client AppendRequest encode+decode (messages)",
        1000,
        lambda: [cs.decode(cs.encode(append, 5), 5) for _ in range(1000)],
    )
    feed = cs.FeedData(ReqId.of(1, 2, 3, 4), 10, 0)
    rate(
        "client FeedData encode+decode (messages)",
        1000,
        lambda: [cs.decode(cs.encode(feed, 5), 5) for _ in range(1000)],
    )


if __name__ == "__main__":
    main()
