"""Options of the ``waltz`` Spark data source: parsing and validation, with no Spark and no I/O.

Spark hands a data source its options as a case-insensitive mapping of strings (and lower-cases the keys when
the mapping is copied, pitfall P4), so every name here is matched case-insensitively and reported in its
documented spelling. Names follow Spark's Kafka source where one exists.

=============================  =========  ==============  ==================================================
option                         applies    default         meaning
=============================  =========  ==============  ==================================================
``waltz.<client key>``         all        -               a client setting with the prefix removed, e.g.
                                                          ``waltz.zookeeper.connectString``,
                                                          ``waltz.cluster.root`` (both required),
                                                          ``waltz.zookeeper.sessionTimeout`` (30000),
                                                          ``waltz.client.requestTimeout``
``partitions``                 all        every one       comma list of partition ids, e.g. ``0,2,5``
``startingOffsets``            read       ``earliest``    ``earliest`` | ``latest`` (streams only) | JSON
                                          (batch),        ``{"0": 1200, "3": -2}``: the first transaction id
                                          ``latest``      to read per partition (-2 earliest, -1 latest);
                                          (stream)        partitions left out start at the earliest
``endingOffsets``              batch      ``latest``      ``latest`` (the committed high-water mark when the
                                                          query is planned) | JSON ``{"0": 5000}``, exclusive
                                                          (-1 latest); partitions left out read to latest
``minPartitions``              read       -               split ranges until there are about this many tasks
``maxRecordsPerPartition``     read       -               no task reads more transactions than this
``maxOffsetsPerTrigger``       stream     -               transactions per micro-batch, shared by backlog
                                                          (alias ``maxTransactionsPerTrigger``)
``includeData``                read       ``true``        ``false`` drops the ``data`` column
``failOnDataLoss``             read       ``true``        fail when an offset is past the committed
                                                          high-water mark (restored log, other cluster)
                                                          or a read starts below the trim point;
                                                          ``false`` logs a warning and clamps (starts at
                                                          the trim point)
``fetchSize``                  read       ``10000``       transactions per range request (1..10000)
``fetchDepth``                 read       ``3``           range requests in flight per task (1..16)
``minOffsetsPerTrigger``       stream     -               wait for at least this many new transactions
                                                          before a micro-batch, up to ``maxTriggerDelay``
``maxTriggerDelay``            stream     ``15m``         longest wait for ``minOffsetsPerTrigger``
``fetchOffset.numRetries``     read       ``3``           retries of a failed range or high-water-mark read
``fetchOffset.retryIntervalMs`` read      ``10``          pause between those retries (Kafka's default)
``partition``                  write      ``0``           target partition of rows without a ``partition``
``exactlyOnce``                stream     ``false``       micro-batch sink: append each batch exactly once,
                                          write           keyed by (``queryId``, batch id); see docs/spark.md
``queryId``                    stream     -               required with ``exactlyOnce``: a stable name of the
                                          write           streaming query (kept across restarts)
=============================  =========  ==============  ==================================================

Errors are :class:`~waltz.errors.ConfigError` naming every problem at once. Validation happens in two steps:
:func:`parse_options` when the data source is built (unknown names, malformed values, contradictions that
need no context) and :meth:`SourceOptions.for_batch_read` / ``for_stream_read`` / ``for_write`` when Spark
asks for a reader or writer (options that do not apply to that use).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from waltz.client.config import CLIENT_SCHEMA, ClientConfig
from waltz.errors import ConfigError

__all__ = [
    "EARLIEST",
    "LATEST",
    "MAX_FETCH_SIZE",
    "OffsetSpec",
    "SourceOptions",
    "parse_options",
]

EARLIEST = -2
"""In a JSON offset spec: the first transaction of the partition (id 0)."""
LATEST = -1
"""In a JSON offset spec: one past the partition's committed high-water mark."""
MAX_FETCH_SIZE = 10_000
MAX_FETCH_DEPTH = 16
"""The server answers a range request with at most this many transactions."""
DEFAULT_SESSION_TIMEOUT_MS = 30_000
DEFAULT_MAX_TRIGGER_DELAY_MS = 15 * 60 * 1000
"""Kafka's ``maxTriggerDelay`` default (15 minutes)."""

