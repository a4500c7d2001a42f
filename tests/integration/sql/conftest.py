"""A real PostgreSQL for the SQL callback tests: Debian's ``postgresql-15`` binaries, one server per session.

``postgres_server``  session-scoped: ``initdb`` into a fresh directory under /tmp, ``pg_ctl start`` on a free
                     127.0.0.1 port with its Unix socket in that directory, trust authentication for the
                     superuser ``waltz``; stopped (``-m fast``) and deleted at the end. When the tests run as
                     root (PostgreSQL refuses to), the server runs as the ``postgres`` OS user through
                     ``runuser`` and the directory is handed to that user. Skips if the binaries are missing.
``pg_url``           a fresh database per test; dropped afterwards.
When a test using the server fails, the tail of the server log is added to its report.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa


def _default_pg_bin() -> Path:
    """The newest PostgreSQL Debian installed (``/usr/lib/postgresql/<major>/bin``)."""
    found = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"),
        key=lambda p: int(p.parent.parent.name),
        reverse=True,
    )
    return found[0].parent if found else Path("/usr/lib/postgresql/15/bin")


PG_BIN = Path(os.environ["WALTZ_PG_BIN"]) if "WALTZ_PG_BIN" in os.environ else _default_pg_bin()
PG_USER = "waltz"
START_TIMEOUT_S = 60


@dataclass(frozen=True)
class PostgresServer:
    port: int
    base: Path

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg2://{PG_USER}@127.0.0.1:{self.port}/{database}"

    @property
    def log_file(self) -> Path:
        return self.base / "postgres.log"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _runner() -> list[str]:
    """PostgreSQL will not run as root: run its binaries as the ``postgres`` user then."""
    if os.geteuid() != 0:
        return []
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        pytest.fail(
            "running as root and there is no 'postgres' OS user to run PostgreSQL as: install Debian's "
            "postgresql package (make test does: scripts/install-system-deps.sh)"
        )
    runuser = shutil.which("runuser")
    if runuser is not None:
        return [runuser, "-u", "postgres", "--"]
    return ["su", "postgres", "-s", "/bin/sh", "-c", 'exec "$0" "$@"']


def _run(cmd: list[str], base: Path) -> None:
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=START_TIMEOUT_S, check=False, cwd=base
    )
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    if not (PG_BIN / "initdb").exists():
        pytest.fail(
            f"PostgreSQL binaries not found in {PG_BIN}: install Debian's postgresql package "
            "(make test does: scripts/install-system-deps.sh) or set WALTZ_PG_BIN"
        )
    runner = _runner()
    # Not under pytest's tmp_path: its parents are private to root, and the postgres user must reach it.
    base = Path(tempfile.mkdtemp(prefix="waltz-pg-"))
    if runner:
        info = pwd.getpwnam("postgres")
        os.chown(base, info.pw_uid, info.pw_gid)
    data = base / "data"
    port = _free_port()
    server = PostgresServer(port, base)
    _run(
        [
            *runner,
            str(PG_BIN / "initdb"),
            "-D",
            str(data),
            "-U",
            PG_USER,
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-sync",
        ],
        base,
    )
    options = f"-p {port} -k {base} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=100"
    try:
        _run(
            [
                *runner,
                str(PG_BIN / "pg_ctl"),
                "-D",
                str(data),
                "-l",
                str(server.log_file),
                "-o",
                options,
                "-w",
                "-t",
                str(START_TIMEOUT_S),
                "start",
            ],
            base,
        )
        yield server
    finally:
        subprocess.run(
            [*runner, str(PG_BIN / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"],
            capture_output=True,
            timeout=START_TIMEOUT_S,
            check=False,
            cwd=base,
        )
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def pg_url(postgres_server: PostgresServer, request: pytest.FixtureRequest) -> Iterator[str]:
    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(postgres_server.url(), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"CREATE DATABASE {name}")
        yield postgres_server.url(name)
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    finally:
        admin.dispose()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report: pytest.TestReport = yield
    if report.failed and "postgres_server" in getattr(item, "fixturenames", ()):
        server = item.funcargs.get("postgres_server") if hasattr(item, "funcargs") else None
        if isinstance(server, PostgresServer) and server.log_file.exists():
            tail = server.log_file.read_text(errors="replace").splitlines()[-40:]
            report.sections.append(("postgres log (tail)", "\n".join(tail)))
    return report
