"""Per-frame CPU of the transport: an echo pair on loopback, in one process, on uvloop.

The client writes ``--frames`` payloads of ``--size`` bytes pipelined (``--window`` outstanding), the server
echoes each back: through ``receive_many`` + ``send`` (the server's client connections) or, with
``--callback``, through ``serve_payloads`` (a storage node's data port); the client reads with ``receive`` +
``receive_buffered`` (the client library's stream reader). Both ends run in this process, so the CPU time
printed covers each frame framed, written, read and decoded twice (once per direction)::

    PYTHONPATH=src .venv/bin/python bench/transport_frames.py --size 60 --frames 200000
"""

from __future__ import annotations

import argparse
import time

from waltz.protocol.framing import MAGIC_STORAGE
from waltz.transport import FramedConnection, open_connection, run, serve


async def main(size: int, frames: int, window: int, callback: bool) -> None:
    async def echo(conn: FramedConnection) -> None:
        if callback:
            await conn.serve_payloads(conn.send)
            return
        burst: list[bytes] = []
        while True:
            await conn.receive_many(burst)
            for payload in burst:
                conn.send(payload)
            burst.clear()
            if conn.drain_needed:
                await conn.drain()

    common = {"magic": MAGIC_STORAGE, "versions": [1], "hello_text": "bench"}
    server = await serve("127.0.0.1", 0, echo, callback_reads=callback, **common)  # type: ignore[arg-type]
    conn = await open_connection("127.0.0.1", server.port, **common)  # type: ignore[arg-type]
    payload = bytes(range(256)) * (size // 256 + 1)
    payload = payload[:size]
    received = 0
    sent = 0
    burst: list[bytes] = []
    wall0 = time.perf_counter()
    cpu0 = time.process_time()
    while received < frames:
        while sent < frames and sent - received < window:
            conn.send(payload)
            sent += 1
        burst.append(await conn.receive())
        conn.receive_buffered(burst)
        received += len(burst)
        burst.clear()
    cpu = time.process_time() - cpu0
    wall = time.perf_counter() - wall0
    await conn.aclose()
    await server.aclose()
    mode = "serve_payloads" if callback else "receive_many"
    print(
        f"size={size} frames={frames} server={mode}: {cpu / frames * 1e6:.2f} us CPU per echoed frame, "
        f"{frames / wall:,.0f} frames/s"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=60)
    parser.add_argument("--frames", type=int, default=200_000)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--callback", action="store_true", help="echo through serve_payloads")
    args = parser.parse_args()
    run(main(args.size, args.frames, args.window, args.callback))
