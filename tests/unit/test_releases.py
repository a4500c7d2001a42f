"""The release record the mixed-version tests rely on, and how they measure a step's stall."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from bench.faults.releases import CHANGELOG, REPO, last_release, releases
from bench.faults.upgrade import Step, measure

from waltz.version import __version__


def test_the_changelog_names_each_release_by_a_commit_of_this_history() -> None:
    found = releases()
    assert found[-1] == ("0.1.0", "0f9581265d7dc8b99389732db690ee884033a8ef")
    assert last_release() == found[0]
    for version, commit in found:
        # The commit is in the history (a clone without tags has it) and is that release.
        source = subprocess.run(
            ["git", "-C", str(REPO), "show", f"{commit}:src/waltz/version.py"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        assert f'__version__ = "{version}"' in source
    # The working tree is past the last release, and says so.
    assert __version__ != found[0][0]
    assert re.search(rf"^## Unreleased \({re.escape(__version__)}\)$", CHANGELOG.read_text(), re.MULTILINE)


def test_the_changelog_heading_format_is_the_one_parsed(tmp_path: Path) -> None:
    log = tmp_path / "CHANGELOG.md"
    log.write_text(
        "## Unreleased (0.3.0.dev0)\n\n## 0.2.0 - 2027-01-02 - commit " + "a" * 40 + "\n\n"
        "## 0.1.0 - 2026-11-29 - commit " + "b" * 40 + "\n",
        encoding="utf-8",
    )
    assert releases(log) == [("0.2.0", "a" * 40), ("0.1.0", "b" * 40)]
    assert last_release(log) == ("0.2.0", "a" * 40)


def test_a_steps_stall_is_its_longest_gap_without_an_acknowledgement() -> None:
    quiet = Step("quiet", start=10.0, end=14.0)
    busy = Step("busy", start=20.0, end=22.0)
    acks = [9.5, 10.2, 10.4, 12.9, 13.0, 19.0, 20.1, 20.2, 20.3, 21.0, 21.9]
    measure([quiet, busy], acks)
    # From 10.4 to 12.9; the gap from the last acknowledgement before the step counts too (19.0 -> 20.1).
    assert round(quiet.stall_s, 6) == 2.5
    assert quiet.acks == 4
    assert round(busy.stall_s, 6) == 1.1
    assert busy.acks == 5
    silent = Step("silent", start=30.0, end=31.5)
    measure([silent], acks)
    assert round(silent.stall_s, 6) == round(31.5 - 21.9, 6)  # nothing acknowledged: all of it is a stall
    assert silent.acks == 0