CLIENT_PREFIX = "waltz."

OffsetSpec = Literal["earliest", "latest"] | dict[int, int]
"""``earliest``, ``latest``, or an explicit per-partition map (values may be EARLIEST / LATEST)."""

_READ = "read"
_STREAM = "stream"
_BATCH = "batch"
_WRITE = "write"
_STREAM_WRITE = "stream write"

# Documented spelling -> where it applies. Matching is case-insensitive.
_OPTIONS: dict[str, tuple[str, ...]] = {
    "partitions": (_READ, _WRITE),
    "startingOffsets": (_READ,),
    "endingOffsets": (_BATCH,),
    "minPartitions": (_READ,),
    "maxRecordsPerPartition": (_READ,),
    "maxOffsetsPerTrigger": (_STREAM,),
    "maxTransactionsPerTrigger": (_STREAM,),
    "minOffsetsPerTrigger": (_STREAM,),
    "maxTriggerDelay": (_STREAM,),
    "includeData": (_READ,),
    "failOnDataLoss": (_READ,),
    "fetchSize": (_READ,),
    "fetchDepth": (_READ,),
    "fetchOffset.numRetries": (_READ,),
    "fetchOffset.retryIntervalMs": (_READ,),
    "partition": (_WRITE,),
    "exactlyOnce": (_STREAM_WRITE,),
    "queryId": (_STREAM_WRITE,),
    # Spark itself passes these to a data source (DataStreamWriter.option("checkpointLocation"),
    # .queryName(), load(path), ...): they are Spark's, so they are accepted everywhere and never reach an
    # "unknown option" error. checkpointLocation also identifies the exactly-once sink's checkpoint.
    "path": (),
    "checkpointLocation": (),
    "queryName": (),
    "asyncProgressTrackingEnabled": (),
    "asyncProgressTrackingCheckpointIntervalMs": (),
}
_BY_LOWER = {name.lower(): name for name in _OPTIONS}
_CLIENT_KEYS = {name.lower(): name for name in CLIENT_SCHEMA.keys}
_IGNORED = frozenset(name for name, uses in _OPTIONS.items() if not uses)
"""Spark's own options: accepted for every use."""


