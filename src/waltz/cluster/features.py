"""The cluster's feature version: which formats and messages every process of a cluster may use.

A rolling upgrade runs two releases side by side, so a process may not write a format (on disk, in
ZooKeeper) or send a message that an older process of the same cluster cannot read, even when its own
release knows it. The decision is the cluster's, kept in one znode, and raised only by an operator
(``waltz cluster raise-features``) once every running process supports the new feature version. Until then a
rollback to the older release is safe; after it, it is not (the newer formats may be in use). A new cluster
starts at the newest feature version of the release that creates it
(:func:`waltz.cluster.store_metadata.create_cluster`), unless told an older one.

ZooKeeper values (UTF-8 JSON, one object each)::

    <root>/features                 persistent; absent = feature version 1 (a cluster made by Waltz 0.1.0)
        {"format": "waltz-features", "version": 1, "featureVersion": N}

    <root>/processes/server-<id>    ephemeral, one per running server (id: its server id)
        {"format": "waltz-process", "version": 1, "kind": "server", "name": "<id>",
         "software": "0.2.0", "features": [lo, hi], "address": "host:port"}

``version`` is the format version of the value itself: a reader refuses a version it does not know, naming
the znode and both versions. Storage nodes report their range on their admin port (admin codec V1,
``NodeVersionRequest``), because every storage node of the cluster is listed in its metadata and is asked
directly; a node that negotiates only admin V0 is Waltz 0.1.0 and supports feature version 1 alone. A server
whose descriptor (``serverDescriptors``) has no process znode beside it is Waltz 0.1.0 likewise.

Feature versions (:data:`FEATURES`):

* 1 -- everything Waltz 0.1.0 reads and writes: wire codecs client V0-V6, storage V0, admin V0; control file
  format 1 (0 read and migrated), segment format 0, backup format 1, ZooKeeper values as in docs/zookeeper.md.
* 2 -- every process is Waltz 0.2.0 or later: it registers its supported range (above) and refuses to start in
  a cluster whose feature version it does not support. A trim point may be pending for a grace
  (``<root>/store/trim`` format 2, :mod:`waltz.cluster.trim_points`) and a retention limit in bytes may be
  set (the servers send storage message 26, :mod:`waltz.cluster.retention`).
* 3 -- (also 0.2.0) servers may send storage message 28 (storage codec V2, ``MultiAppendRequest``: several
  partitions' appends in one frame, :mod:`waltz.protocol.storage_multi`) to nodes that negotiated V2. A
  server follows the feature version (:func:`watch_feature_version`) and starts sending it once raised.

A process checks the feature version when it starts (:func:`check_supported`), so that after a raise an older
0.2.0-or-later process refuses to start rather than join a cluster whose formats it cannot read. Waltz 0.1.0
predates this check: the runbook (docs/upgrade.md) says not to start it after the raise.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from kazoo.client import KazooClient
from kazoo.exceptions import NodeExistsError, NoNodeError

from waltz.cluster.zk import ClusterPaths, zk_errors
from waltz.errors import ConcurrentUpdateError, FeatureVersionError, MetadataError
from waltz.version import __version__

log = logging.getLogger(__name__)

__all__ = [
    "BASE_FEATURE_VERSION",
    "FEATURES",
    "FEATURES_FORMAT_VERSION",
    "PROCESS_FORMAT_VERSION",
    "RELEASE_0_1_0",
    "SUPPORTED_FEATURES",
    "FeatureRange",
    "ProcessInfo",
    "check_supported",
    "decode_features",
    "decode_process",
    "encode_features",
    "encode_process",
    "read_feature_version",
    "read_server_processes",
    "register_process",
    "watch_feature_version",
    "write_feature_version",
]

FEATURES_FORMAT_VERSION: Final = 1
"""Format version of the ``<root>/features`` value."""
PROCESS_FORMAT_VERSION: Final = 1
"""Format version of a ``<root>/processes/*`` value."""
BASE_FEATURE_VERSION: Final = 1
"""The feature version of a cluster without a ``features`` znode (made by, or only ever run by, 0.1.0)."""

FEATURES: Final[Mapping[int, str]] = {
    1: "Waltz 0.1.0: the formats and protocols of the first release",
    2: "Waltz 0.2.0: every process registers its supported feature range and checks the cluster's; "
    "pending trim points (a grace) and retention limits in bytes",
    3: "Waltz 0.2.0: servers send several partitions' appends to a storage node in one request "
    "(storage codec V2)",
}
"""What each feature version allows, for ``waltz cluster features``."""


@dataclass(frozen=True, slots=True)
class FeatureRange:
    """The feature versions one process supports, ``lo`` to ``hi`` inclusive."""

    lo: int
    hi: int

    def __str__(self) -> str:
        return f"{self.lo}-{self.hi}" if self.lo != self.hi else f"{self.lo}"

    def __contains__(self, version: object) -> bool:
        return isinstance(version, int) and self.lo <= version <= self.hi


SUPPORTED_FEATURES: Final = FeatureRange(1, max(FEATURES))
"""The feature versions this release supports."""

RELEASE_0_1_0: Final = FeatureRange(1, 1)
"""What a process that does not say (Waltz 0.1.0) supports."""


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """One running process and the feature versions it supports."""

    kind: str
    name: str
    software: str
    features: FeatureRange
    address: str = ""


def encode_features(feature_version: int) -> bytes:
    value = {
        "format": "waltz-features",
        "version": FEATURES_FORMAT_VERSION,
        "featureVersion": feature_version,
    }
    return json.dumps(value, sort_keys=True).encode()


def _json_object(raw: bytes, path: str, fmt: str, known: int) -> dict[str, Any]:
    """The JSON object of ``raw`` read from ``path``, of format ``fmt`` and a format version we know."""
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise MetadataError(f"{path}: not a JSON value ({e})") from None
    if not isinstance(value, dict) or value.get("format") != fmt:
        raise MetadataError(f"{path}: not a {fmt!r} value")
    version = value.get("version")
    if version != known:
        raise MetadataError(
            f"{path}: format version {version!r} of {fmt!r} is not one this Waltz ({__version__}) reads "
            f"(it reads version {known}); was it written by a newer release?"
        )
    return value


def decode_features(raw: bytes, path: str = "features") -> int:
    """The feature version in a ``features`` value; raises MetadataError naming ``path`` if unreadable."""
    value = _json_object(raw, path, "waltz-features", FEATURES_FORMAT_VERSION)
    fv = value.get("featureVersion")
    if not isinstance(fv, int) or isinstance(fv, bool) or fv < 1:
        raise MetadataError(f"{path}: featureVersion must be an integer >= 1, got {fv!r}")
    return fv


def encode_process(info: ProcessInfo) -> bytes:
    value = {
        "format": "waltz-process",
        "version": PROCESS_FORMAT_VERSION,
        "kind": info.kind,
        "name": info.name,
        "software": info.software,
        "features": [info.features.lo, info.features.hi],
        "address": info.address,
    }
    return json.dumps(value, sort_keys=True).encode()


def decode_process(raw: bytes, path: str = "process") -> ProcessInfo:
    value = _json_object(raw, path, "waltz-process", PROCESS_FORMAT_VERSION)
    fr = value.get("features")
    if not (
        isinstance(fr, list) and len(fr) == 2 and all(type(v) is int for v in fr) and 1 <= fr[0] <= fr[1]
    ):
        raise MetadataError(f"{path}: features must be [lo, hi] with 1 <= lo <= hi, got {fr!r}")
    fields = [value.get(k) for k in ("kind", "name", "software", "address")]
    if not all(isinstance(f, str) for f in fields):
        raise MetadataError(f"{path}: kind, name, software and address must be strings")
    kind, name, software, address = fields
    return ProcessInfo(str(kind), str(name), str(software), FeatureRange(fr[0], fr[1]), str(address))


def read_feature_version(client: KazooClient, root: str) -> tuple[int, int]:
    """``(feature version, znode version)``; ``(1, -1)`` when the znode does not exist (see the module)."""
    path = ClusterPaths(root).features
    with zk_errors("read the cluster's feature version"):
        try:
            raw, stat = client.get(path)
        except NoNodeError:
            return BASE_FEATURE_VERSION, -1
    return decode_features(raw, path), stat.version


def watch_feature_version(client: KazooClient, root: str, on_change: Callable[[int], None]) -> None:
    """Call ``on_change(feature version)`` now and whenever ``<root>/features`` changes, on kazoo's thread
    (hop onto a loop with ``call_soon_threadsafe``). An unreadable value is logged at ERROR and skipped: the
    version known before stays in force (it is never lowered)."""
    path = ClusterPaths(root).features

    def changed(raw: bytes | None, _stat: Any, *_: Any) -> None:
        try:
            on_change(BASE_FEATURE_VERSION if raw is None else decode_features(raw, path))
        except MetadataError as e:
            log.error("unreadable cluster feature version (keeping the one known): %s", e)

    with zk_errors("watch the cluster's feature version"):
        client.DataWatch(path, changed)


def write_feature_version(
    client: KazooClient, root: str, feature_version: int, expected_version: int
) -> None:
    """Set the feature version, version-checked (``expected_version`` -1: the znode must not exist yet)."""
    path = ClusterPaths(root).features
    raw = encode_features(feature_version)
    with zk_errors("write the cluster's feature version"):
        try:
            if expected_version < 0:
                client.create(path, raw)
            else:
                client.set(path, raw, version=expected_version)
        except NodeExistsError:
            raise ConcurrentUpdateError(f"{path}: created concurrently, re-read and retry") from None


def check_supported(
    client: KazooClient, root: str, what: str, supported: FeatureRange = SUPPORTED_FEATURES
) -> int:
    """The cluster's feature version; FeatureVersionError if ``what`` (this process) does not support it."""
    fv, _ = read_feature_version(client, root)
    if fv not in supported:
        raise FeatureVersionError(
            f"{what}: the cluster's feature version is {fv} ({ClusterPaths(root).features}), but Waltz "
            f"{__version__} supports feature versions {supported}: run a release that supports {fv}"
        )
    return fv


def register_process(client: KazooClient, root: str, info: ProcessInfo) -> str:
    """Create (or replace) this process's ephemeral znode; returns its path."""
    path = ClusterPaths(root).process(info.kind, info.name)
    raw = encode_process(info)
    with zk_errors(f"register {info.kind} {info.name}'s feature range"):
        with contextlib.suppress(NoNodeError):
            client.delete(path)
        client.create(path, raw, ephemeral=True, makepath=True)
    return path


def read_server_processes(client: KazooClient, root: str) -> dict[str, ProcessInfo]:
    """Every registered server process by its name (the server id as text)."""
    paths = ClusterPaths(root)
    out: dict[str, ProcessInfo] = {}
    with zk_errors("read process registrations"):
        try:
            children = client.get_children(paths.processes)
        except NoNodeError:
            return out
        for child in children:
            if not child.startswith("server-"):
                continue
            try:
                raw, _ = client.get(f"{paths.processes}/{child}")
            except NoNodeError:
                continue  # it ended meanwhile
            info = decode_process(raw, f"{paths.processes}/{child}")
            out[info.name] = info
    return out
