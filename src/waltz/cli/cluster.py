"""``waltz cluster ...``: create, inspect and edit a cluster's metadata in ZooKeeper (REFERENCE §7.1).

Every command reads ``-c/--cli-config-path`` (``zookeeper.connectString``, ``zookeeper.sessionTimeout``,
``zookeeper.connectTimeout``, ``cluster.root``) and is a thin layer over :mod:`waltz.cluster.store_metadata`.
Failures (bad arguments, unreachable ZooKeeper, no cluster, refused edit) are Waltz errors, which
``waltz.cli.main`` prints as one line with a non-zero exit status.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import uuid
from collections.abc import Callable
from typing import Any, TextIO

from kazoo.client import KazooClient

from waltz.cli.common import add_cli_config_arg, load_cli_config, load_cli_tls
from waltz.cluster import retention
from waltz.cluster import store_metadata as sm
from waltz.cluster.partition_metadata import UNRESOLVED
from waltz.cluster.trim_points import read_trim_points, wall_clock_ms
from waltz.cluster.zk import session
from waltz.config import host_port, parse_partition_ranges
from waltz.errors import ConfigError
from waltz.ops import accept_loss, checks, features, generation, rebuild, trim
from waltz.ops.view import ClusterView, read_view

Command = Callable[[KazooClient, str, argparse.Namespace, TextIO], int | None]
_AddCommand = Callable[[str, Command, str], argparse.ArgumentParser]
"""``command(name, handler, help)``: adds a subcommand and returns its parser, for the options."""


def _run(command: Command) -> Callable[[argparse.Namespace], int]:
    def handler(args: argparse.Namespace) -> int:
        if not getattr(args, "verbose", False):
            # kazoo logs each failed connection attempt as a warning; the CLI reports the outcome in one line.
            logging.getLogger("kazoo").setLevel(logging.ERROR)
            # Nor does the CLI's own ZooKeeper session need a line: a command logging at INFO (fix-generation)
            # logs the one change it made.
            logging.getLogger("waltz.cluster.zk").setLevel(logging.WARNING)
        config = load_cli_config(args.cli_config_path)
        with session(config, str(args.cli_config_path)) as client:
            return int(command(client, str(config["cluster.root"]), args, sys.stdout) or 0)

    return handler


def _storage(text: str) -> str:
    # argparse turns ArgumentTypeError into a usage error (exit 2); a ConfigError would escape it.
    try:
        host, port = host_port(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return f"{host}:{port}"


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def _uuid(text: str) -> uuid.UUID:
    try:
        return uuid.UUID(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a UUID: {text!r}") from None


def _positive(text: str) -> int:
    value = _non_negative(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


# -------------------------------------------------------------------------------------------------- commands


def cmd_create(client: KazooClient, root: str, args: argparse.Namespace, out: TextIO) -> int:
    store = sm.create_cluster(
        client,
        root,
        args.name,
        args.partitions,
        cluster_key=args.cluster_key,
        feature_version=args.feature_version,
    )
    print(
        f"created cluster {args.name!r} at {root}: {args.partitions} partitions, key {store.cluster_key}",
        file=out,
    )
    return 0


def cmd_delete(client: KazooClient, root: str, args: argparse.Namespace, out: TextIO) -> int:
    if not args.force and not args.name:
        raise ConfigError("--name is required unless --force is given")
    sm.delete_cluster(client, root, args.name, force=args.force)
    print(f"deleted cluster at {root}", file=out)
    return 0


def cmd_show_cluster_key(client: KazooClient, root: str, args: argparse.Namespace, out: TextIO) -> int:
    sm.read_cluster_params(client, root)
    print(sm.read_store_params(client, root).cluster_key, file=out)
    return 0


def cmd_list(client: KazooClient, root: str, args: argparse.Namespace, out: TextIO) -> int:
    info = sm.describe_cluster(client, root)
    w = out.write
    w(f"cluster root: {root}\n")
    w(f"cluster name: {info.params.name}\n")
    w(f"number of partitions: {info.params.num_partitions}\n")
    w(f"cluster key: {info.store.cluster_key}\n")
    w("servers:\n")
    live = {d.server_id: d for d in info.servers.values()}
    consistent = "" if info.assignment.cversion >= 0 else " (none computed yet)"
    w(f"  assignment cversion {info.assignment.cversion}{consistent}\n")
    for sid in sorted(set(live) | set(info.assignment.servers)):
        d = live.get(sid)
        where = d.endpoint if d else "(not live)"
        parts = info.assignment.servers.get(sid, {})
        shown = ", ".join(f"{p}@gen{g}" for p, g in sorted(parts.items())) or "-"
        prefs = (
            f" preferred [{sm.format_ranges(d.preferred_partitions)}]" if d and d.preferred_partitions else ""
        )
        w(f"  server {sid} {where}{prefs}: {shown}\n")
    w("storage nodes:\n")
    if not info.groups.groups:
        w("  (none)\n")
    for storage in sorted(set(info.groups.groups) | set(info.replicas.replicas)):
        group = info.groups.groups.get(storage, "?")
        admin = info.connections.admin_ports.get(storage, "?")
        held = sm.format_ranges(info.replicas.replicas.get(storage, [])) or "-"
        w(f"  {storage} group {group} admin port {admin}: partitions {held}\n")
    w("partition metadata:\n")
    for p, md in sorted(info.partitions.items()):
        replicas = ", ".join(
            f"{r.storage} session {r.session_id} closingHWM "
            f"{'UNRESOLVED' if r.closing_high_water_mark == UNRESOLVED else r.closing_high_water_mark}"
            for r in md.replicas.values()
        )
        w(
            f"  partition {p}: generation {md.generation} session {md.session_id}"
            + (f" [{replicas}]" if replicas else "")
            + "\n"
        )
    return 0


def cmd_add_storage_node(client: KazooClient, root: str, args: argparse.Namespace, out: TextIO) -> int:
    sm.add_storage_node(client, root, args.storage, args.group, args.admin_port)
    print(f"added storage node {args.storage} (group {args.group}, admin port {args.admin_port})", file=out)
    return 0


def cmd_remove_storage_node(client: KazooClient, root: str, args: argparse.Namespace, out: TextIO) -> int:
    sm.remove_storage_node(client, root, args.storage)
    print(f"removed storage node {args.storage}", file=out)
    return 0


def _partitions(client: KazooClient, root: str, text: str) -> list[int]:
    return parse_partition_ranges(text, sm.read_cluster_params(client, root).num_partitions)


def cmd_assign_partition(client: KazooClient, root: str, args: argparse.Namespace, out: TextIO) -> int:
    parts = _partitions(client, root, args.partition)
    sm.assign_partitions(client, root, args.storage, parts)
    print(f"assigned partitions {sm.format_ranges(parts)} to {args.storage}", file=out)
    return 0


def cmd_unassign_partition(client: KazooClient, root: str, args: argparse.Namespace, out: TextIO) -> int:
    parts = _partitions(client, root, args.partition)
    sm.unassign_partitions(client, root, args.storage, parts)
    print(f"unassigned partitions {sm.format_ranges(parts)} from {args.storage}", file=out)
    return 0


def cmd_auto_assign(client: KazooClient, root: str, args: argparse.Namespace, out: TextIO) -> int:
    result = sm.auto_assign(client, root, args.group)
    for storage, parts in sorted(result.items()):
        print(f"{storage}: {sm.format_ranges(parts) or '-'}", file=out)
    return 0


def _ops_view(client: KazooClient, root: str, args: argparse.Namespace) -> ClusterView:
    ssl = load_cli_tls(args.cli_config_path).client_context(args.cli_config_path)
    return read_view(client, root, ssl)


def cmd_check_connectivity(client: KazooClient, root: str, args: argparse.Namespace, out: TextIO) -> int:
    view = _ops_view(client, root, args)
    views = asyncio.run(checks.check_connectivity(view, args.timeout))
    bad = 0
    if not views:
        print("no live servers", file=out)
        return 1
    for sv in views:
        if sv.report is None:
            bad += 1
            print(f"server {sv.server_id} ({sv.address}): UNREACHABLE: {sv.error}", file=out)
            continue
        print(f"server {sv.server_id} ({sv.address}):", file=out)
        for storage, ok in sorted(sv.report.storage_connectivity.items()):
            bad += not ok
            print(f"  {storage}: {'reachable' if ok else 'UNREACHABLE'}", file=out)
    return 1 if bad else 0


def cmd_verify(client: KazooClient, root: str, args: argparse.Namespace, out: TextIO) -> int:
    view = _ops_view(client, root, args)
    parts = None if args.partition is None else parse_partition_ranges(args.partition, view.num_partitions)
    problems = asyncio.run(checks.verify(view, parts, args.timeout))
    for problem in problems:
        print(problem, file=out)
    if not problems:
        scope = "every partition" if parts is None else f"partitions {sm.format_ranges(parts)}"
        print(f"OK: {scope} served, replicated and healthy", file=out)
    # A pending trim is no problem (the exit status ignores it), but what is about to be deleted is news.
    points = read_trim_points(client, root)
    wanted = range(view.num_partitions) if parts is None else parts
    for line in checks.pending_trims(points, wanted, wall_clock_ms()):
        print(line, file=out)
    return 1 if problems else 0


def cmd_features(client: KazooClient, root: str, args: argparse.Namespace, out: TextIO) -> int:
    ssl = load_cli_tls(args.cli_config_path).client_context(args.cli_config_path)
    report = features.feature_report(client, root, ssl)
    from waltz.cluster.features import FEATURES, SUPPORTED_FEATURES

    fv = report.feature_version
    print(f"feature version: {fv} ({FEATURES.get(fv, 'unknown to this release')})", file=out)
    for p in report.processes:
        print(f"  {p.line()}", file=out)
    nxt = fv + 1
    if nxt in SUPPORTED_FEATURES:
        blockers = report.blockers(nxt)
        verdict = "no: " + ", ".join(f"{b.kind} {b.name}" for b in blockers) if blockers else "yes"
        print(f"can raise to {nxt} ({FEATURES[nxt]}): {verdict}", file=out)
    # A process that does not support the version in force (an older release started after the raise, or
    # one that cannot be reached) is a problem to fix: exit 1, as `verify` does.
    behind = [p for p in report.processes if p.features is not None and fv not in p.features]
    for p in behind:
        print(
            f"PROBLEM: {p.kind} {p.name} does not support feature version {fv} (it supports {p.features})",
            file=out,
        )
    return 1 if behind else 0


def cmd_raise_features(client: KazooClient, root: str, args: argparse.Namespace, out: TextIO) -> int:
    ssl = load_cli_tls(args.cli_config_path).client_context(args.cli_config_path)
    old, new = features.raise_features(client, root, args.to, ssl)
    if old == new:
        print(f"feature version already {new}: nothing to do", file=out)
    else:
        print(f"feature version raised from {old} to {new}", file=out)
    return 0


def cmd_trim(client: KazooClient, root: str, args: argparse.Namespace, out: TextIO) -> int:
    if args.cancel:
        print(trim.cancel_trim(client, root, args.partition), file=out)
        return 0
    ssl = load_cli_tls(args.cli_config_path).client_context(args.cli_config_path)
    outcome = trim.trim_partition(
        client,
        root,
        args.partition,
        to=args.to,
        keep_last=args.keep_last,
        min_kept_transactions=args.min_kept,
        grace_ms=args.grace_ms,
        ssl=ssl,
        timeout_ms=int(args.timeout * 1000),
    )
    print(outcome.message, file=out)
    return 0


def cmd_retention(client: KazooClient, root: str, args: argparse.Namespace, out: TextIO) -> int:
    if args.action != "show":
        edit = retention.RetentionEdit(
            partition_id=args.partition,
            keep_transactions=args.keep_transactions,
            keep_bytes=args.keep_bytes,
            grace_ms=args.grace_ms,
            keep_all=args.keep_all,
            clear=args.action == "clear",
        )
        retention.update_retention(client, root, edit)
    for line in trim.retention_status(client, root):
        print(line, file=out)
    return 0


def cmd_fix_generation(client: KazooClient, root: str, args: argparse.Namespace, out: TextIO) -> int:
    view = _ops_view(client, root, args)
    fix = asyncio.run(generation.plan_generation_fix(client, view, args.partition, args.to, args.timeout))
    for line in fix.describe():
        print(line, file=out)
    if not fix.changes:
        return 0
    if not args.yes:
        print("nothing written: run again with --yes to write this change", file=out)
        return 0
    generation.apply_generation_fix(client, root, fix)
    print(
        f"written: partition {fix.partition} is at generation {fix.target.generation}, session "
        f"{fix.target.session_id}; its owner serves it again within storage.metadataConflictReport (30 s)",
        file=out,
    )
    return 0


def _storage_admin(text: str) -> tuple[str, int]:
    try:
        return rebuild.parse_storage_arg(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_rebuild_metadata(client: KazooClient, root: str, args: argparse.Namespace, out: TextIO) -> int:
    ssl = load_cli_tls(args.cli_config_path).client_context(args.cli_config_path)
    nodes = asyncio.run(rebuild.read_nodes(args.storage, ssl))
    plan = rebuild.plan_rebuild(root, args.name, nodes)
    for line in plan.describe():
        print(line, file=out)
    if not args.yes:
        print("nothing written: run again with --yes to write this metadata", file=out)
        return 0
    rebuild.apply_rebuild(client, plan, replace=args.replace)
    print(f"written: {root} rebuilt; start (or restart) the servers", file=out)
    return 0


def cmd_accept_loss(client: KazooClient, root: str, args: argparse.Namespace, out: TextIO) -> int:
    view = _ops_view(client, root, args)
    plan = asyncio.run(
        accept_loss.plan_accept_loss(client, view, args.partition, args.keep_through, args.timeout)
    )
    for line in plan.describe():
        print(line, file=out)
    if not args.yes:
        print("nothing written: run again with --yes to accept this loss", file=out)
        return 0
    asyncio.run(accept_loss.apply_accept_loss(client, view, plan))
    print(f"written: partition {plan.partition} holds 0..{plan.keep_through} on every replica", file=out)
    return 0


# ---------------------------------------------------------------------------------------------- registration


def register(groups: Any) -> None:
    parser = groups.add_parser("cluster", help="create, inspect and edit cluster metadata in ZooKeeper")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, fn: Command, help_text: str) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = sub.add_parser(name, help=help_text, description=help_text)
        add_cli_config_arg(p)
        p.set_defaults(handler=_run(fn))
        return p

    _add_metadata_commands(command)
    _add_check_commands(command)
    _add_repair_commands(command)


def _add_metadata_commands(command: _AddCommand) -> None:
    """The commands that create, show and edit the cluster's metadata."""
    p = command("create", cmd_create, "create a cluster (random cluster key) at cluster.root")
    p.add_argument("-n", "--name", required=True, help="cluster name")
    p.add_argument("-p", "--partitions", required=True, type=_positive, help="number of partitions")
    p.add_argument(
        "--cluster-key",
        type=_uuid,
        metavar="UUID",
        help="use this key instead of a random one (to restore a backup keeping its key: docs/operations.md)",
    )
    p.add_argument(
        "--feature-version",
        type=_positive,
        metavar="N",
        help="start at this feature version instead of the newest this release supports (for a cluster that "
        "processes of an older release will join: docs/upgrade.md)",
    )

    p = command("delete", cmd_delete, "delete the cluster at cluster.root (recursively)")
    p.add_argument("-n", "--name", help="the cluster's name, which must match")
    p.add_argument("-f", "--force", action="store_true", help="delete even if the name does not match")

    command("list", cmd_list, "show the cluster: servers, storage nodes, assignments, partition metadata")
    command("show-cluster-key", cmd_show_cluster_key, "print the cluster key (a UUID)")

    p = command("add-storage-node", cmd_add_storage_node, "register a storage node in a group")
    p.add_argument("-s", "--storage", required=True, type=_storage, help="host:port (data port)")
    p.add_argument("-a", "--admin-port", required=True, type=_positive, help="the node's admin port")
    p.add_argument("-g", "--group", required=True, type=_non_negative, help="replica group id")

    p = command(
        "remove-storage-node", cmd_remove_storage_node, "forget a storage node that holds no partitions"
    )
    p.add_argument("-s", "--storage", required=True, type=_storage, help="host:port (data port)")

    for name, fn, what in (
        ("assign-partition", cmd_assign_partition, "add replicas of partitions on a storage node"),
        ("unassign-partition", cmd_unassign_partition, "remove replicas of partitions from a storage node"),
    ):
        p = command(name, fn, what)
        p.add_argument("-p", "--partition", required=True, help="partition ranges, e.g. 0-6,7,10-16")
        p.add_argument("-s", "--storage", required=True, type=_storage, help="host:port (data port)")

    p = command("auto-assign", cmd_auto_assign, "spread all partitions round-robin over a group's nodes")
    p.add_argument("-g", "--group", required=True, type=_non_negative, help="replica group id")


