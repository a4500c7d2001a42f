"""A transaction larger than the connection's frame limit can never be sent. It used to be treated as a lost
append: executed again and again (25 times in 15 s), never ending, and holding up ``flush_transactions`` for
every other context. It now ends at once with ``on_exception(LocalProtocolError)``; the appends around it
commit as usual, alone or pipelined with it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from kazoo.client import KazooClient

from tests.integration.client_cluster import CALLBACK_MODES, ClientTestCluster, Tagged, counter_app
from waltz import AsyncWaltzClient
from waltz.client.reader import LogReader
from waltz.errors import LocalProtocolError
from waltz.protocol.framing import DEFAULT_MAX_FRAME_BYTES

pytestmark = pytest.mark.integration

TOO_LARGE = b"x" * (DEFAULT_MAX_FRAME_BYTES + 1)


async def _submit(client: AsyncWaltzClient, ctx: Tagged) -> None:
    try:
        await client.submit(ctx)
    except LocalProtocolError:
        pass  # A first attempt's failure may also be raised from submit; on_exception is checked below.


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", CALLBACK_MODES)
def test_an_append_over_the_frame_limit_fails_once_and_the_others_commit(
    tmp_path: Path, zk: KazooClient, zk_connect_string: str, mode: str
) -> None:
    async def main() -> None:
        async with ClientTestCluster(tmp_path, zk, zk_connect_string) as cluster:
            config = cluster.client_config(callback_mode=mode, max_concurrent_transactions=64)
            async with AsyncWaltzClient(counter_app(1, mode), config) as client:
                alone = Tagged(TOO_LARGE)
                await _submit(client, alone)
                await client.flush_transactions(20)
                # Pipelined: sent in the same loop pass as small appends before and after it.
                before = [Tagged(b"before-%d" % i) for i in range(10)]
                among = Tagged(TOO_LARGE)
                after = [Tagged(b"after-%d" % i) for i in range(10)]
                for ctx in [*before, among, *after]:
                    await _submit(client, ctx)
                await client.flush_transactions(20)
            for big in (alone, among):
                assert isinstance(big.exception, LocalProtocolError), big.exception
                assert big.completed is None
                assert big.executions == 1  # Never executed again.
            assert all(ctx.completed is True for ctx in [*before, *after])
            async with LogReader(cluster.client_config()) as reader:
                records = [r async for r in reader.read(0)]
            assert sorted(r.data for r in records) == sorted(ctx.tag for ctx in [*before, *after])

    asyncio.run(main())
