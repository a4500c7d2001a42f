"""``waltz backup`` and ``waltz restore``: thin layers over :mod:`waltz.ops.backup` and
:mod:`waltz.ops.restore`.

``waltz backup -c FILE DIR [--since PREVIOUS_DIR]`` copies every partition up to a cut into a new directory;
``waltz backup --verify DIR...`` checks backups against their manifests (and, with ``-c``, that they are of
that cluster); ``waltz restore -c FILE DIR [DIR...] [--to-transaction ID | P=ID,...]`` writes a full backup
and the incremental ones after it into a new, empty cluster. See docs/operations.md ("Back up", "Restore to a
new cluster").
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from waltz.cli.common import CLI_CONFIG_SCHEMA, add_cli_config_arg, load_cli_config, load_cli_tls
from waltz.cli.perf import run_on_fast_loop
from waltz.client.config import ClientConfig
from waltz.cluster import store_metadata as sm
from waltz.cluster.zk import session
from waltz.config import read_yaml
from waltz.errors import BackupError, ConfigError
from waltz.ops.backup import DEFAULT_CONCURRENCY, backup
from waltz.ops.backup_format import MANIFEST_NAME, check_chain, verify_backup
from waltz.ops.progress import CopyProgress
from waltz.ops.restore import plan_restore, restore
from waltz.ops.view import read_view

PROGRESS_INTERVAL_S = 1.0
"""A progress line at most this often (every ten times this when stderr is not a terminal)."""


def register(groups: Any) -> None:
    b = groups.add_parser(
        "backup",
        help="copy every partition up to a cut into a directory, while appends go on",
        description="Back up the cluster (online, consistent), or verify backups (--verify).",
    )
    b.add_argument("directory", nargs="+", type=Path, metavar="DIR", help="a new or empty directory")
    b.add_argument("-c", "--cli-config-path", metavar="FILE", help="YAML with zookeeper.* and cluster.root")
    b.add_argument("--since", type=Path, metavar="DIR", help="incremental: the previous backup's directory")
    b.add_argument("--verify", action="store_true", help="check the backups in DIR... (oldest first) instead")
    b.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY, help="partitions copied at once")
    b.add_argument("--request-timeout-ms", type=int, default=30_000, help="per read, retries included")
    b.set_defaults(handler=cmd_backup)

    r = groups.add_parser(
        "restore",
        help="restore backups into a new, empty cluster (ids and request ids kept)",
        description="Restore a full backup and the incremental ones after it (oldest first).",
    )
    r.add_argument("directory", nargs="+", type=Path, metavar="DIR")
    add_cli_config_arg(r)
    r.add_argument(
        "--to-transaction",
        metavar="ID|P=ID,...",
        help="point in time: restore each partition up to this id (one id for all, or per partition)",
    )
    r.set_defaults(handler=cmd_restore)


def _progress(what: str) -> Callable[[Any], None]:
    tty = sys.stderr.isatty()
    interval = PROGRESS_INTERVAL_S if tty else PROGRESS_INTERVAL_S * 10
    last = [time.monotonic()]

    def show(p: CopyProgress) -> None:
        done = p.done
        now = time.monotonic()
        if now - last[0] < interval and done < p.total:
            return
        last[0] = now
        pct = 100.0 * done / p.total if p.total else 100.0
        line = f"{what}: {done:,} of {p.total:,} records ({pct:.0f}%), {p.records_per_s:,.0f} records/s"
        print(("\r" + line) if tty else line, end="" if tty else "\n", file=sys.stderr, flush=True)

    return show


def _quiet(args: argparse.Namespace) -> None:
    if not getattr(args, "verbose", False):
        logging.getLogger("kazoo").setLevel(logging.ERROR)


def cmd_backup(args: argparse.Namespace) -> int:
    _quiet(args)
    if args.verify:
        return _verify(args)
    if len(args.directory) != 1:
        raise ConfigError("give one directory to back up into")
    if args.cli_config_path is None:
        raise ConfigError("-c/--cli-config-path is required to back up")
    config = reader_config(args.cli_config_path, args.request_timeout_ms)
    result = run_on_fast_loop(
        backup(
            config,
            args.directory[0],
            since=args.since,
            concurrency=args.concurrency,
            progress=_progress("backup"),
        )
    )
    if sys.stderr.isatty():
        print(file=sys.stderr)
    m = result.manifest
    kind = "incremental" if m.parent is not None else "full"
    print(
        f"{kind} backup {m.backup_id} of {m.cluster_name} (key {m.cluster_key}) in {result.directory}: "
        f"{result.records:,} records, {result.bytes:,} bytes in {result.elapsed_s:.1f} s "
        f"({result.records_per_s:,.0f} records/s)"
    )
    for e in m.partitions:
        print(f"  partition {e.partition}: {e.first}..{e.last} ({e.records:,} records)")
    return 0


def reader_config(path: str, request_timeout_ms: int) -> ClientConfig:
    """The reader's settings from a ``-c`` file: a CLI configuration (its ``ssl.*`` keys are the client's TLS
    settings; ``zookeeper.connectTimeout`` is not the reader's) or a client YAML."""
    values = read_yaml(path)
    if not any(k.startswith("client.") for k in values):
        CLI_CONFIG_SCHEMA.parse(values, path)
        values = {
            ("client." + k if k.startswith("ssl.") else k): v
            for k, v in values.items()
            if k != "zookeeper.connectTimeout"
        }
        values.setdefault("zookeeper.sessionTimeout", 30_000)
    return ClientConfig.from_dict({**values, "client.requestTimeout": request_timeout_ms}, path)


