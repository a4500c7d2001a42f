"""The server process: start a :class:`~waltz.server.server.WaltzServer`, run it until a stop signal or
its failure, and leave the cluster cleanly (``waltz server run``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from waltz.errors import WaltzError
from waltz.http import build_info
from waltz.runtime import tune_gc, tune_malloc, wait_for_stop_signal
from waltz.server.config import ServerConfig
from waltz.server.server import WaltzServer

log = logging.getLogger("waltz.server.server")  # the server's own lines, under the name operators know


async def run_server(config: ServerConfig, *, ready: Callable[[WaltzServer], None] | None = None) -> None:
    """Run a server until SIGTERM/SIGINT, then leave the cluster cleanly."""
    info = build_info()
    log.info(
        "waltz server %s starting (python %s%s): zookeeper %s, cluster %s, %s:%d, HTTP port %s, TLS %s",
        info["version"],
        info["python"],
        f", commit {info['commit'][:12]}" if "commit" in info else "",
        config.zookeeper_connect,
        config.cluster_root,
        config.host,
        config.port,
        config.http_port or "off",
        "on" if config.tls.enabled else "off",
    )
    server = await WaltzServer.start(config)
    tune_gc()
    tune_malloc()
    try:
        if ready is not None:
            ready(server)
        stop = asyncio.create_task(wait_for_stop_signal(), name="server-stop-signal")
        failed = asyncio.create_task(server.wait_failed(), name="server-failure")
        await asyncio.wait([stop, failed], return_when=asyncio.FIRST_COMPLETED)
        for t in (stop, failed):
            t.cancel()
        await asyncio.gather(stop, failed, return_exceptions=True)
        if server.failure is not None:
            raise WaltzError(f"the server failed: {server.failure!r}") from server.failure
    finally:
        await server.aclose()
        log.info("server %d stopped", server.server_id)