def _add_check_commands(command: _AddCommand) -> None:
    """The commands that check the cluster against itself."""
    p = command("check-connectivity", cmd_check_connectivity, "each live server's view of each storage node")
    p.add_argument("--timeout", type=float, default=10.0, metavar="S", help="time limit per node (10 s)")

    p = command(
        "verify",
        cmd_verify,
        "check ZooKeeper, servers and storage nodes against each other; one line per problem, exit 1 if any",
    )
    p.add_argument(
        "-p", "--partition", metavar="RANGES", help="only these partitions (node checks still run)"
    )
    p.add_argument("--timeout", type=float, default=10.0, metavar="S", help="time limit per node (10 s)")

    command("features", cmd_features, "the cluster's feature version and what each process supports")
    p = command(
        "raise-features",
        cmd_raise_features,
        "raise the feature version once every process supports it (no rollback to an older release after)",
    )
    p.add_argument("--to", type=_positive, metavar="N", help="the feature version (default: this release's)")


def _add_repair_commands(command: _AddCommand) -> None:
    """The commands that repair the cluster's metadata or change what it keeps."""
    p = command(
        "rebuild-metadata",
        cmd_rebuild_metadata,
        "rebuild lost ZooKeeper metadata from the storage nodes (shows the plan; writes it with --yes)",
    )
    p.add_argument(
        "-s",
        "--storage",
        required=True,
        action="append",
        type=_storage_admin,
        metavar="HOST:ADMINPORT[=GROUP]",
        help="every storage node of the cluster, by admin address (repeat); its replica group (default 0)",
    )
    p.add_argument("-n", "--name", required=True, help="the cluster name to record")
    p.add_argument("--yes", action="store_true", help="write the metadata (without it, only show the plan)")
    p.add_argument(
        "--replace", action="store_true", help="delete cluster.root first if it exists (default: refuse)"
    )
    p.set_defaults(default_log_level="INFO")

    _add_loss_commands(command)

    p = command(
        "fix-generation",
        cmd_fix_generation,
        "lower a partition's metadata generation that no assignment handed out back to the assigned one "
        "(shows the change; writes it with --yes)",
    )
    p.add_argument("-p", "--partition", required=True, type=_non_negative, help="the partition")
    p.add_argument(
        "--to", type=_non_negative, metavar="G", help="the generation to set (default: the assignment's)"
    )
    p.add_argument("--yes", action="store_true", help="write the change (without it, only show it)")
    p.add_argument("--timeout", type=float, default=10.0, metavar="S", help="time limit per node (10 s)")
    # The one line that records the write goes to stderr like a server's (other commands log warnings only).
    p.set_defaults(default_log_level="INFO")


