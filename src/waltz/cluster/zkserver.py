"""Run a real ZooKeeper on loopback: one standalone server, or a small ensemble for fault tests.

Uses Debian's ``zookeeper`` package (``/usr/share/java/zookeeper.jar``, whose manifest lists its
dependencies) and ``java``. Each server gets its own directory holding ``zoo.cfg``, its data and its log
(``zookeeper.log``: stdout and stderr of the JVM, logged through slf4j-simple). The process is started in
its own session and stopped by its process id: SIGTERM, then SIGKILL after a grace period.

Configuration choices, and why:

* ``clientPortAddress=127.0.0.1``: nothing listens beyond loopback.
* ``admin.enableServer=false``: the Jetty admin server would take port 8080 and collide between instances.
* ``4lw.commands.whitelist=ruok,srvr,stat``: ``ruok`` is how :meth:`ZooKeeperServer.start` knows it answers.
* ``tickTime`` 500 ms with ``minSessionTimeout`` 1000 and ``maxSessionTimeout`` 60000: tests can use short
  session timeouts, and the production default of 30 s is still honoured (not capped at 20 ticks).

Command line: ``python -m waltz.cluster.zkserver [--port P] [--data-dir D] [--ensemble 3]`` runs until
interrupted and prints the connect string.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

from waltz.errors import ClusterError

ZOOKEEPER_JAR = Path("/usr/share/java/zookeeper.jar")
SLF4J_BINDING_JAR = Path("/usr/share/java/slf4j-simple.jar")
MAIN_CLASS = "org.apache.zookeeper.server.quorum.QuorumPeerMain"
INSTALL_HINT = "install Debian's zookeeper package: apt-get install zookeeper"
DEFAULT_START_TIMEOUT_S = 30.0
STOP_GRACE_S = 5.0


def find_java() -> str:
    java = shutil.which("java") or ("/usr/bin/java" if Path("/usr/bin/java").exists() else None)
    if java is None:
        raise ClusterError(f"java not found; {INSTALL_HINT}")
    return java


def classpath() -> str:
    """The classpath of Debian's ZooKeeper; ClusterError with the install hint if it is missing."""
    if not ZOOKEEPER_JAR.exists():
        raise ClusterError(f"ZooKeeper is not installed ({ZOOKEEPER_JAR} missing); {INSTALL_HINT}")
    jars = [str(ZOOKEEPER_JAR)]
    if SLF4J_BINDING_JAR.exists():
        jars.append(str(SLF4J_BINDING_JAR))
    return ":".join(jars)


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def four_letter_word(host: str, port: int, word: str, timeout_s: float = 1.0) -> str:
    """Send a ZooKeeper four-letter command and return the answer ('' if the server does not answer)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.sendall(word.encode("ascii"))
            chunks = []
            while True:
                chunk = s.recv(4096)
                if not chunk:
                    break
                chunks.append(chunk)
            return b"".join(chunks).decode("utf-8", "replace")
    except OSError:
        return ""


class ZooKeeperServer:
    """One ZooKeeper process on loopback, standalone or as a member of a :class:`ZooKeeperEnsemble`.

    ``with ZooKeeperServer(tmp) as zk: zk.connect_string`` starts it and always stops it.
    """

    def __init__(
        self,
        data_dir: str | Path,
        port: int | None = None,
        *,
        host: str = "127.0.0.1",
        tick_time_ms: int = 500,
        server_id: int | None = None,
        peers: list[tuple[int, int, int]] | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.host = host
        self.port = port or free_port(host)
        self.tick_time_ms = tick_time_ms
        self.server_id = server_id
        self.peers = peers
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def connect_string(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "zookeeper.log"

    @property
    def config_path(self) -> Path:
        return self.data_dir / "zoo.cfg"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def write_config(self) -> None:
        data = self.data_dir / "data"
        data.mkdir(parents=True, exist_ok=True)
        lines = [
            f"tickTime={self.tick_time_ms}",
            f"dataDir={data}",
            f"clientPort={self.port}",
            f"clientPortAddress={self.host}",
            "admin.enableServer=false",
            "4lw.commands.whitelist=ruok,srvr,stat",
            "minSessionTimeout=1000",
            "maxSessionTimeout=60000",
            "maxClientCnxns=200",
            "initLimit=20",
            "syncLimit=10",
            "autopurge.purgeInterval=0",
        ]
        if self.peers:
            assert self.server_id is not None
            (data / "myid").write_text(f"{self.server_id}\n", encoding="ascii")
            for sid, quorum_port, election_port in self.peers:
                lines.append(f"server.{sid}={self.host}:{quorum_port}:{election_port}")
        self.config_path.write_text("\n".join(lines) + "\n", encoding="ascii")

    def spawn(self) -> None:
        """Start the JVM without waiting for it to answer."""
        if self.process is not None and self.process.poll() is None:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.write_config()
        cmd = [
            find_java(),
            "-Xmx256m",
            "-XX:+UseSerialGC",
            "-Dorg.slf4j.simpleLogger.showDateTime=true",
            "-Dorg.slf4j.simpleLogger.dateTimeFormat=HH:mm:ss.SSS",
            "-Dzookeeper.jmx.log4j.disable=true",
            "-cp",
            classpath(),
            MAIN_CLASS,
            str(self.config_path),
        ]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def is_serving(self) -> bool:
        return four_letter_word(self.host, self.port, "ruok") == "imok" and "Mode:" in four_letter_word(
            self.host, self.port, "srvr"
        )

    def wait_serving(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise ClusterError(
                    f"ZooKeeper exited with status {self.process.returncode}; see {self.log_path}"
                    f"\n{self.log_tail(20)}"
                )
            if self.is_serving():
                return
            time.sleep(0.1)
        raise ClusterError(f"ZooKeeper did not answer on {self.connect_string} within {timeout_s:g} s")

    def start(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> ZooKeeperServer:
        """Start the server and wait until it answers ``ruok``; stops it again if it does not."""
        self.spawn()
        try:
            self.wait_serving(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stop the process by pid: SIGTERM, then SIGKILL after ``grace_s``. Idempotent."""
        proc = self.process
        if proc is None or proc.poll() is not None:
            return
        try:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=grace_s)
        except ProcessLookupError:
            proc.wait(timeout=grace_s)

    def kill(self) -> None:
        """SIGKILL, as in a crash."""
        proc = self.process
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=STOP_GRACE_S)

    def log_tail(self, lines: int = 100) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> ZooKeeperServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class ZooKeeperEnsemble:
    """``size`` ZooKeeper servers forming one quorum on loopback (for tests of ZooKeeper failures)."""

    def __init__(self, base_dir: str | Path, size: int = 3, *, tick_time_ms: int = 500) -> None:
        if size < 1:
            raise ValueError("an ensemble needs at least one server")
        base = Path(base_dir)
        peers = [(i + 1, free_port(), free_port()) for i in range(size)]
        self.servers = [
            ZooKeeperServer(base / f"zk{sid}", tick_time_ms=tick_time_ms, server_id=sid, peers=peers)
            for sid, _, _ in peers
        ]

    @property
    def connect_string(self) -> str:
        return ",".join(s.connect_string for s in self.servers)

    def start(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> ZooKeeperEnsemble:
        try:
            for s in self.servers:
                s.spawn()
            for s in self.servers:
                s.wait_serving(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for s in self.servers:
            s.stop()

    def log_tail(self, lines: int = 50) -> str:
        return "\n".join(f"--- {s.connect_string} ---\n{s.log_tail(lines)}" for s in self.servers)

    def __enter__(self) -> ZooKeeperEnsemble:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m waltz.cluster.zkserver", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--port", type=int, default=None, help="client port (default: a free one)")
    parser.add_argument("--data-dir", default=None, help="directory for config, data and log (default: temp)")
    parser.add_argument("--ensemble", type=int, default=1, metavar="N", help="run N servers as one quorum")
    args = parser.parse_args(argv)
    data_dir = Path(args.data_dir or tempfile.mkdtemp(prefix="waltz-zk-"))
    zk: ZooKeeperServer | ZooKeeperEnsemble
    try:
        if args.ensemble > 1:
            zk = ZooKeeperEnsemble(data_dir, args.ensemble).start()
        else:
            zk = ZooKeeperServer(data_dir, args.port).start()
    except ClusterError as e:
        print(f"zkserver: error: {e}", file=sys.stderr)
        return 1
    print(zk.connect_string, flush=True)
    print(f"data and logs in {data_dir}; Ctrl-C to stop", file=sys.stderr, flush=True)
    try:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        while True:
            time.sleep(3600)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        zk.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
