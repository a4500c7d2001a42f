"""A rolling upgrade from the last release to this checkout, under load, then the feature raise.

One run (:func:`run_upgrade`), bounded in time, stops everything it started:

1. ``waltz local up`` of the last release (:mod:`bench.faults.releases`: installed in its own virtual
   environment from the commit ``CHANGELOG.md`` records): ZooKeeper, storage nodes and servers all run it.
   ``waltz cluster raise-features`` is refused, naming every process of the release.
2. Application processes of the release (its own ``bench.faults.app``) append uniquely tagged transactions
   under contended locks, for the whole run.
3. One process at a time, each stopped cleanly (SIGTERM) and started on this checkout: every storage node
   (then it must catch up with the others before the next step), every server (then every partition must be
   served again), every application (stopped after its outstanding appends ended; a new one of this
   checkout takes its place, with a tag prefix of its own).
4. A rollback before the raise: one storage node and one server go back to the release, load continuing,
   and up again to this checkout.
5. ``raise-features`` to this checkout's feature version, which now succeeds; load goes on for a while.
6. Checks (the fault suite's, :meth:`bench.faults.suite.Harness.verify`): every acknowledged transaction is
   in the log exactly once, ids are dense, every replica is identical; and per step, the longest time no
   application saw an acknowledgement (the *stall*), which must stay under ``max_stall_s``.

Run it: ``python -m bench.faults.upgrade`` (options: ``--help``). A CI-sized run is
``tests/integration/test_mixed_versions.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.faults.releases import ReleaseEnv, last_release, release_env
from bench.faults.suite import REPO, Harness, Options, _app_env

from waltz import local
from waltz.cluster import features as ft
from waltz.cluster import zk as zkutil
from waltz.errors import FeatureVersionError
from waltz.local import procs
from waltz.ops import features as ops_features
from waltz.server.storage_client import AdminClient

STEP_SETTLE_S = 2.0
"""Load observed after each step's process is ready again, so a stall right after it counts too."""


@dataclass(frozen=True)
class UpgradeOptions:
    storages: int = 3
    servers: int = 2
    partitions: int = 4
    apps: int = 2
    """Application processes running at once (each is replaced once, so twice as many run in all)."""
    max_stall_s: float = 1.0
    after_raise_s: float = 5.0
    ready_bound_s: float = 60.0
    """Bound on a restarted process becoming ready (caught up, partitions served)."""
    run_bound_s: float = 900.0


@dataclass
class Step:
    name: str
    start: float
    ready: float = 0.0
    end: float = 0.0
    stall_s: float = 0.0
    acks: int = 0

    def line(self) -> str:
        return (
            f"{self.name:<34} ready after {self.ready - self.start:5.2f}s, longest stall {self.stall_s:5.2f}s"
            f" ({self.acks} acks in the step)"
        )


