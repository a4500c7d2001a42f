"""Dotted-key YAML configuration shared by every Waltz process and CLI.

Keys are written as in the original Waltz, dotted (``storage.segment.size.threshold``); a YAML file may spell
them flat (``storage.port: 5000``) or nested (``storage: {port: 5000}``), or mix both. Each component declares
a :class:`ConfigSchema`; :meth:`ConfigSchema.parse` checks every value and reports *all* problems at once in
one :class:`~waltz.errors.ConfigError`, naming the file and key. Unknown keys are errors (a typo must not be
silently ignored), with a suggestion of the closest known key.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from waltz.errors import ConfigError

REQUIRED: Any = object()
"""Marker default: the key must be given."""


@dataclass(frozen=True)
class Key:
    """One configuration key: its type, default and allowed range."""

    name: str
    kind: type
    default: Any = REQUIRED
    doc: str = ""
    min_value: float | None = None
    max_value: float | None = None
    choices: tuple[Any, ...] | None = None
    check: Callable[[Any], str | None] | None = None

    def convert(self, raw: Any) -> Any:
        """Return ``raw`` as this key's type, or raise ``ValueError`` saying why not."""
        value: Any
        if self.kind is bool:
            if isinstance(raw, bool):
                value = raw
            elif isinstance(raw, str) and raw.lower() in ("true", "false", "yes", "no", "on", "off"):
                value = raw.lower() in ("true", "yes", "on")
            else:
                raise ValueError(f"expected true or false, got {raw!r}")
        elif self.kind is int:
            if isinstance(raw, bool) or not isinstance(raw, int | str):
                raise ValueError(f"expected an integer, got {raw!r}")
            try:
                value = int(raw)
            except ValueError:
                raise ValueError(f"expected an integer, got {raw!r}") from None
        elif self.kind is float:
            if isinstance(raw, bool) or not isinstance(raw, int | float | str):
                raise ValueError(f"expected a number, got {raw!r}")
            try:
                value = float(raw)
            except ValueError:
                raise ValueError(f"expected a number, got {raw!r}") from None
        elif self.kind is str:
            if not isinstance(raw, str | int) or isinstance(raw, bool):
                raise ValueError(f"expected a string, got {raw!r}")
            value = str(raw)
        else:
            value = raw
        if self.min_value is not None and value < self.min_value:
            raise ValueError(f"must be at least {self.min_value:g}, got {value}")
        if self.max_value is not None and value > self.max_value:
            raise ValueError(f"must be at most {self.max_value:g}, got {value}")
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"must be one of {', '.join(map(str, self.choices))}, got {value!r}")
        if self.check is not None:
            problem = self.check(value)
            if problem:
                raise ValueError(problem)
        return value


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Turn nested mappings into dotted keys: ``{"a": {"b": 1}}`` becomes ``{"a.b": 1}``."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


MAX_CONFIG_FILE_BYTES = 1024 * 1024
"""The largest config file read; a bigger one (or an endless one such as /dev/zero) is refused."""


def read_bounded(path: str | Path, max_bytes: int) -> bytes:
    """The bytes of ``path``, reading at most ``max_bytes`` + 1 of them whatever the file claims to be.

    Raises ValueError when the file holds more than ``max_bytes`` (a device such as /dev/zero, a FIFO fed
    forever, or just a huge file), and OSError when it cannot be read.
    """
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"larger than {max_bytes} bytes")
    return data


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file into dotted keys, with a clear error for a missing, oversized (more than
    ``MAX_CONFIG_FILE_BYTES``) or malformed file."""
    p = Path(path)
    try:
        text = read_bounded(p, MAX_CONFIG_FILE_BYTES).decode("utf-8")
    except IsADirectoryError:
        raise ConfigError(f"{p}: cannot read config file: it is a directory") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read config file: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not a UTF-8 text file: {e.reason} at byte {e.start}") from None
    except ValueError as e:
        raise ConfigError(f"{p}: not a config file: {e}") from None
    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError as e:
        # One line, as every CLI error is: where the parser stopped and why.
        mark = getattr(e, "problem_mark", None)
        if isinstance(e, yaml.MarkedYAMLError) and mark is not None:
            where = f"line {mark.line + 1}, column {mark.column + 1}"
            raise ConfigError(f"{p}: not valid YAML at {where}: {e.problem}") from None
        raise ConfigError(f"{p}: not valid YAML: {' '.join(str(e).split())}") from None
    if tree is None:
        return {}
    if not isinstance(tree, Mapping):
        raise ConfigError(f"{p}: expected a mapping of keys to values at the top level")
    return flatten(tree)


class ConfigSchema:
    """The set of keys one component accepts.

    ``passthrough_prefixes`` lists prefixes whose keys are accepted unchecked (for example ``"ssl."``) and
    ``ignore_prefixes`` prefixes that belong to another component sharing the same file.
    """

    def __init__(
        self,
        keys: Iterable[Key],
        *,
        passthrough_prefixes: tuple[str, ...] = (),
        ignore_prefixes: tuple[str, ...] = (),
    ) -> None:
        self.keys = {k.name: k for k in keys}
        self.passthrough_prefixes = passthrough_prefixes
        self.ignore_prefixes = ignore_prefixes

    def parse(self, values: Mapping[str, Any], source: str = "config") -> dict[str, Any]:
        """Check ``values`` (dotted keys) and return every key of the schema with defaults filled in."""
        flat = flatten(values)
        problems: list[str] = []
        result: dict[str, Any] = {}
        for name, raw in flat.items():
            key = self.keys.get(name)
            if key is None:
                if name.startswith(self.passthrough_prefixes):
                    result[name] = raw
                    continue
                if self.ignore_prefixes and name.startswith(self.ignore_prefixes):
                    continue
                hint = difflib.get_close_matches(name, self.keys, n=1)
                suggestion = f" (did you mean {hint[0]!r}?)" if hint else ""
                problems.append(f"unknown key {name!r}{suggestion}")
                continue
            try:
                result[name] = key.convert(raw)
            except ValueError as e:
                problems.append(f"{name}: {e}")
                result[name] = REQUIRED  # reported: not "missing" as well
        for name, key in self.keys.items():
            if name in result:
                continue
            if key.default is REQUIRED:
                problems.append(f"{name}: required but missing")
            else:
                result[name] = key.default
        if problems:
            raise ConfigError(f"{source}: " + "; ".join(problems))
        return result

    def load(self, path: str | Path, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Read ``path`` and parse it, applying ``overrides`` (dotted keys) on top."""
        values = read_yaml(path)
        if overrides:
            values.update(overrides)
        return self.parse(values, source=str(path))


