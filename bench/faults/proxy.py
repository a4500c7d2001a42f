"""A TCP relay on loopback that the fault suite can cut and restore (a network partition of one link).

Each relay listens on a fixed loopback port (the address the rest of the cluster knows) and forwards to the
real listener. :meth:`LinkProxy.cut` aborts every relayed connection (both ends see a reset, as when a link
dies under an established connection) and refuses new ones until :meth:`LinkProxy.restore`. Bounded: at most
``max_connections`` relayed connections at once (more are refused) and 64 KiB per read, with back pressure
from ``drain`` so a stalled peer never grows a buffer without limit.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Self

RELAY_READ_BYTES = 64 * 1024
MAX_CONNECTIONS = 256


class LinkProxy:
    """Relays ``127.0.0.1:listen_port`` to ``127.0.0.1:target_port``; see the module docstring."""

    def __init__(self, name: str, listen_port: int, target_port: int, max_connections: int) -> None:
        self.name = name
        self.listen_port = listen_port
        self.target_port = target_port
        self.max_connections = max_connections
        self.cut_now = False
        self.cuts = 0
        self.relayed = 0
        self.connections = 0
        """Connections accepted so far; each is numbered in arrival order from 0 (see :meth:`_drops`)."""
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[None]] = set()

    @classmethod
    async def start(
        cls, name: str, listen_port: int, target_port: int, max_connections: int = MAX_CONNECTIONS
    ) -> Self:
        proxy = cls(name, listen_port, target_port, max_connections)
        proxy._server = await asyncio.start_server(proxy._on_client, "127.0.0.1", listen_port)
        # listen_port 0 asks for a free port: record the one we got.
        proxy.listen_port = int(proxy._server.sockets[0].getsockname()[1])
        return proxy

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.listen_port}"

    async def outage(self, seconds: float) -> None:
        """Cut everything and refuse new connections for ``seconds``."""
        self.cut()
        try:
            await asyncio.sleep(seconds)
        finally:
            self.restore()

    def cut(self) -> None:
        """Abort every relayed connection and refuse new ones until :meth:`restore`."""
        self.cut_now = True
        self.cuts += 1
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    def restore(self) -> None:
        self.cut_now = False

    async def aclose(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if self.cut_now or len(self._handlers) >= self.max_connections or task is None:
            writer.transport.abort()
            return
        self._handlers.add(task)
        try:
            await self._relay(reader, writer)
        finally:
            self._handlers.discard(task)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = self.connections
        self.connections += 1
        try:
            async with asyncio.timeout(5):
                up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except (OSError, TimeoutError):
            writer.transport.abort()
            return
        if self.cut_now:  # The link was cut while we connected upstream.
            writer.transport.abort()
            up_writer.transport.abort()
            return
        self.relayed += 1
        self._writers.update((writer, up_writer))
        loop = asyncio.get_running_loop()
        pumps = [
            loop.create_task(self._pump(reader, up_writer, number, upstream=True)),
            loop.create_task(self._pump(up_reader, writer, number, upstream=False)),
        ]
        try:
            # When one direction ends, end the other: a half-open relay would hide the cut.
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.transport.abort()

    def _drops(self, number: int, upstream: bool) -> bool:
        """Whether connection ``number`` silently loses what it relays towards the target (``upstream``) or
        back: never here; a subclass plays lossy links."""
        return False

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int, upstream: bool
    ) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while True:
                data = await reader.read(RELAY_READ_BYTES)
                if not data:
                    return
                if self._drops(number, upstream):
                    continue  # Lost on the way; the connection stays up.
                writer.write(data)
                await writer.drain()
