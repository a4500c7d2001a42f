"""The bank demo's snapshot read on PostgreSQL (``REPEATABLE READ``, where SQLite needs an explicit BEGIN):
a transaction committed between the read of the marks and the read of the accounts does not tear it."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from demo.bank.model import BankDb

from tests.unit.test_bank_snapshot import check_a_snapshot_is_not_torn

pytestmark = pytest.mark.integration


@pytest.mark.timeout(120)
def test_a_snapshot_on_postgresql_is_not_torn(pg_url: str) -> None:
    check_a_snapshot_is_not_torn(BankDb(sa.create_engine(pg_url), "_pg"))
