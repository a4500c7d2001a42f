"""Log options of the ``waltz`` command, the JSON line format, and one line per ZooKeeper state change."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import pytest

from waltz.cli import logsetup
from waltz.cli.main import build_parser
from waltz.cluster import zk


def test_run_commands_default_to_info_and_others_to_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(logsetup.LEVEL_ENV, raising=False)
    parser = build_parser()
    assert logsetup.level_of(parser.parse_args(["server", "run", "--config", "s.yaml"])) == "INFO"
    assert logsetup.level_of(parser.parse_args(["storage", "run", "--config", "s.yaml"])) == "INFO"
    assert logsetup.level_of(parser.parse_args(["cluster", "list", "-c", "c.yaml"])) == "WARNING"
    assert logsetup.level_of(parser.parse_args(["-v", "server", "run", "--config", "s.yaml"])) == "DEBUG"
    after = parser.parse_args(["server", "run", "--config", "s.yaml", "--log-level", "error"])
    assert logsetup.level_of(after) == "ERROR"
    before = parser.parse_args(
        ["--log-level", "debug", "--log-format", "json", "storage", "run", "--config", "x"]
    )
    assert (logsetup.level_of(before), logsetup.format_of(before)) == ("DEBUG", "json")
    # A level inherited from the command that started us, unless one is given.
    monkeypatch.setenv(logsetup.LEVEL_ENV, "debug")
    assert logsetup.level_of(parser.parse_args(["server", "run", "--config", "s.yaml"])) == "DEBUG"
    assert logsetup.level_of(after) == "ERROR"


def test_pass_down_puts_given_options_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # setenv first, so that monkeypatch removes the variables again at the end (pass_down sets them directly).
    monkeypatch.setenv(logsetup.LEVEL_ENV, "")
    monkeypatch.setenv(logsetup.FORMAT_ENV, "")
    monkeypatch.delenv(logsetup.LEVEL_ENV)
    monkeypatch.delenv(logsetup.FORMAT_ENV)
    logsetup.pass_down(argparse.Namespace())
    assert logsetup.LEVEL_ENV not in os.environ
    logsetup.pass_down(argparse.Namespace(log_level="DEBUG", log_format="json"))
    assert (os.environ[logsetup.LEVEL_ENV], os.environ[logsetup.FORMAT_ENV]) == ("DEBUG", "json")


def test_json_lines_carry_time_level_logger_message_and_traceback() -> None:
    formatter = logsetup.JsonFormatter()
    record = logging.LogRecord("waltz.x", logging.INFO, __file__, 1, "partition %d opened", (3,), None)
    line = json.loads(formatter.format(record))
    assert line["level"] == "INFO"
    assert line["logger"] == "waltz.x"
    assert line["msg"] == "partition 3 opened"
    assert line["ts"].endswith("Z")
    assert "exc" not in line
    try:
        raise ValueError("boom")
    except ValueError:
        failed = logging.LogRecord("waltz.x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    out = formatter.format(failed)
    assert "\n" not in out  # one line, whatever the traceback
    assert "ValueError: boom" in json.loads(out)["exc"]


def test_one_line_per_zookeeper_state_change(caplog: pytest.LogCaptureFixture) -> None:
    states = zk._StateLog("zk1:2181")
    with caplog.at_level(logging.INFO, logger="waltz.cluster.zk"):
        for state in ["CONNECTED", "SUSPENDED", "SUSPENDED", "SUSPENDED", "CONNECTED", "SUSPENDED", "LOST"]:
            states(state)
        states("CONNECTED")
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert lines == [
        ("INFO", "ZooKeeper session started (zk1:2181)"),
        ("WARNING", "ZooKeeper connection lost; reconnecting to zk1:2181"),
        ("INFO", "ZooKeeper connection back, same session (zk1:2181)"),
        ("WARNING", "ZooKeeper connection lost; reconnecting to zk1:2181"),
        ("WARNING", "ZooKeeper session expired; its ephemeral znodes are gone; starting a new one"),
        ("INFO", "ZooKeeper session started (zk1:2181)"),
    ]
