"""A minimal HTTP endpoint for ``/health``, ``/metrics`` (Prometheus text format), ``/buildinfo`` and
``/ping``, and the metric registry every process starts with.

Servers and storage nodes expose it on their ``*.http.port``. It speaks just enough HTTP/1.1 for probes and
Prometheus scrapers: one GET per connection, bounded request size and time, ``Connection: close``.

``/metrics`` is collected and formatted on a thread, one scrape at a time: a server with 1,000 partitions
writes about 58,000 lines, a few tenths of a second of CPU that would otherwise stall the event loop (every
append, feed and keep-alive of the process) for all of it; on a thread the loop runs again at each of the
interpreter's switch intervals. Collectors therefore read loop-owned state from another thread, as
prometheus_client's own threaded exporter does: they copy containers the loop may resize in one C-level call
(``sorted(d.items())``, ``list(...)``) and never iterate them in Python.

While a scrape is built the switch interval is :data:`SCRAPE_SWITCH_INTERVAL_S` instead of Python's 5 ms. The
loop gives up the GIL at every system call (each read, write and poll), and with the collecting thread
running it waited up to an interval to take it back each time: a ``/ping`` during a scrape at 1,000
partitions took 328 ms, 33 to 35 ms with the shorter interval (``bench/partition_start.py``), at the same CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import platform
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    GCCollector,
    Info,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from waltz.errors import ConfigError
from waltz.version import __version__

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 8192
REQUEST_TIMEOUT_S = 5.0

SCRAPE_SWITCH_INTERVAL_S = 0.0005
"""The interpreter's switch interval while ``/metrics`` is built on a thread (see the module docstring)."""

HealthCheck = Callable[[], tuple[bool, dict[str, Any]]]
"""Returns (healthy, details); details become the JSON body of /health."""


@functools.cache
def build_info() -> dict[str, str]:
    """Version, Python version and, when known, the git commit this code was built from.

    The commit comes from ``WALTZ_GIT_COMMIT`` (set it when packaging) or, for a git checkout (a development
    or ``waltz local`` install), from the checkout's ``.git`` read directly: no subprocess, a few small
    files."""
    info = {"version": __version__, "python": platform.python_version()}
    commit = os.environ.get("WALTZ_GIT_COMMIT") or _git_commit(Path(__file__).resolve().parent)
    if commit:
        info["commit"] = commit
    return info


def _git_commit(start: Path) -> str | None:
    try:
        for directory in list(start.parents)[:4]:
            dot_git = directory / ".git"
            if dot_git.is_file():  # a worktree: "gitdir: <path>"
                text = dot_git.read_text().strip()
                if not text.startswith("gitdir:"):
                    return None
                git_dir = (directory / text.removeprefix("gitdir:").strip()).resolve()
            elif dot_git.is_dir():
                git_dir = dot_git
            else:
                continue
            common = git_dir
            if (git_dir / "commondir").is_file():
                common = (git_dir / (git_dir / "commondir").read_text().strip()).resolve()
            head = (git_dir / "HEAD").read_text().strip()
            if not head.startswith("ref:"):
                return head or None
            ref = head.removeprefix("ref:").strip()
            for base in (git_dir, common):
                if (base / ref).is_file():
                    return (base / ref).read_text().strip() or None
            packed = common / "packed-refs"
            if packed.is_file():
                for line in packed.read_text().splitlines():
                    parts = line.split(" ")
                    if len(parts) == 2 and parts[1] == ref:
                        return parts[0]
            return None
    except OSError:
        return None
    return None


def new_registry() -> CollectorRegistry:
    """A registry with the process, platform and garbage-collector collectors and ``waltz_build_info``
    (labels version, python, commit): what every dashboard panel about a process needs."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    Info("waltz_build", "Version of the running Waltz process", registry=registry).info(
        {"commit": "", **build_info()}
    )
    return registry


async def listen(what: str, host: str, port: int, start: Callable[[], Any]) -> Any:
    """Await ``start()`` (which binds ``host:port``); an address in use or not ours becomes a one-line
    :class:`~waltz.errors.ConfigError` naming ``what`` (a config key), not a traceback."""
    try:
        return await start()
    except OSError as e:
        # asyncio's message repeats the address; the errno's text alone reads better after ours.
        reason = os.strerror(e.errno) if isinstance(e.errno, int) and e.errno > 0 else (e.strerror or str(e))
        raise ConfigError(f"cannot listen on {host}:{port} ({what}): {reason}") from None


class _SwitchInterval:
    """Lowers the interpreter's switch interval while any scrape of the process is being built, and puts
    back the interval set before the first of them once the last one ends (endpoints of one process may
    scrape at the same time)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._before = 0.0

    @contextlib.contextmanager
    def short(self) -> Iterator[None]:
        with self._lock:
            if self._active == 0:
                self._before = sys.getswitchinterval()
                sys.setswitchinterval(SCRAPE_SWITCH_INTERVAL_S)
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                if self._active == 0:
                    sys.setswitchinterval(self._before)


_switch_interval = _SwitchInterval()


class HttpEndpoint:
    """Serves /health, /metrics and /ping for one process component."""

    def __init__(self, registry: CollectorRegistry, health: HealthCheck) -> None:
        self._registry = registry
        self._health = health
        self._server: asyncio.Server | None = None
        self._scrape = asyncio.Lock()
        """One scrape at a time: a second waits rather than doubling the CPU a scrape costs."""

    async def start(self, host: str, port: int, what: str = "http.port") -> int:
        """Listen on ``host:port`` (0 picks a free port) and return the bound port; ConfigError (naming the
        config key ``what``) if the address cannot be bound."""
        self._server = await listen(
            what,
            host,
            port,
            lambda: asyncio.start_server(self._handle, host, port, limit=MAX_REQUEST_BYTES),
        )
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
        if path == "/buildinfo":
            return 200, "application/json", json.dumps(build_info(), sort_keys=True).encode() + b"\n"
        if path == "/ping":
            return 200, "text/plain", b"pong\n"
        return 404, "text/plain", b"not found\n"

    async def _respond(self, path: str) -> tuple[int, str, bytes]:
        if path != "/metrics":
            return self.respond(path)
        async with self._scrape:
            with _switch_interval.short():
                body = await asyncio.to_thread(generate_latest, self._registry)
        return 200, CONTENT_TYPE_LATEST, body

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
            request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
            parts = request_line.split(" ")
            if len(parts) != 3 or parts[0] != "GET":
                status, ctype, body = 405, "text/plain", b"only GET is supported\n"
            else:
                status, ctype, body = await self._respond(parts[1].split("?", 1)[0])
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