def _add_loss_commands(command: _AddCommand) -> None:
    """The commands that give up transactions on purpose: accept a loss, trim a partition."""
    p = command(
        "accept-loss",
        cmd_accept_loss,
        "when every replica is older than ZooKeeper's record (disks restored from snapshots), keep "
        "0..--keep-through and lose the rest (shows what is lost; does it with --yes)",
    )
    p.add_argument("-p", "--partition", required=True, type=_non_negative, help="the partition")
    p.add_argument(
        "--keep-through",
        required=True,
        type=int,
        metavar="TXN",
        help="the last transaction id to keep (-1: none)",
    )
    p.add_argument("--yes", action="store_true", help="accept the loss (without it, only show it)")
    p.add_argument("--timeout", type=float, default=10.0, metavar="S", help="time limit per node (10 s)")
    p.set_defaults(default_log_level="INFO")

    p = command(
        "trim",
        cmd_trim,
        "raise a partition's trim point: transactions below it are deleted on every replica and reads of "
        "them fail (only committed transactions, never the last --min-kept)",
    )
    p.add_argument("-p", "--partition", required=True, type=_non_negative, help="the partition")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--to", type=_non_negative, metavar="TXN", help="the lowest transaction id to keep")
    target.add_argument("--keep-last", type=int, metavar="N", help="keep only the last N transactions")
    target.add_argument("--cancel", action="store_true", help="cancel the pending trim point (in its grace)")
    p.add_argument(
        "--grace-ms",
        type=_non_negative,
        metavar="MS",
        help="how long the trim point is pending before it takes effect (default: the cluster's "
        "retention.graceMs; 0: at once, for an emergency such as a full disk)",
    )
    p.add_argument(
        "--min-kept",
        type=_non_negative,
        default=trim.DEFAULT_MIN_KEPT_TRANSACTIONS,
        metavar="N",
        help=f"grace: never trim the last N transactions (default {trim.DEFAULT_MIN_KEPT_TRANSACTIONS})",
    )
    p.add_argument("--timeout", type=float, default=10.0, metavar="S", help="time limit (10 s)")
    p.set_defaults(default_log_level="INFO")

    p = command(
        "retention",
        cmd_retention,
        "show or set the retention policy (keep the last N transactions or N bytes; the grace before any "
        "trim point takes effect) and each partition's trim point, in force and pending",
    )
    p.add_argument("action", choices=["show", "set", "clear"], help="show, set or clear a policy")
    p.add_argument("-p", "--partition", type=_non_negative, help="a partition's override (default: all)")
    p.add_argument("--keep-transactions", type=int, metavar="N", help="keep the last N transactions")
    p.add_argument(
        "--keep-bytes", type=int, metavar="B", help="keep the newest segments that hold B bytes (per replica)"
    )
    p.add_argument("--keep-all", action="store_true", help="keep everything (an override of the default)")
    p.add_argument(
        "--grace-ms",
        type=_non_negative,
        metavar="MS",
        help=f"cluster-wide: how long every trim point is pending before it takes effect "
        f"(default {retention.DEFAULT_GRACE_MS} ms)",
    )
    p.set_defaults(default_log_level="INFO")
