"""Logging of ``waltz`` processes: the level, the text or JSON line format, and kazoo's noise.

Servers and storage nodes (``waltz server run``, ``waltz storage run``) log at INFO by default: one line per
event an operator acts on (start, ZooKeeper session changes, partitions opened and closed, store sessions,
replicas fenced and caught up, partitions assigned). Other commands log at WARNING, so their output stays
their answer. ``--log-level`` overrides both; ``-v`` is DEBUG.

The processes a command starts inherit its choice: ``--log-level``/``--log-format`` are passed down through
the environment (``WALTZ_LOG_LEVEL``, ``WALTZ_LOG_FORMAT``), which a command reads when it is given neither,
so ``waltz --log-level DEBUG local up`` (or ``WALTZ_LOG_LEVEL=DEBUG waltz local up``) starts a cluster whose
servers and storage nodes log at DEBUG to ``D/logs/``.

``--log-format json`` writes one JSON object per line (``ts``, ``level``, ``logger``, ``msg``, and ``exc``
with the formatted traceback when there is one) for log shippers.

Kazoo logs a warning for every failed connection attempt ("Connection dropped", "Connection time-out"), many
per second while ZooKeeper is down. The clients :func:`waltz.cluster.zk.connect` makes log through
``waltz.cluster.zk.kazoo``, whose filter drops those below ERROR unless DEBUG is on (in every process, client
applications too), and say one line per session state change instead; kazoo's other loggers are kept at
ERROR here unless the level is DEBUG.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record on one line: ts (ISO 8601, UTC, milliseconds), level, logger, msg[, exc]."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


class _OurHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The stderr handler :func:`configure` installs."""


def add_arguments(parser: argparse.ArgumentParser, *, default_level: str | None = None) -> None:
    """``--log-level`` and ``--log-format`` on ``parser``. On a subcommand they are also accepted after the
    command (``waltz server run --log-level DEBUG``); ``default_level`` is that command's level when none is
    given."""
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LEVELS,
        default=argparse.SUPPRESS,
        help="log level (servers and storage nodes: INFO by default, other commands: WARNING)",
    )
    parser.add_argument(
        "--log-format",
        choices=FORMATS,
        default=argparse.SUPPRESS,
        help="text (default) or json: one JSON object per line, for log shippers",
    )
    if default_level is not None:
        parser.set_defaults(default_log_level=default_level)


LEVEL_ENV = "WALTZ_LOG_LEVEL"
FORMAT_ENV = "WALTZ_LOG_FORMAT"


def level_of(args: argparse.Namespace) -> str:
    """The level a command logs at: --log-level, else DEBUG with -v, else $WALTZ_LOG_LEVEL, else the
    command's default."""
    given = getattr(args, "log_level", None)
    if given:
        return str(given)
    if getattr(args, "verbose", False):
        return "DEBUG"
    inherited = os.environ.get(LEVEL_ENV, "").upper()
    if inherited in LEVELS:
        return inherited
    return str(getattr(args, "default_log_level", "WARNING"))


def format_of(args: argparse.Namespace) -> str:
    """--log-format, else $WALTZ_LOG_FORMAT, else text."""
    given = getattr(args, "log_format", None) or os.environ.get(FORMAT_ENV, "")
    return given if given in FORMATS else "text"


def pass_down(args: argparse.Namespace) -> None:
    """Put the options given on the command line into the environment, for the processes it starts."""
    if getattr(args, "log_level", None):
        os.environ[LEVEL_ENV] = str(args.log_level)
    if getattr(args, "log_format", None):
        os.environ[FORMAT_ENV] = str(args.log_format)


def configure(level: str, fmt: str = "text") -> None:
    """Send log records at ``level`` and above to stderr as text or JSON lines.

    Replaces the handler an earlier call installed. Like :func:`logging.basicConfig`, it changes nothing when
    the root logger already has another handler (``main()`` also runs inside test processes, which capture
    logs their own way)."""
    root = logging.getLogger()
    for old in list(root.handlers):
        if isinstance(old, _OurHandler):
            root.removeHandler(old)
    if root.handlers:
        return
    handler = _OurHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root.addHandler(handler)
    root.setLevel(level)
    logging.getLogger("kazoo").setLevel(logging.DEBUG if level == "DEBUG" else logging.ERROR)
