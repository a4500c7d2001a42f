"""A TCP relay on loopback that a test can cut: the fault suite's :class:`~bench.faults.proxy.LinkProxy` on a
free port. Every connection through it dies at once, and new ones are refused for a while, as a network
outage between a client and its server looks to both ends.

Run it on the test's event loop::

    proxy = await TcpProxy.start_to(server_port)
    ...  # point the client at proxy.endpoint
    await proxy.outage(0.5)  # cut everything; refuse connections for 0.5 s
    await proxy.aclose()
"""

from __future__ import annotations

from bench.faults.proxy import LinkProxy


class TcpProxy(LinkProxy):
    """Relays a free ``127.0.0.1`` port to ``127.0.0.1:target_port``."""

    @classmethod
    async def start_to(cls, target_port: int) -> TcpProxy:
        return await cls.start("test-proxy", 0, target_port)