def distinct_ports(config: Mapping[str, Any], names: Iterable[str], source: str = "config") -> None:
    """Raise ConfigError if two of the named port keys are set to the same non-zero port."""
    seen: dict[int, str] = {}
    for name in names:
        port = config.get(name)
        if not port:
            continue
        if port in seen:
            raise ConfigError(f"{source}: {name} and {seen[port]} are both {port}; ports must be distinct")
        seen[port] = name


def parse_partition_ranges(text: str, num_partitions: int | None = None) -> list[int]:
    """Parse ``"0-6,7,10-16"`` into a sorted list of distinct partition ids.

    Raises ConfigError for malformed input, reversed ranges, negatives, or ids >= ``num_partitions``.
    """
    ids: set[int] = set()
    if not text.strip():
        raise ConfigError("empty partition list")
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo_s, hi_s = part.split("-", 1)
                lo, hi = int(lo_s), int(hi_s)
            else:
                lo = hi = int(part)
        except ValueError:
            raise ConfigError(f"bad partition range {part!r}: expected N or N-M") from None
        if lo < 0 or hi < lo:
            raise ConfigError(f"bad partition range {part!r}")
        if num_partitions is not None and hi >= num_partitions:
            raise ConfigError(f"partition {hi} out of range: the cluster has {num_partitions} partitions")
        ids.update(range(lo, hi + 1))
    return sorted(ids)


def host_port(text: str, *, default_port: int | None = None, what: str = "address") -> tuple[str, int]:
    """``(host, port)`` of ``host:port``: the one parser of addresses (configuration, CLI arguments, the
    endpoints servers publish, ZooKeeper connect strings).

    The host is a name, an IPv4 address or an IPv6 address in brackets (``[::1]:9000``; returned without
    them); the port is decimal digits, 1 to 65535. Without a port, ``default_port`` if given. Anything else
    raises ConfigError naming ``what`` and the text.
    """
    raw = text
    text = text.strip()
    if text.startswith("["):
        end = text.find("]")
        host, rest = (text[1:end], text[end + 1 :]) if end > 0 else ("", "")
        if not host:
            raise ConfigError(f"bad {what} {raw!r}: expected [IPv6 address]:port")
        if rest and not rest.startswith(":"):
            raise ConfigError(f"bad {what} {raw!r}: expected ':port' after the bracketed address")
        port_s: str | None = rest[1:] if rest else None
    elif text.count(":") > 1:
        raise ConfigError(f"bad {what} {raw!r}: an IPv6 address needs brackets, as in [::1]:9000")
    else:
        host, sep, port_text = text.partition(":")
        port_s = port_text if sep else None
    if not host:
        raise ConfigError(f"bad {what} {raw!r}: expected host:port")
    if port_s is None:
        if default_port is None:
            raise ConfigError(f"bad {what} {raw!r}: expected host:port (no port given)")
        return host, default_port
    if not (port_s.isascii() and port_s.isdigit()) or not 0 < int(port_s) < 65536:
        raise ConfigError(f"bad {what} {raw!r}: the port must be a number from 1 to 65535")
    return host, int(port_s)
