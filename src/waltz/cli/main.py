"""Entry point of the ``waltz`` command.

Command groups are discovered: every module of :mod:`waltz.cli` that defines ``register(subparsers)`` adds
one group (``waltz storage ...``, ``waltz cluster ...``). Each command is a thin layer over a library
function; errors become one line on stderr and a non-zero exit status, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys
from collections.abc import Sequence

import waltz.cli
from waltz import __version__
from waltz.errors import ConfigError, WaltzError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="waltz", description="Waltz replicated write-ahead log")
    parser.add_argument("--version", action="version", version=f"waltz {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    groups = parser.add_subparsers(dest="group", metavar="GROUP", required=True)
    for info in sorted(pkgutil.iter_modules(waltz.cli.__path__), key=lambda m: m.name):
        if info.name in ("main", "common") or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"waltz.cli.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(groups)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
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
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
