"""The Prometheus alert rules in contrib/prometheus are valid (``promtool check rules``) and pass their unit
tests (``promtool test rules``: each alert fires on the series it is about, with its labels and texts, and
stays quiet otherwise). promtool is Debian's ``prometheus`` package (scripts/install-system-deps.sh)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml

RULES_DIR = Path(__file__).parents[2] / "contrib" / "prometheus"
RULES = RULES_DIR / "waltz-alerts.yml"
RULE_TESTS = RULES_DIR / "waltz-alerts.test.yml"
OPERATIONS = Path(__file__).parents[2] / "docs" / "operations.md"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("promtool")
    assert tool is not None, "promtool not found: run scripts/install-system-deps.sh (Debian's prometheus)"
    return subprocess.run(
        [tool, *args], cwd=RULES_DIR, capture_output=True, text=True, timeout=120, check=False
    )


def alert_names() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule]


def test_the_rules_are_valid() -> None:
    result = promtool("check", "rules", RULES.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_names())} rules found" in result.stdout


def test_the_rules_pass_their_unit_tests() -> None:
    result = promtool("test", "rules", RULE_TESTS.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_is_unit_tested_and_documented() -> None:
    tested = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    documented = set(re.findall(r"\*\*(Waltz\w+)\*\*", OPERATIONS.read_text()))
    names = alert_names()
    assert len(names) >= 10
    assert sorted(set(names) - tested) == [], "alerts without a promtool test"
    assert sorted(set(names) - documented) == [], "alerts docs/operations.md does not explain"
