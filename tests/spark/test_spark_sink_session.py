"""The write session a Python worker keeps between tasks (waltz.spark.writer._borrow_session), on a real
cluster: the next task reuses the client, a failed task's client is closed, an idle one closes itself."""

from __future__ import annotations

import time
import uuid

import pytest

from tests.spark.conftest import WaltzTestCluster
from waltz.errors import ClientError
from waltz.spark import writer
from waltz.spark.options import parse_options

pytestmark = pytest.mark.timeout(120)


def pooled_client_id(options: dict[str, str]) -> int | None:
    idle = writer._idle_sessions.get(parse_options(options).cluster_key)
    return None if idle is None else idle[0].client.client_id


def tagged(tag: str, count: int) -> list[dict[str, object]]:
    return [{"partition": i % 3, "data": f"{tag}-{i}".encode()} for i in range(count)]


def landed(cluster: WaltzTestCluster, tag: str) -> list[bytes]:
    return sorted(r.data for p in range(3) for r in cluster.read_all(p) if r.data.startswith(tag.encode()))


def test_the_next_task_reuses_the_client_and_a_failed_task_closes_it(
    waltz_cluster: WaltzTestCluster,
) -> None:
    writer.close_idle_sessions()
    options = parse_options(waltz_cluster.options)
    a, b, c, d = (uuid.uuid4().hex for _ in range(4))
    assert writer.RowWriter(options, 3).append_rows(tagged(a, 50)).appended == 50
    first = pooled_client_id(waltz_cluster.options)
    assert first is not None
    assert writer.RowWriter(options, 3).append_rows(tagged(b, 50)).appended == 50
    assert pooled_client_id(waltz_cluster.options) == first  # the same client, kept open between tasks
    # A task whose second batch holds a bad row fails after its first batch was submitted: its client is
    # closed, not handed to the next task.
    with pytest.raises(ClientError, match="partition 9"):
        writer.RowWriter(options, 3).append_rows(
            [*tagged(c, writer.BATCH_ROWS), {"partition": 9, "data": b"x"}]
        )
    assert pooled_client_id(waltz_cluster.options) is None
    assert writer.RowWriter(options, 3).append_rows(tagged(d, 10)).appended == 10
    assert pooled_client_id(waltz_cluster.options) not in (None, first)
    for tag, count in ((a, 50), (b, 50), (c, writer.BATCH_ROWS), (d, 10)):
        assert landed(waltz_cluster, tag) == sorted(r["data"] for r in tagged(tag, count))
    writer.close_idle_sessions()


def test_an_idle_session_closes_itself(
    waltz_cluster: WaltzTestCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer.close_idle_sessions()
    monkeypatch.setattr(writer, "SESSION_IDLE_CLOSE_S", 0.2)
    writer.RowWriter(parse_options(waltz_cluster.options), 3).append_rows(tagged(uuid.uuid4().hex, 5))
    (session, _) = writer._idle_sessions[parse_options(waltz_cluster.options).cluster_key]
    deadline = time.monotonic() + 10
    while pooled_client_id(waltz_cluster.options) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pooled_client_id(waltz_cluster.options) is None
    with pytest.raises(Exception, match="closed"):
        session.client.high_water_mark(0)