def _verify(args: argparse.Namespace) -> int:
    dirs: list[Path] = args.directory
    manifests = [verify_backup(d) for d in dirs]
    if len(dirs) > 1:
        check_chain(dirs, manifests)
    if args.cli_config_path is not None:
        config = load_cli_config(args.cli_config_path)
        with session(config, str(args.cli_config_path)) as client:
            key = sm.read_store_params(client, str(config["cluster.root"])).cluster_key
        for d, m in zip(dirs, manifests, strict=True):
            if m.cluster_key != key:
                raise BackupError(
                    f"{d / MANIFEST_NAME} is a backup of another cluster (key {m.cluster_key}; the "
                    f"cluster at {config['cluster.root']} has {key})"
                )
    for d, m in zip(dirs, manifests, strict=True):
        records = sum(e.records for e in m.partitions)
        print(f"OK: {d}: backup {m.backup_id} of {m.cluster_name} (key {m.cluster_key}), {records:,} records")
    return 0


def parse_to_transaction(text: str | None, num_partitions: int) -> dict[int, int] | None:
    """``ID`` (every partition) or ``P=ID,P=ID`` into a per-partition limit."""
    if text is None:
        return None
    try:
        if "=" not in text:
            return dict.fromkeys(range(num_partitions), int(text))
        out: dict[int, int] = {}
        for part in text.split(","):
            p, _, tid = part.partition("=")
            out[int(p)] = int(tid)
        return out
    except ValueError:
        raise ConfigError(f"--to-transaction: expected ID or P=ID,P=ID..., got {text!r}") from None


def cmd_restore(args: argparse.Namespace) -> int:
    _quiet(args)
    dirs: list[Path] = args.directory
    config = load_cli_config(args.cli_config_path)
    tls = load_cli_tls(args.cli_config_path)
    first = verify_backup(dirs[-1], deep=False)
    plan = plan_restore(dirs, parse_to_transaction(args.to_transaction, first.num_partitions))
    with session(config, str(args.cli_config_path)) as client:
        view = read_view(client, str(config["cluster.root"]), tls.client_context("CLI config"))
        result = asyncio.run(restore(client, view, plan, progress=_progress("restore")))
        key = view.info.store.cluster_key
    if sys.stderr.isatty():
        print(file=sys.stderr)
    kept = (
        "kept"
        if key == plan.manifests[0].cluster_key
        else f"new: the backup's was {plan.manifests[0].cluster_key}"
    )
    print(
        f"restored {result.records:,} records into {config['cluster.root']} in {result.elapsed_s:.1f} s "
        f"({result.records_per_s:,.0f} records/s), verified; cluster key {key} ({kept})"
    )
    for p, hwm in enumerate(result.high_water_marks):
        print(f"  partition {p}: high-water mark {hwm}")
    return 0
