"""The `waltz storage` admin commands (list, add/remove-partition, availability, max-transaction-id)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from waltz.cli.main import main
from waltz.protocol.records import Record, ReqId
from waltz.server.storage_client import StorageClient

from .storage_process import DEFAULT_KEY, StorageProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

N = 8


@pytest.fixture
def node(tmp_path: Path) -> Iterator[StorageProcess]:
    proc = StorageProcess(tmp_path, num_partitions=N)
    try:
        yield proc.start()
    finally:
        proc.stop()


def cli(node: StorageProcess, *args: str) -> int:
    return main(
        [
            "storage",
            args[0],
            "-s",
            f"127.0.0.1:{node.admin_port}",
            "--cluster-key",
            str(DEFAULT_KEY),
            "--num-partitions",
            str(N),
            *args[1:],
        ]
    )


def test_admin_commands(node: StorageProcess, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(node, "add-partition", "-p", "0-2,5") == 0
    assert cli(node, "list") == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[0] == "partition"
    assert [line.split()[0] for line in out[1:]] == ["0", "1", "2", "5"]
    assert all(line.split()[-1] == "true" for line in out[1:])

    async def append() -> None:
        async with await StorageClient.connect("127.0.0.1", node.port, DEFAULT_KEY, N) as c:
            await c.append(0, 5, [Record.build(i, ReqId(1, i), 0, b"x") for i in range(4)])

    asyncio.run(append())
    assert cli(node, "max-transaction-id", "-p", "5") == 0
    assert capsys.readouterr().out.strip() == "3"
    assert cli(node, "availability", "-p", "1-2", "--online", "false") == 0
    assert cli(node, "list") == 0
    avail = {line.split()[0]: line.split()[-1] for line in capsys.readouterr().out.splitlines()[1:]}
    assert avail == {"0": "true", "1": "false", "2": "false", "5": "true"}
    # Without ZooKeeper the quorum of good copies cannot be checked: deleting files needs --force.
    assert cli(node, "remove-partition", "-p", "5", "--delete-storage-files") == 2
    assert "needs -c/--cli-config-path" in capsys.readouterr().err
    assert (node.directory / "5").exists()
    assert cli(node, "remove-partition", "-p", "5", "--delete-storage-files", "--force") == 0
    assert not (node.directory / "5").exists()
    assert cli(node, "remove-partition", "-p", "0-2") == 0
    assert cli(node, "list") == 0
    assert capsys.readouterr().out.splitlines()[1:] == []


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (("add-partition", "-p", "3-1"), 2, "bad partition range"),
        (("add-partition", "-p", "x"), 2, "expected N or N-M"),
        (("add-partition", "-p", f"0-{N}"), 2, "out of range"),
        (("max-transaction-id", "-p", "99"), 2, "out of range"),
        (("max-transaction-id", "-p", "4"), 1, "not assigned"),
    ],
)
def test_admin_command_errors(
    node: StorageProcess, capsys: pytest.CaptureFixture[str], args: tuple[str, ...], code: int, message: str
) -> None:
    assert cli(node, *args) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert message in err[0]


def test_wrong_key_and_unreachable_node(node: StorageProcess, capsys: pytest.CaptureFixture[str]) -> None:
    wrong = ["storage", "list", "-s", f"127.0.0.1:{node.admin_port}", "--cluster-key"]
    assert main([*wrong, "00000000-0000-0000-0000-000000000001", "--num-partitions", str(N)]) == 1
    assert "does not match" in capsys.readouterr().err
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [
        "storage",
        "list",
        "-s",
        f"127.0.0.1:{port}",
        "--cluster-key",
        str(DEFAULT_KEY),
        "--num-partitions",
        "8",
    ]
    assert main(args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "cannot connect" in err[0]
    assert main(["storage", "list", "-s", "nohostport"]) == 2
    assert (
        main(["storage", "list", "-s", "127.0.0.1:1", "--cluster-key", "not-a-uuid", "--num-partitions", "8"])
        == 2
    )
