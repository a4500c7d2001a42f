"""Run a real ZooKeeper on loopback: one standalone server, or a small ensemble for fault tests.

Uses Debian's ``zookeeper`` package (``/usr/share/java/zookeeper.jar``, whose manifest lists its
dependencies) and ``java``. Each server gets its own directory holding ``zoo.cfg``, its data and its log
(``zookeeper.log``: stdout and stderr of the JVM, logged through slf4j-simple). The process is started in
its own session and stopped by its process id: SIGTERM, then SIGKILL after a grace period.

Configuration choices, and why:

* ``clientPortAddress=127.0.0.1``: nothing listens beyond loopback.
* ``admin.enableServer=false``: the Jetty admin server would take port 8080 and collide between instances.
* ``4lw.commands.whitelist=ruok,srvr,stat``: ``ruok`` is how :meth:`ZooKeeperServer.start` knows it answers.
* ``tickTime`` 500 ms with ``minSessionTimeout`` 1000 and ``maxSessionTimeout`` 60000 (docs/deploy.md's
  recommendation): the servers' 2000 ms session is granted as asked and expires on time (sessions expire on
  tick boundaries), and the 30 s sessions of clients and the CLI are not capped at 20 ticks.

TLS (:class:`ServerTls`, used by ``waltz local up --tls``): the server's port becomes a ``secureClientPort``
served by Netty (``serverCnxnFactory=NettyServerCnxnFactory``; the netty jars that the zookeeper.jar manifest
leaves out, ``netty-codec``, ``netty-resolver`` and ``netty-transport-native-unix-common`` from Debian's
``libnetty-java``, are added to the classpath) and **no plain client port is bound** unless ``plain_port``
asks for one. Key material is PEM: ZooKeeper 3.8 reads the private key and certificate chain from one file,
so the launcher writes ``keystore.pem`` (key then certificate, mode 0600) into the server's directory; the
trust store is the CA file as given. ``ssl.clientAuth=need``: a client without a certificate signed by that
CA is refused during the handshake. ``ssl.hostnameVerification=false``: ZooKeeper would otherwise demand that
a *client's* certificate name the client's address, which client certificates do not do (Waltz's own TLS
ports do not check it either); clients still check the server's name. TLS 1.2 is the minimum, as on Waltz's
ports. Readiness is checked with ``ruok`` over TLS, presenting ``probe_cert_file`` (default: the server's own
certificate, which must then allow clientAuth). In an ensemble with TLS the quorum and election links are TLS
too (``sslQuorum=true`` with the same PEM keystore and CA, ``ssl.quorum.*``): each member presents its
certificate to the others and requires theirs, so its certificate must allow both serverAuth and clientAuth.

Session timeouts: ``minSessionTimeout=1000`` and ``maxSessionTimeout=60000`` are set explicitly, because
ZooKeeper's defaults (2 and 20 ticks) would silently raise a short session or cap a long one; see
docs/deploy.md for the production settings.

Command line: ``python -m waltz.cluster.zkserver [--port P] [--data-dir D] [--ensemble 3]
[--tls-cert C --tls-key K --tls-ca CA]`` runs until interrupted and prints the connect string.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from waltz.cluster.files import mkdir_durable, write_durable
from waltz.config import read_bounded
from waltz.errors import ClusterError, ConfigError

ZOOKEEPER_JAR = Path("/usr/share/java/zookeeper.jar")
SLF4J_BINDING_JAR = Path("/usr/share/java/slf4j-simple.jar")
NETTY_JARS = tuple(
    Path(f"/usr/share/java/{name}.jar")
    for name in ("netty-codec", "netty-resolver", "netty-transport-native-unix-common")
)
"""What NettyServerCnxnFactory (hence TLS) needs beyond the netty jars zookeeper.jar's manifest lists."""
MAIN_CLASS = "org.apache.zookeeper.server.quorum.QuorumPeerMain"
INSTALL_HINT = "install Debian's zookeeper package: apt-get install zookeeper"
NETTY_INSTALL_HINT = (
    "install Debian's libnetty-java package (a dependency of zookeeper): apt-get install libnetty-java"
)
DEFAULT_START_TIMEOUT_S = 30.0
STOP_GRACE_S = 5.0
MAX_PEM_BYTES = 1024 * 1024
"""The largest certificate or key file read (as :mod:`waltz.tls` does): /dev/zero must not fill memory."""


