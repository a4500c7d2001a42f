"""The deployment files in ``contrib/`` that docs/deploy.md tells operators to install, checked for real:
the systemd units by ``systemd-analyze verify`` and their command lines by the ``waltz`` CLI, the ensemble's
``zoo.cfg`` by running three ZooKeepers with it (a 2000 ms session granted as asked).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from waltz.cluster import zk as zkutil
from waltz.cluster import zkserver
from waltz.local import procs

pytestmark = [pytest.mark.integration]

CONTRIB = Path(__file__).resolve().parents[2] / "contrib"
UNITS = sorted((CONTRIB / "systemd").glob("*.service"))
INSTALLED_WALTZ = "/opt/waltz/venv/bin/waltz"


@pytest.fixture
def waltz_bin(tmp_path: Path) -> Path:
    """An executable ``waltz`` that runs this tree's CLI (the units name the installed one)."""
    path = tmp_path / "bin" / "waltz"
    path.parent.mkdir()
    path.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m waltz.cli.main "$@"\n')
    path.chmod(0o755)
    return path


def exec_start(unit: str) -> list[str]:
    """The ExecStart command line of a unit's text (continuation lines joined)."""
    joined = re.sub(r"\\\n\s*", " ", unit)
    line = next(li for li in joined.splitlines() if li.startswith("ExecStart="))
    return shlex.split(line.removeprefix("ExecStart="))


def test_the_three_units_are_there() -> None:
    assert [u.name for u in UNITS] == ["waltz-server.service", "waltz-storage.service", "zookeeper.service"]


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_systemd_analyze_verifies_the_unit(unit: Path, tmp_path: Path, waltz_bin: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    assert analyze is not None, "systemd-analyze missing: run scripts/install-system-deps.sh"
    text = unit.read_text().replace(INSTALLED_WALTZ, str(waltz_bin))
    if unit.name == "zookeeper.service" and not Path(exec_start(text)[0]).exists():
        pytest.fail("java missing: run scripts/install-system-deps.sh")
    copy = tmp_path / unit.name
    copy.write_text(text)
    result = subprocess.run([analyze, "verify", str(copy)], capture_output=True, text=True, timeout=60)
    # A misspelt key is only a warning (exit 0): any output at all is a failure here.
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


@pytest.mark.parametrize("name", ["waltz-storage.service", "waltz-server.service"])
def test_the_units_command_line_is_one_the_cli_accepts(name: str, waltz_bin: Path) -> None:
    argv = exec_start((CONTRIB / "systemd" / name).read_text())
    assert argv[0] == INSTALLED_WALTZ
    # argparse checks every option and choice before it reaches --help, then exits 0.
    result = subprocess.run(
        [str(waltz_bin), *argv[1:], "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr


class ContribZooKeeper(zkserver.ZooKeeperServer):
    """A launcher that runs a given zoo.cfg instead of writing its own."""

    def __init__(self, data_dir: Path, port: int, config_text: str) -> None:
        super().__init__(data_dir, port, die_with_parent=True)
        self.config_text = config_text

    def write_config(self) -> None:
        self.config_path.write_text(self.config_text)


@pytest.fixture
def ensemble_from_contrib(tmp_path: Path) -> Iterator[list[zkserver.ZooKeeperServer]]:
    """Three ZooKeepers on loopback running contrib/zookeeper/zoo.cfg, with only hosts, ports and
    directories changed (and every four-letter word allowed: ``cons`` shows the granted session timeout)."""
    ports = procs.free_ports(9)
    template = (CONTRIB / "zookeeper" / "zoo.cfg").read_text()
    members: list[zkserver.ZooKeeperServer] = []
    try:
        for sid in (1, 2, 3):
            data = tmp_path / f"zk{sid}" / "data"
            data.mkdir(parents=True)
            (data / "myid").write_text(f"{sid}\n")
            port = ports[sid - 1]
            text = template.replace("dataDir=/var/lib/zookeeper", f"dataDir={data}")
            text = text.replace("clientPort=2181", f"clientPort={port}\nclientPortAddress=127.0.0.1")
            text = text.replace("4lw.commands.whitelist=ruok,srvr,stat,mntr", "4lw.commands.whitelist=*")
            for peer in (1, 2, 3):
                text = text.replace(
                    f"server.{peer}=zk{peer}.example.net:2888:3888",
                    f"server.{peer}=127.0.0.1:{ports[1 + 2 * peer]}:{ports[2 + 2 * peer]}",
                )
            members.append(ContribZooKeeper(tmp_path / f"zk{sid}", port, text))
        for member in members:
            member.spawn()
        for member in members:
            member.wait_serving(60)
        yield members
    finally:
        for member in members:
            member.stop()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_contrib_zoo_cfg_runs_an_ensemble_that_grants_2_s_sessions(
    ensemble_from_contrib: list[zkserver.ZooKeeperServer],
) -> None:
    modes = sorted(m.four_letter_word("srvr").split("Mode: ")[1].split()[0] for m in ensemble_from_contrib)
    assert modes == ["follower", "follower", "leader"]
    connect = ",".join(m.connect_string for m in ensemble_from_contrib)
    client = zkutil.connect(connect, session_timeout_ms=2000, connect_timeout_ms=10_000)
    try:
        session = f"sid=0x{client.client_id[0]:x}"
        deadline = time.monotonic() + 10
        while True:
            lines = [line for m in ensemble_from_contrib for line in m.four_letter_word("cons").splitlines()]
            ours = [line for line in lines if session in line]
            if ours or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert ours, lines
        assert "to=2000," in ours[0]
    finally:
        zkutil.close(client)
