"""Blocking sockets that speak just enough of the framed protocols to misbehave precisely (frames by hand,
one codec version), for the tests of bad input: :class:`RawConnection` for a storage node's data port, and
the frame reading they share with the hostile peers of ``test_hostile_peers.py`` (:class:`FramedSocket`)."""

from __future__ import annotations

import socket
import struct
import time

from waltz.protocol.framing import MAGIC_HELLO, MAGIC_STORAGE, encode_frame, encode_hello


class FramedSocket:
    """A connected blocking socket that reads whole frames; ``version``: the codec version its frames say."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.version = 0

    def _read_exact(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionResetError("closed")
            buf += chunk
        return buf

    def read_payload(self) -> bytes:
        _, _, length = struct.unpack(">Bhi", self._read_exact(7))
        return self._read_exact(length)

    def closed_by_peer(self, timeout_s: float = 10.0) -> bool:
        """True once the other side closed (or reset) the connection, reading whatever is still queued."""
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                self.sock.settimeout(max(0.01, deadline - time.monotonic()))
                if not self.sock.recv(1 << 20):
                    return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False
        return False

    def close(self) -> None:
        self.sock.close()


class RawConnection(FramedSocket):
    """Connects to a storage node's data port; :meth:`hello` offers one codec version, which every frame
    sent after it then says (the node refuses a frame of another version)."""

    def __init__(self, port: int) -> None:
        super().__init__(socket.create_connection(("127.0.0.1", port), timeout=10))

    def hello(self, version: int = 0) -> None:
        self.version = version
        self.sock.sendall(encode_frame(MAGIC_HELLO, 0, encode_hello((version,), "raw test")))
        self.read_payload()  # the node's hello

    def send_payload(self, payload: bytes) -> None:
        self.sock.sendall(encode_frame(MAGIC_STORAGE, self.version, payload))