def find_java() -> str:
    java = shutil.which("java") or ("/usr/bin/java" if Path("/usr/bin/java").exists() else None)
    if java is None:
        raise ClusterError(f"java not found; {INSTALL_HINT}")
    return java


def classpath(*, tls: bool = False) -> str:
    """The classpath of Debian's ZooKeeper (with the netty jars TLS needs when ``tls``); ClusterError with the
    install hint if something is missing."""
    if not ZOOKEEPER_JAR.exists():
        raise ClusterError(f"ZooKeeper is not installed ({ZOOKEEPER_JAR} missing); {INSTALL_HINT}")
    jars = [str(ZOOKEEPER_JAR)]
    if SLF4J_BINDING_JAR.exists():
        jars.append(str(SLF4J_BINDING_JAR))
    if tls:
        missing = [str(j) for j in NETTY_JARS if not j.exists()]
        if missing:
            raise ClusterError(f"ZooKeeper over TLS needs {', '.join(missing)}; {NETTY_INSTALL_HINT}")
        jars += [str(j) for j in NETTY_JARS]
    return ":".join(jars)


@dataclass(frozen=True)
class ServerTls:
    """TLS on a :class:`ZooKeeperServer`'s client port (module docstring): PEM files, mutual TLS.

    ``plain_port``: also bind a plain client port there (None: none, the default).
    ``probe_cert_file``/``probe_key_file``: the client certificate the readiness check presents (default: the
    server's own).
    """

    cert_file: Path
    key_file: Path
    ca_file: Path
    plain_port: int | None = None
    probe_cert_file: Path | None = None
    probe_key_file: Path | None = None

    def keystore_pem(self) -> bytes:
        """The private key, then the certificate chain: the one-file PEM keystore ZooKeeper 3.8 reads."""
        key = _read_pem(self.key_file, "private key", "PRIVATE KEY-----")
        if b"ENCRYPTED" in key:
            raise ConfigError(f"ZooKeeper TLS: {self.key_file} is encrypted; give an unencrypted key")
        if b"-----BEGIN PRIVATE KEY-----" not in key:
            # ZooKeeper 3.8 reads PKCS#8 only; given an "EC/RSA PRIVATE KEY" it logs an exception, runs on
            # and never answers on its port, which would show here as nothing but a start time-out.
            raise ConfigError(
                f"ZooKeeper TLS: {self.key_file} is not a PKCS#8 key (BEGIN PRIVATE KEY), the only form "
                f"ZooKeeper reads; convert it with: openssl pkcs8 -topk8 -nocrypt -in {self.key_file}"
            )
        cert = _read_pem(self.cert_file, "certificate", "-----BEGIN CERTIFICATE-----")
        _read_pem(self.ca_file, "CA certificate", "-----BEGIN CERTIFICATE-----")
        return key.rstrip(b"\n") + b"\n" + cert

    def probe_context(self) -> ssl.SSLContext:
        """The readiness check's context: trusts the CA, presents the probe (or server) certificate."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.check_hostname = False  # The launcher knows whom it started; the certificate's chain is checked.
        ctx.load_verify_locations(cafile=str(self.ca_file))
        ctx.load_cert_chain(
            str(self.probe_cert_file or self.cert_file), str(self.probe_key_file or self.key_file)
        )
        return ctx


def _read_pem(path: Path, what: str, marker: str) -> bytes:
    try:
        data = read_bounded(path, MAX_PEM_BYTES)
    except ValueError:
        raise ConfigError(f"ZooKeeper TLS: {what} {path} holds more than {MAX_PEM_BYTES} bytes") from None
    except OSError as e:
        raise ConfigError(f"ZooKeeper TLS: cannot read {what} {path}: {e.strerror or e}") from None
    if marker.encode() not in data:
        raise ConfigError(f"ZooKeeper TLS: {path} holds no PEM {what}")
    return data


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def four_letter_word(
    host: str, port: int, word: str, timeout_s: float = 1.0, *, ssl_context: ssl.SSLContext | None = None
) -> str:
    """Send a ZooKeeper four-letter command (over TLS with ``ssl_context``) and return the answer ('' if the
    server does not answer, or refuses the handshake)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw:
            s = ssl_context.wrap_socket(raw, server_hostname=host) if ssl_context is not None else raw
            with s:
                s.sendall(word.encode("ascii"))
                chunks = []
                total = 0
                # Bounded: srvr/stat answers are a few hundred bytes.
                while total < 1024 * 1024:
                    chunk = s.recv(4096)
                    if not chunk:
                        break
                    chunks.append(chunk)
                    total += len(chunk)
                return b"".join(chunks).decode("utf-8", "replace")
    except OSError:  # ssl.SSLError is an OSError
        return ""


