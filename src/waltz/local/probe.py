"""Read a local process's ``/health`` and ``/metrics`` over loopback HTTP.

``http.client`` is used rather than ``urllib`` on purpose: urllib honours ``http_proxy`` from the environment,
and a proxy must never see (or break) requests to 127.0.0.1.
"""

from __future__ import annotations

import http.client
import json
import re
from typing import Any

from waltz.local.procs import LOOPBACK

HTTP_TIMEOUT_S = 2.0

_METRIC_LINE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)\{partition="(?P<p>\d+)"\} (?P<v>\S+)$')


def http_get(port: int, path: str, timeout_s: float = HTTP_TIMEOUT_S) -> tuple[int, bytes]:
    """(status, body) of ``GET path`` on ``127.0.0.1:port``; raises OSError if nothing answers."""
    conn = http.client.HTTPConnection(LOOPBACK, port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    except http.client.HTTPException as e:
        raise OSError(f"bad HTTP answer from port {port}: {e!r}") from None
    finally:
        conn.close()


def health(port: int) -> dict[str, Any] | None:
    """The JSON body of ``/health`` (served with 200 or 503), or None if the process does not answer."""
    try:
        _, body = http_get(port, "/health")
        value = json.loads(body)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def served_partitions(port: int) -> set[int]:
    """Partitions a server reports healthy (it owns them and has an open store session)."""
    value = health(port)
    if value is None:
        return set()
    parts = value.get("partitions", {})
    return {int(p) for p, ok in parts.items() if ok} if isinstance(parts, dict) else set()


def problems(port: int) -> list[str]:
    """What a process's ``/health`` says is wrong, one line each (empty if healthy or silent)."""
    value = health(port)
    if value is None or value.get("healthy", True):
        return []
    listed = value.get("problems")
    if isinstance(listed, list):
        return [str(p) for p in listed]
    parts = value.get("partitions")
    if isinstance(parts, dict):  # a storage node: {partition: reason}
        return [f"partition {p}: {why}" for p, why in parts.items() if isinstance(why, str)]
    return ["unhealthy"]


def partition_gauges(port: int, metric: str) -> dict[int, float]:
    """``{partition: value}`` of a per-partition gauge in ``/metrics`` (empty if unavailable)."""
    try:
        _, body = http_get(port, "/metrics")
    except OSError:
        return {}
    out: dict[int, float] = {}
    for line in body.decode("utf-8", "replace").splitlines():
        m = _METRIC_LINE.match(line)
        if m and m.group("name") == metric:
            try:
                out[int(m.group("p"))] = float(m.group("v"))
            except ValueError:
                continue
    return out
