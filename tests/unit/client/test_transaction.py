"""``Transaction`` objects made in bulk for a feed run are the ones ``Transaction(...)`` makes."""

from __future__ import annotations

from waltz.client.transaction import Transaction, new_transactions
from waltz.protocol.records import ReqId


class _Source:
    def fetch_blocking(self, partition_id: int, transaction_id: int) -> bytes:
        return b"data %d/%d" % (partition_id, transaction_id)

    async def fetch(self, partition_id: int, transaction_id: int) -> bytes:
        return self.fetch_blocking(partition_id, transaction_id)


def test_new_transactions_sets_every_slot_as_the_constructor_does() -> None:
    source = _Source()
    entries = [(5, ReqId.of(1, 2, 3, 4), 7), (6, ReqId.of(1, 2, 3, 5), -1)]
    made = new_transactions(3, entries, source)
    expected = [Transaction(3, tid, header, req_id, source) for tid, req_id, header in entries]
    assert len(made) == len(expected)
    for got, want in zip(made, expected, strict=True):
        assert type(got) is Transaction
        # Every slot, so one added to __init__ and not here fails this test.
        for slot in Transaction.__slots__:
            assert getattr(got, slot) == getattr(want, slot), slot
    assert made[1].get_transaction_data() == b"data 3/6"
    assert new_transactions(3, [], source) == []
