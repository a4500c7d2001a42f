"""A committed batch sent live to many clients is framed once per protocol version, not once per client
(``Partition._feed_batch`` hands every peer one ``frames`` dict; ``ClientConnection.send_feed`` fills it)."""

from __future__ import annotations

from typing import Any, cast

import pytest

from waltz.protocol import client_server as cs
from waltz.server import connection as connection_module
from waltz.server.connection import ClientConnection

VERSIONS = sorted(cs.SUPPORTED_VERSIONS)
ENTRIES = [(7, 1, 2, 0), (8, 1, 3, 0)]


class FakeConn:
    def __init__(self, version: int) -> None:
        self.negotiated_version = version
        self.sent: list[bytes] = []
        self.is_closed = False

    def send(self, data: bytes, framed: bool = False) -> None:
        assert framed
        self.sent.append(data)


def _connections(versions: list[int]) -> tuple[list[FakeConn], list[ClientConnection]]:
    conns = [FakeConn(v) for v in versions]
    return conns, [ClientConnection(cast(Any, c), 8, 1 << 20) for c in conns]


def test_clients_of_one_version_share_one_framing(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = cs.frame_feed_entries

    def counting(entries: Any, version: int) -> bytes:
        calls.append(version)
        return real(entries, version)

    monkeypatch.setattr(connection_module.cs, "frame_feed_entries", counting)
    conns, clients = _connections([VERSIONS[-1]] * 32 + [VERSIONS[0]] * 3)
    frames: dict[int, bytes] = {}
    for client in clients:
        client.send_feed(ENTRIES, frames)

    assert sorted(calls) == sorted({VERSIONS[-1], VERSIONS[0]})
    for conn in conns:
        assert conn.sent == [real(ENTRIES, conn.negotiated_version)]


def test_without_frames_each_client_frames_its_own() -> None:
    conns, clients = _connections([VERSIONS[-1]] * 2)
    for client in clients:
        client.send_feed(ENTRIES)
    assert [c.sent for c in conns] == [[cs.frame_feed_entries(ENTRIES, VERSIONS[-1])]] * 2
