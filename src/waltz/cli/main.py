"""Entry point of the ``waltz`` command.

Command groups are discovered: every module of :mod:`waltz.cli` that defines ``register(subparsers)`` adds
one group (``waltz storage ...``, ``waltz cluster ...``). Each command is a thin layer over a library
function; errors become one line on stderr and a non-zero exit status, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
from collections.abc import Sequence

import waltz.cli
from waltz.cli import logsetup
from waltz.errors import ConfigError, WaltzError
from waltz.version import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="waltz", description="Waltz replicated write-ahead log")
    parser.add_argument("--version", action="version", version=f"waltz {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    logsetup.add_arguments(parser)
    groups = parser.add_subparsers(dest="group", metavar="GROUP", required=True)
    for info in sorted(pkgutil.iter_modules(waltz.cli.__path__), key=lambda m: m.name):
        if info.name in ("main", "common", "logsetup") or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"waltz.cli.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(groups)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logsetup.configure(logsetup.level_of(args), logsetup.format_of(args))
    logsetup.pass_down(args)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.error(f"missing command for {args.group}")
    try:
        result = handler(args)
    except ConfigError as e:
        print(f"waltz: error: {e}", file=sys.stderr)
        return 2
    except WaltzError as e:
        print(f"waltz: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return _stdout_closed()
    try:
        # Flushed here, where a reader that went away (``| head``) is still ours to handle.
        sys.stdout.flush()
    except BrokenPipeError:
        return _stdout_closed()
    return int(result or 0)


def _stdout_closed() -> int:
    """The reader of our stdout went away (``waltz disk dump-segment ... | head``): that is how a pipeline
    ends, not an error. Point stdout at /dev/null so the interpreter's final flush does not complain."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 141  # 128 + SIGPIPE, what a shell reports for a command killed by a closed pipe


if __name__ == "__main__":
    sys.exit(main())
