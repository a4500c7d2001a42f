"""A TCP relay on loopback that a test can cut: every connection through it dies at once, and new ones are
refused for a while, as a network outage between a client and its server looks to both ends.

Run it on the test's event loop::

    proxy = await TcpProxy.start("127.0.0.1", server_port)
    ...  # point the client at proxy.endpoint
    await proxy.outage(0.5)  # cut everything; refuse connections for 0.5 s
    await proxy.aclose()
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Self

RELAY_READ_BYTES = 64 * 1024


class TcpProxy:
    """Relays ``127.0.0.1:<port>`` to ``target_host:target_port``; see the module docstring."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.port = 0
        self.refusing = False
        self.connections_accepted = 0
        self.cuts = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    async def start(cls, target_host: str, target_port: int) -> Self:
        proxy = cls(target_host, target_port)
        proxy._server = await asyncio.start_server(proxy._on_client, "127.0.0.1", 0)
        proxy.port = int(proxy._server.sockets[0].getsockname()[1])
        return proxy

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cut(self) -> None:
        """Abort every relayed connection now (both sides see a reset)."""
        self.cuts += 1
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def outage(self, seconds: float) -> None:
        """Cut everything and refuse new connections for ``seconds``."""
        self.refusing = True
        self.cut()
        try:
            await asyncio.sleep(seconds)
        finally:
            self.refusing = False

    async def aclose(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refusing:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            writer.transport.abort()
            return
        if self.refusing:  # An outage began while we connected upstream.
            writer.transport.abort()
            up_writer.transport.abort()
            return
        self.connections_accepted += 1
        self._writers.update((writer, up_writer))
        loop = asyncio.get_running_loop()
        pumps = [
            loop.create_task(self._pump(reader, up_writer)),
            loop.create_task(self._pump(up_reader, writer)),
        ]
        self._tasks.update(pumps)
        try:
            # When one direction ends, end the other: a half-open relay would hide the outage.
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            self._tasks.difference_update(pumps)
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.transport.abort()

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while True:
                data = await reader.read(RELAY_READ_BYTES)
                if not data:
                    return
                writer.write(data)
                await writer.drain()