@dataclass(frozen=True)
class SourceOptions:
    """Every option, parsed. Immutable and picklable (readers are pickled to Spark's Python workers)."""

    client: Mapping[str, Any]
    """Client settings (dotted keys as :class:`~waltz.client.config.ClientConfig` spells them)."""
    given: frozenset[str]
    """The documented names of the non-client options the user set (to reject those that do not apply)."""
    partitions: tuple[int, ...] | None = None
    starting_offsets: OffsetSpec | None = None
    ending_offsets: OffsetSpec = "latest"
    min_partitions: int | None = None
    max_records_per_partition: int | None = None
    max_offsets_per_trigger: int | None = None
    include_data: bool = True
    fail_on_data_loss: bool = True
    fetch_size: int = MAX_FETCH_SIZE
    fetch_depth: int = 3
    fetch_num_retries: int = 3
    fetch_retry_interval_ms: int = 10
    min_offsets_per_trigger: int | None = None
    max_trigger_delay_ms: int = DEFAULT_MAX_TRIGGER_DELAY_MS
    checkpoint_location: str | None = None
    """Spark's ``checkpointLocation`` writer option, when given (the exactly-once sink keys on it)."""
    default_partition: int = 0
    exactly_once: bool = False
    query_id: str | None = None
    client_config: ClientConfig = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        config = ClientConfig.from_dict(dict(self.client), source="waltz data source options (waltz.*)")
        object.__setattr__(self, "client_config", config)

    @property
    def cluster_key(self) -> tuple[tuple[str, str], ...]:
        """A hashable identity of the cluster settings (for per-process connection caches)."""
        return tuple(sorted((k, str(v)) for k, v in self.client.items()))

    def starting(self, streaming: bool) -> OffsetSpec:
        if self.starting_offsets is not None:
            return self.starting_offsets
        return "latest" if streaming else "earliest"

    # -- per-use checks ------------------------------------------------------------------------------------

    def _reject(self, use: str, allowed: tuple[str, ...]) -> None:
        wrong = sorted(n for n in self.given if n not in _IGNORED and not set(_OPTIONS[n]) & set(allowed))
        if wrong:
            listed = ", ".join(f"{n} ({' / '.join(_OPTIONS[n])} only)" for n in wrong)
            raise ConfigError(f"waltz data source: option(s) not valid for a {use}: {listed}")

    def for_batch_read(self) -> SourceOptions:
        """Check the options make sense for ``spark.read``; returns self."""
        self._reject("batch read", (_READ, _BATCH))
        if self.starting_offsets == "latest":
            raise ConfigError(
                "waltz data source: startingOffsets=latest is not valid for a batch read "
                "(it would always read nothing); use earliest or a JSON map"
            )
        if self.ending_offsets == "earliest":
            raise ConfigError("waltz data source: endingOffsets=earliest is not valid (use latest or JSON)")
        if isinstance(self.ending_offsets, dict) and EARLIEST in self.ending_offsets.values():
            raise ConfigError("waltz data source: endingOffsets may not use -2 (earliest)")
        if isinstance(self.starting_offsets, dict) and LATEST in self.starting_offsets.values():
            raise ConfigError("waltz data source: startingOffsets may not use -1 (latest) in a batch read")
        if isinstance(self.starting_offsets, dict) and isinstance(self.ending_offsets, dict):
            for p, start in self.starting_offsets.items():
                end = self.ending_offsets.get(p, LATEST)
                if start >= 0 and end >= 0 and start > end:
                    raise ConfigError(
                        f"waltz data source: partition {p}: startingOffsets {start} "
                        f"is after endingOffsets {end}"
                    )
        return self

    def for_stream_read(self) -> SourceOptions:
        """Check the options make sense for ``spark.readStream``; returns self."""
        self._reject("streaming read", (_READ, _STREAM))
        return self

    def for_write(self, streaming: bool) -> SourceOptions:
        """Check the options make sense for a (streaming) write; returns self."""
        if streaming:
            self._reject("streaming write", (_WRITE, _STREAM_WRITE))
        else:
            self._reject("batch write", (_WRITE,))
        if self.exactly_once and not self.query_id:
            raise ConfigError(
                "waltz data source: exactlyOnce=true needs queryId, a name of the streaming query that "
                "stays the same across restarts (it keys the batches already written)"
            )
        if self.exactly_once and not self.checkpoint_location:
            raise ConfigError(
                "waltz data source: exactlyOnce=true needs the writer's checkpointLocation option "
                "(.option('checkpointLocation', ...)): the batches already written are keyed by the "
                "checkpoint as well as by queryId, so a new checkpoint never skips its batches"
            )
        return self


def _canonical(raw_key: str) -> str:
    return _BY_LOWER.get(raw_key.lower(), raw_key)


def _int(name: str, raw: str, problems: list[str], *, low: int, high: int | None = None) -> int | None:
    try:
        value = int(raw.strip())
    except ValueError:
        problems.append(f"{name}: expected an integer, got {raw!r}")
        return None
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        problems.append(f"{name}: must be {bound}, got {value}")
        return None
    return value


_DURATION_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "min": 60_000, "h": 3_600_000, "d": 86_400_000}


def _duration_ms(name: str, raw: str, problems: list[str]) -> int | None:
    """``15m``, ``30 s``, ``500ms``, ``1h`` (Spark's time strings); a bare number is milliseconds."""
    text = raw.strip().lower().replace(" ", "")
    digits = len(text) - len(text.lstrip("0123456789"))
    number, unit = text[:digits], text[digits:] or "ms"
    if not number or unit not in _DURATION_UNITS_MS:
        problems.append(f"{name}: expected a duration such as 15m, 30s or 500ms, got {raw!r}")
        return None
    return int(number) * _DURATION_UNITS_MS[unit]


