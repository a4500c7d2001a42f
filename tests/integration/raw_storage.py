"""A blocking socket that speaks just enough of the storage protocol to misbehave precisely (frames by hand,
one codec version), for the storage node's tests of bad input."""

from __future__ import annotations

import socket
import struct

from waltz.protocol.framing import MAGIC_HELLO, MAGIC_STORAGE, encode_frame, encode_hello


class RawConnection:
    """Connects to a storage node's data port; :meth:`hello` offers one codec version, which every frame
    sent after it then says (the node refuses a frame of another version)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.version = 0

    def hello(self, version: int = 0) -> None:
        self.version = version
        self.sock.sendall(encode_frame(MAGIC_HELLO, 0, encode_hello((version,), "raw test")))
        self.read_payload()  # the node's hello

    def send_payload(self, payload: bytes) -> None:
        self.sock.sendall(encode_frame(MAGIC_STORAGE, self.version, payload))

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
        """True once the node closed (or reset) the connection."""
        self.sock.settimeout(timeout_s)
        try:
            while self.sock.recv(65536):
                pass
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        self.sock.close()
