"""Released versions of Waltz, each installed in a virtual environment of its own, for mixed-version runs.

A release is found by the commit id ``CHANGELOG.md`` records for it (a heading ``## X.Y.Z - <date> - commit
<40 hex digits>``), not by its git tag: a CI clone may not fetch tags, but the commit is always in the
history. :func:`release_env` extracts that commit's tree (``git archive``), makes a virtual environment and
installs the core package into it with pip (no extras: no PySpark), once: the result is cached under
``$WALTZ_RELEASE_CACHE`` (default ``~/.cache/waltz/releases``), one directory per commit, and reused by every
later run. Building takes about half a minute and needs the package index that installs Waltz's own
dependencies.

A process of the release must not see this checkout: :meth:`ReleaseEnv.env` is the environment without
``PYTHONPATH``, and commands run from the release's own source directory (its ``bench`` package is the
release's too).
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHANGELOG = REPO / "CHANGELOG.md"
_RELEASE_HEADING = re.compile(r"^## (\d+\.\d+\.\d+) .*\bcommit ([0-9a-f]{40})\b", re.MULTILINE)
BUILD_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ReleaseEnv:
    """One release installed in its own virtual environment."""

    version: str
    commit: str
    python: Path
    source: Path
    """The release's source tree (its ``bench`` package runs from here)."""

    def env(self) -> dict[str, str]:
        """This process's environment without what would make the release import this checkout."""
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        return env

    def command(self, *args: str) -> list[str]:
        return [str(self.python), *args]


def releases(changelog: Path = CHANGELOG) -> list[tuple[str, str]]:
    """``[(version, commit)]`` of every release in the changelog, newest first."""
    return _RELEASE_HEADING.findall(changelog.read_text(encoding="utf-8"))


def last_release(changelog: Path = CHANGELOG) -> tuple[str, str]:
    found = releases(changelog)
    if not found:
        raise RuntimeError(
            f"{changelog}: no release heading with a commit id ('## X.Y.Z - date - commit ...')"
        )
    return found[0]


def cache_root() -> Path:
    default = Path.home() / ".cache" / "waltz" / "releases"
    return Path(os.environ.get("WALTZ_RELEASE_CACHE", default))


def release_env(version: str, commit: str, cache: Path | None = None) -> ReleaseEnv:
    """The release at ``commit`` installed in its own virtual environment (built once, then reused)."""
    base = (cache or cache_root()) / commit
    base.mkdir(parents=True, exist_ok=True)
    python = base / "venv" / "bin" / "python"
    release = ReleaseEnv(version, commit, python, base / "source")
    with (base / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time; the others wait and reuse it
        if not (base / "ready").exists():
            _build(release, base)
    return release


def _build(release: ReleaseEnv, base: Path) -> None:
    for stale in ("source", "venv"):
        shutil.rmtree(base / stale, ignore_errors=True)
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", release.commit],
        check=True,
        capture_output=True,
        timeout=BUILD_TIMEOUT_S,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(release.source, filter="data")
    subprocess.run([sys.executable, "-m", "venv", str(base / "venv")], check=True, timeout=BUILD_TIMEOUT_S)
    subprocess.run(
        [
            str(release.python),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            str(release.source),
        ],
        check=True,
        timeout=BUILD_TIMEOUT_S,
        env=release.env(),
        cwd=base,
    )
    got = subprocess.run(
        [str(release.python), "-c", "import waltz.version as v; print(v.__version__)"],
        check=True,
        capture_output=True,
        text=True,
        env=release.env(),
        cwd=base,
    ).stdout.strip()
    if got != release.version:
        raise RuntimeError(
            f"the release at {release.commit} says it is {got}, the changelog {release.version}"
        )
    (base / "ready").write_text(f"{release.version} {release.commit}\n", encoding="utf-8")


def remove(commit: str, cache: Path | None = None) -> None:
    """Forget a cached release (the next :func:`release_env` builds it again)."""
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree((cache or cache_root()) / commit)