def _bool(name: str, raw: str, problems: list[str]) -> bool | None:
    text = raw.strip().lower()
    if text in ("true", "false"):
        return text == "true"
    problems.append(f"{name}: expected true or false, got {raw!r}")
    return None


def _partition_list(name: str, raw: str, problems: list[str]) -> tuple[int, ...] | None:
    ids: set[int] = set()
    for part in raw.split(","):
        value = _int(name, part, problems, low=0, high=2**31 - 1)
        if value is None:
            return None
        ids.add(value)
    return tuple(sorted(ids))


def parse_offset_spec(name: str, raw: str, problems: list[str]) -> OffsetSpec | None:
    """``earliest`` | ``latest`` | a JSON object of partition id -> transaction id (or -2 / -1)."""
    text = raw.strip()
    if text.lower() in ("earliest", "latest"):
        return "earliest" if text.lower() == "earliest" else "latest"
    try:
        parsed = json.loads(text)
    except ValueError:
        problems.append(f'{name}: expected earliest, latest or JSON like {{"0": 100}}, got {raw!r}')
        return None
    if not isinstance(parsed, dict) or not parsed:
        problems.append(f'{name}: the JSON must be a non-empty object like {{"0": 100}}, got {raw!r}')
        return None
    out: dict[int, int] = {}
    for key, value in parsed.items():
        try:
            partition = int(key)
        except ValueError:
            partition = -1
        if partition < 0 or str(partition) != key.strip():
            problems.append(f"{name}: {key!r} is not a partition id")
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < EARLIEST:
            problems.append(
                f"{name}: partition {partition}: expected a transaction id, -2 (earliest) or -1 (latest), "
                f"got {value!r}"
            )
            return None
        out[partition] = value
    return dict(sorted(out.items()))


def parse_options(options: Mapping[str, str]) -> SourceOptions:
    """Parse Spark's option map; raise one ConfigError listing every problem (see the module docstring)."""
    problems: list[str] = []
    client, plain = _split_options(options, problems)
    kwargs = _typed_options(plain, problems)
    _check_together(kwargs, problems)
    if problems:
        raise ConfigError("waltz data source: " + "; ".join(problems))
    try:
        return SourceOptions(client=client, given=frozenset(plain), **kwargs)
    except ConfigError as e:
        raise ConfigError(f"waltz data source: {e}") from None