def die_with_parent_prefix() -> list[str]:
    """The command prefix that makes a child get SIGKILL when the thread that forked it ends: util-linux's
    ``setpriv --pdeathsig KILL`` (the flag survives the exec). Empty where setpriv is missing (not Linux):
    the child then outlives a killed parent, as any child does. ``prctl`` from a ``preexec_fn`` would do the
    same without the extra exec, but ``preexec_fn`` is unsafe in a process with threads (kazoo's, pytest's).
    """
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []


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
        tls: ServerTls | None = None,
        die_with_parent: bool = False,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.host = host
        self.port = port or free_port(host)
        """The client port: the secure one with ``tls``."""
        self.tick_time_ms = tick_time_ms
        self.server_id = server_id
        self.peers = peers
        self.tls = tls
        self.die_with_parent = die_with_parent
        """The JVM is killed when the thread that started it ends (Linux ``PR_SET_PDEATHSIG``, set through
        util-linux's ``setpriv``), so a throwaway server of a test run killed with SIGKILL does not outlive
        it. Off for ``waltz local``, whose ZooKeeper outlives the ``up`` command by design."""
        self.process: subprocess.Popen[bytes] | None = None
        self._probe_ssl: ssl.SSLContext | None = None

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
    def keystore_path(self) -> Path:
        return self.data_dir / "keystore.pem"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def write_config(self) -> None:
        # Every directory and file laid out here is durable before ZooKeeper starts on it (see
        # waltz.cluster.files): a power cut must not take the data directory's entry, and with it the
        # transactions ZooKeeper fsynced inside, nor leave a torn zoo.cfg or myid.
        data = self.data_dir / "data"
        mkdir_durable(data)
        lines = [
            f"tickTime={self.tick_time_ms}",
            f"dataDir={data}",
            *self._port_lines(),
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
            write_durable(data / "myid", f"{self.server_id}\n".encode("ascii"))
            for sid, quorum_port, election_port in self.peers:
                lines.append(f"server.{sid}={self.host}:{quorum_port}:{election_port}")
            if self.tls is not None:
                lines += self._quorum_tls_lines()
        write_durable(self.config_path, ("\n".join(lines) + "\n").encode("ascii"))

    def _port_lines(self) -> list[str]:
        if self.tls is None:
            return [f"clientPort={self.port}", f"clientPortAddress={self.host}"]
        write_durable(self.keystore_path, self.tls.keystore_pem(), mode=0o600)
        lines = []
        if self.tls.plain_port is not None:
            lines += [f"clientPort={self.tls.plain_port}", f"clientPortAddress={self.host}"]
        return [
            *lines,
            f"secureClientPort={self.port}",
            f"secureClientPortAddress={self.host}",
            "serverCnxnFactory=org.apache.zookeeper.server.NettyServerCnxnFactory",
            f"ssl.keyStore.location={self.keystore_path}",
            "ssl.keyStore.type=PEM",
            f"ssl.trustStore.location={self.tls.ca_file}",
            "ssl.trustStore.type=PEM",
            "ssl.clientAuth=need",
            "ssl.hostnameVerification=false",
            "ssl.enabledProtocols=TLSv1.3,TLSv1.2",
        ]

    def _quorum_tls_lines(self) -> list[str]:
        """TLS on the links between ensemble members, with the client port's keystore and CA."""
        assert self.tls is not None
        return [
            "sslQuorum=true",
            f"ssl.quorum.keyStore.location={self.keystore_path}",
            "ssl.quorum.keyStore.type=PEM",
            f"ssl.quorum.trustStore.location={self.tls.ca_file}",
            "ssl.quorum.trustStore.type=PEM",
            "ssl.quorum.enabledProtocols=TLSv1.3,TLSv1.2",
            # Members reach each other on 127.0.0.1, which the local certificates name.
            "ssl.quorum.hostnameVerification=true",
        ]

    def spawn(self) -> None:
        """Start the JVM without waiting for it to answer."""
        if self.process is not None and self.process.poll() is None:
            return
        mkdir_durable(self.data_dir)
        self.write_config()
        cmd = [
            find_java(),
            "-Xmx256m",
            "-XX:+UseSerialGC",
            "-Dorg.slf4j.simpleLogger.showDateTime=true",
            "-Dorg.slf4j.simpleLogger.dateTimeFormat=HH:mm:ss.SSS",
            "-Dzookeeper.jmx.log4j.disable=true",
            "-cp",
            classpath(tls=self.tls is not None),
            MAIN_CLASS,
            str(self.config_path),
        ]
        if self.die_with_parent:
            cmd = [*die_with_parent_prefix(), *cmd]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def probe_ssl_context(self) -> ssl.SSLContext | None:
        """The context :meth:`four_letter_word` needs on this server's port (None without TLS)."""
        if self.tls is None:
            return None
        if self._probe_ssl is None:
            try:
                self._probe_ssl = self.tls.probe_context()
            except (ssl.SSLError, OSError) as e:
                raise ConfigError(
                    f"ZooKeeper TLS: cannot load the readiness check's certificate: {e}"
                ) from None
        return self._probe_ssl

    def four_letter_word(self, word: str, timeout_s: float = 1.0) -> str:
        """:func:`four_letter_word` on this server's client port, over TLS when it serves TLS."""
        return four_letter_word(self.host, self.port, word, timeout_s, ssl_context=self.probe_ssl_context())

    def is_serving(self) -> bool:
        # A TLS handshake with a JVM that has just started can take more than a second on a loaded machine.
        timeout_s = 3.0 if self.tls is not None else 1.0
        return self.four_letter_word("ruok", timeout_s) == "imok" and "Mode:" in self.four_letter_word(
            "srvr", timeout_s
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

    def __init__(
        self, base_dir: str | Path, size: int = 3, *, tick_time_ms: int = 500, die_with_parent: bool = False
    ) -> None:
        if size < 1:
            raise ValueError("an ensemble needs at least one server")
        base = Path(base_dir)
        peers = [(i + 1, free_port(), free_port()) for i in range(size)]
        self.servers = [
            ZooKeeperServer(
                base / f"zk{sid}",
                tick_time_ms=tick_time_ms,
                server_id=sid,
                peers=peers,
                die_with_parent=die_with_parent,
            )
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
    parser.add_argument("--tls-cert", metavar="PEM", help="serve TLS only, with this certificate")
    parser.add_argument("--tls-key", metavar="PEM", help="its private key")
    parser.add_argument("--tls-ca", metavar="PEM", help="CA that client certificates must chain to")
    args = parser.parse_args(argv)
    tls_args = (args.tls_cert, args.tls_key, args.tls_ca)
    if any(tls_args) and not all(tls_args):
        parser.error("TLS needs --tls-cert, --tls-key and --tls-ca")
    if any(tls_args) and args.ensemble > 1:
        parser.error("TLS is for a standalone server")
    tls = ServerTls(Path(args.tls_cert), Path(args.tls_key), Path(args.tls_ca)) if all(tls_args) else None
    data_dir = Path(args.data_dir or tempfile.mkdtemp(prefix="waltz-zk-"))
    zk: ZooKeeperServer | ZooKeeperEnsemble
    # Before starting: a SIGTERM during the start raises SystemExit in it, and start() stops the JVM it
    # spawned (the JVM runs in its own session, so nothing else would).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        if args.ensemble > 1:
            zk = ZooKeeperEnsemble(data_dir, args.ensemble).start()
        else:
            zk = ZooKeeperServer(data_dir, args.port, tls=tls).start()
    except (ClusterError, ConfigError) as e:
        print(f"zkserver: error: {e}", file=sys.stderr)
        return 1
    print(zk.connect_string, flush=True)
    print(f"data and logs in {data_dir}; Ctrl-C to stop", file=sys.stderr, flush=True)
    try:
        while True:
            time.sleep(3600)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        zk.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