@dataclass
class UpgradeResult:
    ok: bool = False
    release: str = ""
    steps: list[Step] = field(default_factory=list)
    refused_before: str = ""
    raised: tuple[int, int] = (0, 0)
    acked: int = 0
    log_records: dict[int, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0


class Upgrade:
    """The cluster, the release and the apps of one run."""

    def __init__(
        self, directory: Path, opts: UpgradeOptions, old: ReleaseEnv, report: Callable[[str], None]
    ) -> None:
        self.directory = directory
        self.opts = opts
        self.old = old
        self.report = report
        self.harness = Harness(
            directory,
            0,
            Options(
                storages=opts.storages, servers=opts.servers, partitions=opts.partitions, apps=2 * opts.apps
            ),
            report,
        )
        self.t0 = time.monotonic()
        self.next_app = 0
        self.running_apps: dict[int, subprocess.Popen[bytes]] = {}

    def log(self, text: str) -> None:
        self.report(f"[upgrade {time.monotonic() - self.t0:6.1f}s] {text}")

    # -- processes -------------------------------------------------------------------------------------

    def _old_waltz(self, *args: str, timeout_s: float = 180.0) -> None:
        cmd = self.old.command("-m", "waltz.cli.main", *args)
        done = subprocess.run(
            cmd, env=self.old.env(), cwd=self.old.source, capture_output=True, text=True, timeout=timeout_s
        )
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stdout}{done.stderr}")

    async def start_old_cluster(self) -> None:
        o = self.opts
        self.harness.cluster_up = True
        await asyncio.to_thread(
            self._old_waltz,
            *("local", "up", "--dir", str(self.directory), "--storages", str(o.storages)),
            *(
                "--servers",
                str(o.servers),
                "--partitions",
                str(o.partitions),
                "--zk-session-timeout-ms",
                "6000",
            ),
        )
        await self.harness.wait_served(self.opts.ready_bound_s)

    async def restart(self, kind: str, index: int, release: ReleaseEnv | None) -> None:
        """Stop one member cleanly and start it on ``release`` (None: this checkout)."""
        rec = self.harness.cluster().member(kind, index)
        await asyncio.to_thread(procs.stop, rec.process)
        flag = f"--{kind}"
        if release is None:
            await asyncio.to_thread(local.start, self.directory, kind, index, self.opts.ready_bound_s)
        else:
            await asyncio.to_thread(
                self._old_waltz, "local", "start", "--dir", str(self.directory), flag, str(index)
            )

    def start_app(self, release: ReleaseEnv | None) -> int:
        i = self.next_app
        self.next_app += 1
        cmd_args = [
            *("-m", "bench.faults.app", "--config", str(self.directory / "client.yaml"), "--app", str(i)),
            *("--seed", "0", "--duration-s", f"{self.opts.run_bound_s:.0f}", "--settle-s", "60"),
            *("--out", str(self.directory / f"acks-{i}.jsonl"), "--stop-file", str(self._stop_file(i))),
        ]
        if release is None:
            cmd, env, cwd = [sys.executable, *cmd_args], _app_env(), REPO
        else:
            cmd, env, cwd = release.command(*cmd_args), release.env(), release.source
        (self.directory / "logs").mkdir(exist_ok=True)
        with (self.directory / "logs" / f"app-{i}.log").open("ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env)
        self.harness.apps.append(proc)
        self.running_apps[i] = proc
        return i

    def _stop_file(self, app: int) -> Path:
        return self.directory / f"stop-app-{app}"

    async def stop_app(self, app: int) -> None:
        self._stop_file(app).touch()
        proc = self.running_apps.pop(app)
        deadline = time.monotonic() + 90
        while proc.poll() is None and time.monotonic() < deadline:  # noqa: ASYNC110 - polling a child
            await asyncio.sleep(0.1)

    # -- readiness -------------------------------------------------------------------------------------

    async def wait_caught_up(self, index: int) -> None:
        """Until storage node ``index`` holds, for each of its partitions, what the others held when asked."""
        cluster = self.harness.cluster()
        key = self.harness._cluster_key()
        rec = cluster.storages[index]
        targets: dict[int, int] = dict.fromkeys(rec.partitions, -1)
        for other in cluster.storages:
            if other.index == index:
                continue
            async with await AdminClient.connect(
                procs.LOOPBACK, other.admin_port, key, cluster.num_partitions
            ) as a:
                for p in rec.partitions:
                    targets[p] = max(targets[p], await a.max_transaction_id(p))
        deadline = time.monotonic() + self.opts.ready_bound_s
        async with await AdminClient.connect(
            procs.LOOPBACK, rec.admin_port, key, cluster.num_partitions
        ) as a:
            for p, target in targets.items():
                while await a.max_transaction_id(p) < target:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{rec.name} partition {p} did not catch up to {target}")
                    await asyncio.sleep(0.1)

    async def wait_acks_from(self, app: int) -> None:
        path = self.directory / f"acks-{app}.jsonl"
        deadline = time.monotonic() + self.opts.ready_bound_s
        while not (path.exists() and path.stat().st_size > 0):
            if time.monotonic() > deadline:
                raise RuntimeError(f"app {app} acknowledged nothing within {self.opts.ready_bound_s:g}s")
            await asyncio.sleep(0.1)

    # -- steps -----------------------------------------------------------------------------------------

    async def step(self, name: str, result: UpgradeResult, action: Callable[[], Awaitable[None]]) -> None:
        step = Step(name, time.time())
        await action()
        step.ready = time.time()
        await asyncio.sleep(STEP_SETTLE_S)
        step.end = time.time()
        result.steps.append(step)
        self.log(f"{name}: ready after {step.ready - step.start:.2f}s")

    async def storage(self, index: int, release: ReleaseEnv | None) -> None:
        await self.restart("storage", index, release)
        await self.wait_caught_up(index)

    async def server(self, index: int, release: ReleaseEnv | None) -> None:
        await self.restart("server", index, release)
        await self.harness.wait_served(self.opts.ready_bound_s)

    async def app(self, old_app: int) -> None:
        new = self.start_app(None)  # the new one first, so that the load never drops
        await self.wait_acks_from(new)
        await self.stop_app(old_app)


def measure(steps: list[Step], times: list[float]) -> None:
    """Each step's longest gap between acknowledgements (any app), from the last one before it started."""
    times = sorted(times)
    for step in steps:
        inside = [t for t in times if step.start <= t <= step.end]
        before = [t for t in times if t < step.start]
        points = ([before[-1]] if before else [step.start]) + inside + [step.end]
        step.acks = len(inside)
        step.stall_s = max(b - a for a, b in itertools.pairwise(points))


async def _run(up: Upgrade, result: UpgradeResult) -> None:
    opts = up.opts
    await up.start_old_cluster()
    cluster = up.harness.cluster()
    up.log(f"cluster of Waltz {up.old.version} up")
    zk = await asyncio.to_thread(zkutil.connect, cluster.zk_connect, session_timeout_ms=10_000)
    try:
        try:
            await asyncio.to_thread(ops_features.raise_features, zk, cluster.cluster_root)
            result.problems.append("raise-features succeeded in a cluster of the old release")
        except FeatureVersionError as e:
            result.refused_before = str(e)
            up.log(f"raise refused before the upgrade, as it must be: {e}")
        apps = [up.start_app(up.old) for _ in range(opts.apps)]
        for a in apps:
            await up.wait_acks_from(a)
        up.log(f"{opts.apps} apps of Waltz {up.old.version} appending")
        for i in range(opts.storages):
            await up.step(f"storage {i} -> new", result, lambda i=i: up.storage(i, None))
        for i in range(opts.servers):
            await up.step(f"server {i} -> new", result, lambda i=i: up.server(i, None))
        for a in apps:
            await up.step(f"app {a} -> new", result, lambda a=a: up.app(a))
        await up.step(f"rollback: storage 0 -> {up.old.version}", result, lambda: up.storage(0, up.old))
        await up.step(f"rollback: server 0 -> {up.old.version}", result, lambda: up.server(0, up.old))
        await up.step("storage 0 -> new again", result, lambda: up.storage(0, None))
        await up.step("server 0 -> new again", result, lambda: up.server(0, None))

        async def raise_now() -> None:
            result.raised = await asyncio.to_thread(ops_features.raise_features, zk, cluster.cluster_root)

        await up.step("raise-features", result, raise_now)
        fv, _ = await asyncio.to_thread(ft.read_feature_version, zk, cluster.cluster_root)
        if fv != ft.SUPPORTED_FEATURES.hi:
            result.problems.append(f"feature version {fv} after the raise")
        await asyncio.sleep(opts.after_raise_s)
    finally:
        await asyncio.to_thread(zkutil.close, zk)
    for a in list(up.running_apps):
        up._stop_file(a).touch()
    result.problems += await up.harness.wait_apps(120)
    acks, _, problems = up.harness.read_acks()
    result.problems += problems
    result.acked = len(acks)
    measure(result.steps, [t for _, t in acks.values()])
    for step in result.steps:
        up.log(step.line())
        if step.stall_s > opts.max_stall_s:
            result.problems.append(f"{step.name}: stall of {step.stall_s:.2f}s (bound {opts.max_stall_s:g}s)")
    result.log_records, problems = await up.harness.verify(acks)
    result.problems += problems


async def run_upgrade_async(
    opts: UpgradeOptions,
    directory: Path,
    report: Callable[[str], None] = print,
    old: ReleaseEnv | None = None,
) -> UpgradeResult:
    if old is None:
        version, commit = last_release()
        old = await asyncio.to_thread(release_env, version, commit)
    result = UpgradeResult(release=f"{old.version} ({old.commit[:12]})")
    up = Upgrade(directory, opts, old, report)
    started = time.monotonic()
    try:
        async with asyncio.timeout(opts.run_bound_s):
            await _run(up, result)
    except TimeoutError:
        result.problems.append(f"the run exceeded its bound of {opts.run_bound_s:g}s")
    except Exception as e:  # noqa: BLE001 - any failure of the run is a finding
        result.problems.append(f"the run failed: {e!r}")
    finally:
        await up.harness.aclose()
    result.elapsed_s = time.monotonic() - started
    result.ok = not result.problems
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--apps", type=int, default=2)
    parser.add_argument("--max-stall-s", type=float, default=1.0)
    parser.add_argument("--after-raise-s", type=float, default=20.0)
    parser.add_argument("--dir", type=Path, default=None, help="run directory (default: a new temporary one)")
    args = parser.parse_args(argv)
    opts = UpgradeOptions(
        partitions=args.partitions,
        apps=args.apps,
        max_stall_s=args.max_stall_s,
        after_raise_s=args.after_raise_s,
    )
    directory = args.dir or Path(tempfile.mkdtemp(prefix="waltz-upgrade-"))
    result = asyncio.run(run_upgrade_async(opts, directory))
    print(json.dumps(asdict(result), indent=2))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
