"""A TCP relay on loopback that a test can cut: the fault suite's :class:`~bench.faults.proxy.LinkProxy` on a
free port. Every connection through it dies at once, and new ones are refused for a while, as a network
outage between a client and its server looks to both ends. :meth:`TcpProxy.mute` plays the other kind of
fault: the connections stay open, but nothing the server sends on them reaches the client any more.

Run it on the test's event loop::

    proxy = await TcpProxy.start_to(server_port)
    ...  # point the client at proxy.endpoint
    await proxy.outage(0.5)  # cut everything; refuse connections for 0.5 s
    proxy.mute()  # the connections open now lose every byte from the server; new ones relay normally
    proxy.swallow()  # the same for every byte from the client
    await proxy.aclose()
"""

from __future__ import annotations

from bench.faults.proxy import LinkProxy


class TcpProxy(LinkProxy):
    """Relays a free ``127.0.0.1`` port to ``127.0.0.1:target_port``."""

    def __init__(self, name: str, listen_port: int, target_port: int, max_connections: int) -> None:
        super().__init__(name, listen_port, target_port, max_connections)
        self._muted_below = 0  # Connections numbered below this drop what the server sends.
        self._swallowed_below = 0  # Connections numbered below this drop what the client sends.

    @classmethod
    async def start_to(cls, target_port: int) -> TcpProxy:
        return await cls.start("test-proxy", 0, target_port)

    def mute(self) -> None:
        """From now on, every connection open now silently drops the server's bytes (the client's still
        reach the server); connections made later relay both ways."""
        self._muted_below = self.connections

    def swallow(self) -> None:
        """From now on, every connection open now silently drops what the client sends (requests lost on
        the way, as in the moment before a link dies); connections made later relay both ways."""
        self._swallowed_below = self.connections

    def _drops(self, number: int, upstream: bool) -> bool:
        return number < (self._swallowed_below if upstream else self._muted_below)
