"""A standalone storage node (no ZooKeeper to confirm session ids) bounds the step of a new session id
(``storage.maxSessionIdStep``): a forged 2**62 fences nothing and persists nothing, while real sessions, one
id after another, go on (issue 15, item 3)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.integration.storage_process import StorageProcess
from waltz.errors import SessionFencedError
from waltz.protocol.records import Record, ReqId

pytestmark = [pytest.mark.integration]

FORGED = 2**62


def _records(first: int, n: int) -> list[Record]:
    return [Record.build(i, ReqId.of(1, 1, 0, i), 0, b"txn-%d" % i) for i in range(first, first + n)]


@pytest.mark.timeout(60)
def test_a_forged_session_id_is_refused_by_a_standalone_node_and_real_sessions_go_on(tmp_path: Path) -> None:
    sp = StorageProcess(tmp_path, config={"storage.maxSessionIdStep": 100})

    async def main() -> None:
        admin = await sp.admin_client()
        async with admin:
            await admin.set_assigned([0], True)
        data = await sp.data_client()
        async with data:
            await data.append(0, 0, _records(0, 3))
            # The forged id, on the message that fences and on the one that persisted the fence.
            with pytest.raises(SessionFencedError, match=r"storage.maxSessionIdStep allows 100"):
                await data.max_transaction_id(FORGED, 0)
            with pytest.raises(SessionFencedError, match=r"storage.maxSessionIdStep"):
                await data.set_low_water_mark(FORGED, 0, 2**40)
            # Session 0 was not fenced by it: it still writes.
            await data.append(0, 0, _records(3, 2))
            # Real new sessions, within the step of the newest accepted one, fence as always.
            assert await data.max_transaction_id(1, 0) == 4
            with pytest.raises(SessionFencedError):
                await data.append(0, 0, _records(5, 1))
            assert await data.max_transaction_id(101, 0) == 4
            await data.append(101, 0, _records(5, 1))
            with pytest.raises(SessionFencedError, match=r"storage.maxSessionIdStep"):
                await data.max_transaction_id(202, 0)
            await data.append(101, 0, _records(6, 1))
            await data.set_low_water_mark(101, 0, 6)  # as a session does once recovered: persisted

    with sp.start():
        asyncio.run(main())
        assert "refused session id 4611686018427387904" in sp.log_text()
        assert "raise storage.maxSessionIdStep" in sp.log_text()

    # Nothing forged was persisted: after a restart the step is measured from the persisted 101.
    async def after_restart() -> None:
        admin = await sp.admin_client()
        async with admin:
            info = await admin.last_session_info(0)
            assert info.session_id == 101
        data = await sp.data_client()
        async with data:
            with pytest.raises(SessionFencedError, match=r"storage.maxSessionIdStep"):
                await data.max_transaction_id(FORGED, 0)
            assert await data.max_transaction_id(102, 0) == 6
            await data.append(102, 0, _records(7, 1))

    with sp.start():
        asyncio.run(after_restart())
