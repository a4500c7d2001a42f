"""Per-frame CPU of the transport: an echo pair on loopback, in one process, on uvloop.

The client writes ``--frames`` payloads of ``--size`` bytes pipelined (``--window`` outstanding), the server
echoes each back through ``serve_payloads`` + ``send`` (the server's client port, a storage node's data
port); the client takes each read's payloads with ``deliver_payloads`` (the client library's stream
connection, the server's storage RPC clients) and sends more from there. Both ends run in this process, so
the CPU time printed covers each frame framed, written, read and decoded twice (once per direction)::

    PYTHONPATH=src .venv/bin/python bench/transport_frames.py --size 60 --frames 200000
"""

from __future__ import annotations

import argparse
import asyncio
import time

from waltz.protocol.framing import MAGIC_STORAGE
from waltz.runtime import run
from waltz.transport import FramedConnection, open_connection, serve


async def main(size: int, frames: int, window: int) -> None:
    async def echo(conn: FramedConnection) -> None:
        await conn.serve_payloads(conn.send)

    common = {"magic": MAGIC_STORAGE, "versions": [1], "hello_text": "bench"}
    server = await serve("127.0.0.1", 0, echo, **common)  # type: ignore[arg-type]
    conn = await open_connection("127.0.0.1", server.port, **common)  # type: ignore[arg-type]
    payload = bytes(range(256)) * (size // 256 + 1)
    payload = payload[:size]
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    counts = {"sent": 0, "received": 0}

    def fill() -> None:
        sent, received = counts["sent"], counts["received"]
        while sent < frames and sent - received < window:
            conn.send(payload)
            sent += 1
        counts["sent"] = sent

    def on_payloads(burst: list[bytes]) -> None:
        counts["received"] += len(burst)
        if counts["received"] >= frames:
            if not done.done():
                done.set_result(None)
            return
        fill()

    def on_end(reason: BaseException) -> None:
        if not done.done():
            done.set_exception(reason)

    wall0 = time.perf_counter()
    cpu0 = time.process_time()
    conn.deliver_payloads(on_payloads, on_end)
    fill()
    await done
    cpu = time.process_time() - cpu0
    wall = time.perf_counter() - wall0
    await conn.aclose()
    await server.aclose()
    print(
        f"size={size} frames={frames}: {cpu / frames * 1e6:.2f} us CPU per echoed frame, "
        f"{frames / wall:,.0f} frames/s"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=60)
    parser.add_argument("--frames", type=int, default=200_000)
    parser.add_argument("--window", type=int, default=256)
    args = parser.parse_args()
    run(main(args.size, args.frames, args.window))
