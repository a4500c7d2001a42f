"""client.answerTimeout against a real server (fault-suite seed 309): the client's connection stays open but
nothing the server sends reaches it any more. Without a bound the client waited for ever; with it, the
client reconnects after the timeout, re-mounts from the last transaction it saw, and learns from the feed
that its append committed: reported once, applied once, never executed twice. A data fetch whose answer is
lost on such a connection is asked again on a new one."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from kazoo.client import KazooClient

from tests.integration.client_cluster import (
    CALLBACK_MODES,
    ClientTestCluster,
    RewritingDiscovery,
    Tagged,
    counter_app,
    wait_until,
)
from tests.integration.tcp_proxy import TcpProxy
from waltz import AsyncWaltzClient
from waltz.client.network import NetworkDriver
from waltz.client.reader import LogReader

pytestmark = pytest.mark.integration

ANSWER_TIMEOUT_MS = 1000


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", CALLBACK_MODES)
def test_an_append_whose_answers_are_lost_on_an_open_connection_resolves_after_the_answer_timeout(
    tmp_path: Path, zk: KazooClient, zk_connect_string: str, mode: str
) -> None:
    async def main() -> None:
        async with ClientTestCluster(tmp_path, zk, zk_connect_string) as cluster:
            proxy = await TcpProxy.start_to(cluster.servers[0].port)
            # Data fetches (RPCs) on the muted connection time out after request_timeout_ms; the next one
            # goes on a new connection.
            config = cluster.client_config(
                callback_mode=mode, answer_timeout_ms=ANSWER_TIMEOUT_MS, request_timeout_ms=2000
            )
            app = counter_app(1, mode)
            driver = NetworkDriver(config, discovery=RewritingDiscovery(config, lambda _e: proxy.endpoint))
            try:
                async with AsyncWaltzClient(app, config, driver=driver) as client:
                    first = Tagged(b"before")
                    await client.submit(first)
                    await client.flush_transactions(30)
                    relayed = proxy.relayed
                    proxy.mute()  # The server still gets our append; its feed and answers are lost.
                    ctx = Tagged(b"muted")
                    await client.submit(ctx)
                    async with LogReader(cluster.client_config()) as reader:
                        for _ in range(100):
                            if len([r async for r in reader.read(0)]) == 2:
                                break
                            await asyncio.sleep(0.05)
                    assert ctx.completed is None  # Committed on the server, unheard by the client.
                    await client.flush_transactions(20)
                    assert proxy.relayed > relayed  # It reconnected.
                    assert ctx.completed is True
                    assert ctx.executions == 1  # Found in the feed: never executed (or appended) again.
                    await wait_until(lambda: app.hwm[0] == 1, 10, "the client to apply its append")
                async with LogReader(cluster.client_config()) as reader:
                    records = [r async for r in reader.read(0)]
                assert [r.data for r in records] == [b"before", b"muted"]
                assert app.data(0) == [b"before", b"muted"]
            finally:
                await proxy.aclose()

    asyncio.run(main())