def _split_options(options: Mapping[str, str], problems: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """The client's ``waltz.*`` settings by canonical key (with the required ones checked and defaults set)
    and the source's own options by canonical name; each unknown or repeated key is added to ``problems``."""
    client: dict[str, Any] = {}
    plain: dict[str, str] = {}
    for raw_key, raw_value in options.items():
        key = str(raw_key)
        value = "" if raw_value is None else str(raw_value)
        if key.lower().startswith(CLIENT_PREFIX):
            suffix = key[len(CLIENT_PREFIX) :]
            canonical = _CLIENT_KEYS.get(suffix.lower())
            if canonical is None and suffix.lower().startswith(CLIENT_SCHEMA.passthrough_prefixes):
                canonical = suffix.lower()
            if canonical is None:
                hint = difflib.get_close_matches(suffix, list(CLIENT_SCHEMA.keys), n=1)
                did = f" (did you mean waltz.{hint[0]}?)" if hint else ""
                problems.append(f"unknown client option {key!r}{did}")
                continue
            client[canonical] = value
            continue
        name = _canonical(key)
        if name not in _OPTIONS:
            hint = difflib.get_close_matches(key, list(_OPTIONS), n=1)
            did = f" (did you mean {hint[0]}?)" if hint else ""
            problems.append(f"unknown option {key!r}{did}")
            continue
        if name in plain:
            problems.append(f"option {name} given twice")
            continue
        plain[name] = value
    problems += [
        f"waltz.{required} is required"
        for required in ("zookeeper.connectString", "cluster.root")
        if required not in client
    ]
    client.setdefault("zookeeper.sessionTimeout", str(DEFAULT_SESSION_TIMEOUT_MS))
    return client, plain


def _typed_options(plain: dict[str, str], problems: list[str]) -> dict[str, Any]:
    """The source's options as :class:`SourceOptions` keyword arguments, each parsed and range-checked (a
    bad value is added to ``problems``)."""
    kwargs: dict[str, Any] = {}
    if "maxOffsetsPerTrigger" in plain and "maxTransactionsPerTrigger" in plain:
        problems.append("give maxOffsetsPerTrigger or its alias maxTransactionsPerTrigger, not both")
    for name, raw in plain.items():
        match name:
            case "partitions":
                kwargs["partitions"] = _partition_list(name, raw, problems)
            case "startingOffsets":
                kwargs["starting_offsets"] = parse_offset_spec(name, raw, problems)
            case "endingOffsets":
                spec = parse_offset_spec(name, raw, problems)
                if spec is not None:
                    kwargs["ending_offsets"] = spec
            case "minPartitions":
                kwargs["min_partitions"] = _int(name, raw, problems, low=1)
            case "maxRecordsPerPartition":
                kwargs["max_records_per_partition"] = _int(name, raw, problems, low=1)
            case "maxOffsetsPerTrigger" | "maxTransactionsPerTrigger":
                kwargs["max_offsets_per_trigger"] = _int(name, raw, problems, low=1)
            case "includeData":
                kwargs["include_data"] = _bool(name, raw, problems)
            case "failOnDataLoss":
                kwargs["fail_on_data_loss"] = _bool(name, raw, problems)
            case "fetchSize":
                kwargs["fetch_size"] = _int(name, raw, problems, low=1, high=MAX_FETCH_SIZE)
            case "fetchDepth":
                kwargs["fetch_depth"] = _int(name, raw, problems, low=1, high=MAX_FETCH_DEPTH)
            case "fetchOffset.numRetries":
                kwargs["fetch_num_retries"] = _int(name, raw, problems, low=0, high=100)
            case "minOffsetsPerTrigger":
                kwargs["min_offsets_per_trigger"] = _int(name, raw, problems, low=1)
            case "maxTriggerDelay":
                kwargs["max_trigger_delay_ms"] = _duration_ms(name, raw, problems)
            case "checkpointLocation":
                kwargs["checkpoint_location"] = raw.strip() or None
            case "fetchOffset.retryIntervalMs":
                kwargs["fetch_retry_interval_ms"] = _int(name, raw, problems, low=0, high=600_000)
            case "partition":
                kwargs["default_partition"] = _int(name, raw, problems, low=0, high=2**31 - 1)
            case "exactlyOnce":
                kwargs["exactly_once"] = _bool(name, raw, problems)
            case "queryId":
                if not raw.strip():
                    problems.append("queryId: must not be empty")
                kwargs["query_id"] = raw.strip()
            case _:
                pass  # ignored names (Spark's own ``path``)
    return kwargs


def _check_together(kwargs: dict[str, Any], problems: list[str]) -> None:
    """Add to ``problems`` what the options contradict in each other."""
    low, high = kwargs.get("min_offsets_per_trigger"), kwargs.get("max_offsets_per_trigger")
    if low is not None and high is not None and low > high:
        problems.append(f"minOffsetsPerTrigger ({low}) is above maxOffsetsPerTrigger ({high})")
    partitions = kwargs.get("partitions")
    for spec_name, attr in (("startingOffsets", "starting_offsets"), ("endingOffsets", "ending_offsets")):
        spec = kwargs.get(attr)
        if partitions and isinstance(spec, dict):
            extra = sorted(set(spec) - set(partitions))
            if extra:
                problems.append(
                    f"{spec_name} names partitions {extra} that the partitions option ({partitions}) excludes"
                )
