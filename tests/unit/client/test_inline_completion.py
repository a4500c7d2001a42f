"""Inline mode: a committed append's ``on_completion`` runs in the loop iteration that delivered its feed
entry, so a lone append's application hears of it before the feed is applied (the documented order:
on_completion, apply_transaction, on_application), one loop pass sooner than a batch flushed in the next."""

from __future__ import annotations

import asyncio

from waltz import AsyncWaltzClient
from waltz.testing import MockDriver

from .helpers import FAST, ApplyOrderCallbacks, Ctx


class OrderCtx(Ctx):
    def __init__(self, data: bytes, events: list[str]) -> None:
        super().__init__(data)
        self.shared = events

    def on_completion(self, result: bool) -> None:
        super().on_completion(result)
        self.shared.append(f"completion:{result}")

    def on_application(self) -> None:
        super().on_application()
        self.shared.append("application")


def test_a_lone_append_completes_before_its_transaction_is_applied() -> None:
    async def main() -> None:
        events: list[str] = []
        client = AsyncWaltzClient(
            ApplyOrderCallbacks(events), FAST.replace(callback_mode="inline"), driver=MockDriver()
        )
        async with client:
            # The first submit may find the partition not mounted yet (the slow path, a task): warm up.
            await client.submit(OrderCtx(b"w", events))
            await client.flush_transactions(timeout=5)
            del events[:]
            for i in range(1, 4):
                await client.submit(OrderCtx(b"x", events))
                await client.flush_transactions(timeout=5)
                assert events[3 * (i - 1) :] == ["completion:True", f"apply:{i}", "application"], events

    asyncio.run(main())


def test_appends_resolved_together_keep_their_hook_order() -> None:
    async def main() -> None:
        events: list[str] = []
        client = AsyncWaltzClient(
            ApplyOrderCallbacks(events), FAST.replace(callback_mode="inline"), driver=MockDriver()
        )
        async with client:
            contexts = [OrderCtx(bytes([i]), events) for i in range(20)]
            for ctx in contexts:
                await client.submit(ctx)
            await client.flush_transactions(timeout=5)
        completions = [e for e in events if e.startswith("completion")]
        applies = [e for e in events if e.startswith("apply")]
        assert completions == ["completion:True"] * 20
        assert applies == [f"apply:{i}" for i in range(20)]
        for ctx in contexts:
            assert ctx.events == ["completion:True", "application"]

    asyncio.run(main())
