"""A TCP relay on loopback that a test can cut: the fault suite's :class:`~bench.faults.proxy.LinkProxy` on a
free port. Every connection through it dies at once, and new ones are refused for a while, as a network
outage between a client and its server looks to both ends. :meth:`TcpProxy.mute` plays the other kind of
fault: the connections stay open, but nothing the server sends on them reaches the client any more.

Run it on the test's event loop::

    proxy = await TcpProxy.start_to(server_port)
    ...  # point the client at proxy.endpoint
    await proxy.outage(0.5)  # cut everything; refuse connections for 0.5 s
    proxy.mute()  # the connections open now lose every byte from the server; new ones relay normally
    await proxy.aclose()
"""

from __future__ import annotations

import asyncio
import contextlib

from bench.faults.proxy import RELAY_READ_BYTES, LinkProxy


class TcpProxy(LinkProxy):
    """Relays a free ``127.0.0.1`` port to ``127.0.0.1:target_port``."""

    def __init__(self, name: str, listen_port: int, target_port: int, max_connections: int) -> None:
        super().__init__(name, listen_port, target_port, max_connections)
        self._connections = 0
        self._muted_below = 0  # Connections numbered below this drop what the server sends.

    @classmethod
    async def start_to(cls, target_port: int) -> TcpProxy:
        return await cls.start("test-proxy", 0, target_port)

    def mute(self) -> None:
        """From now on, every connection open now silently drops the server's bytes (the client's still
        reach the server); connections made later relay both ways."""
        self._muted_below = self._connections

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = self._connections
        self._connections += 1
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
            loop.create_task(self._pump(reader, up_writer, None)),
            loop.create_task(self._pump(up_reader, writer, number)),
        ]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.transport.abort()

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, number: int | None
    ) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while True:
                data = await reader.read(RELAY_READ_BYTES)
                if not data:
                    return
                if number is not None and number < self._muted_below:
                    continue  # Muted: lost on the way, the connection stays up.
                writer.write(data)
                await writer.drain()
