"""A minimal HTTP endpoint for ``/health``, ``/metrics`` (Prometheus text format) and ``/ping``.

Servers and storage nodes expose it on their ``*.http.port``. It speaks just enough HTTP/1.1 for probes and
Prometheus scrapers: one GET per connection, bounded request size and time, ``Connection: close``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 8192
REQUEST_TIMEOUT_S = 5.0

HealthCheck = Callable[[], tuple[bool, dict[str, Any]]]
"""Returns (healthy, details); details become the JSON body of /health."""


class HttpEndpoint:
    """Serves /health, /metrics and /ping for one process component."""

    def __init__(self, registry: CollectorRegistry, health: HealthCheck) -> None:
        self._registry = registry
        self._health = health
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0 picks a free port) and return the bound port."""
        self._server = await asyncio.start_server(self._handle, host, port, limit=MAX_REQUEST_BYTES)
        return int(self._server.sockets[0].getsockname()[1])

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None

    def respond(self, path: str) -> tuple[int, str, bytes]:
        """(status, content type, body) for a GET of ``path``; exposed for tests."""
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(self._registry)
        if path == "/health":
            healthy, details = self._health()
            body = json.dumps({"healthy": healthy, **details}, sort_keys=True).encode()
            return (200 if healthy else 503), "application/json", body
        if path == "/ping":
            return 200, "text/plain", b"pong\n"
        return 404, "text/plain", b"not found\n"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
            request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
            parts = request_line.split(" ")
            if len(parts) != 3 or parts[0] != "GET":
                status, ctype, body = 405, "text/plain", b"only GET is supported\n"
            else:
                status, ctype, body = self.respond(parts[1].split("?", 1)[0])
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            writer.close()
            return
        except Exception:
            log.exception("HTTP handler failed")
            status, ctype, body = 500, "text/plain", b"internal error\n"
        reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}
        header = (
            f"HTTP/1.1 {status} {reason.get(status, 'Error')}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        try:
            writer.write(header.encode("latin-1") + body)
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()
