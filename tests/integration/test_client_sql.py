"""Three application processes share one PostgreSQL database through SqlClientCallbacks, each with its own
network client on a real cluster: every transaction is applied to the database exactly once."""

from __future__ import annotations

import asyncio
import multiprocessing
from pathlib import Path

import pytest
import sqlalchemy as sa
from kazoo.client import KazooClient

from tests.integration.client_cluster import (
    SQL_ACCOUNTS,
    SQL_APPLIED,
    ClientTestCluster,
    create_sql_tables,
    run_sql_app,
)
from tests.integration.sql.conftest import pg_url, postgres_server  # noqa: F401 - fixtures
from waltz.client.reader import LogReader

pytestmark = pytest.mark.integration

NUM_INSTANCES = 3
NUM_PARTITIONS = 2
DEPOSITS_PER_INSTANCE = 30
ACCOUNTS = 5
PROCESS_TIMEOUT_S = 180


@pytest.mark.timeout(300)
def test_three_processes_apply_every_transaction_exactly_once_to_one_database(
    tmp_path: Path,
    zk: KazooClient,
    zk_connect_string: str,
    pg_url: str,  # noqa: F811 - the imported fixture
) -> None:
    async def main() -> None:
        async with ClientTestCluster(
            tmp_path, zk, zk_connect_string, num_partitions=NUM_PARTITIONS
        ) as cluster:
            create_sql_tables(pg_url)
            config = cluster.client_config()
            spawn = multiprocessing.get_context("spawn")
            processes = [
                spawn.Process(
                    target=run_sql_app,
                    args=(config, pg_url, instance, DEPOSITS_PER_INSTANCE, ACCOUNTS),
                    name=f"sql-app-{instance}",
                )
                for instance in range(NUM_INSTANCES)
            ]
            for process in processes:
                process.start()
            try:
                for process in processes:
                    await asyncio.to_thread(process.join, PROCESS_TIMEOUT_S)
                    assert process.exitcode == 0, f"{process.name} exited with {process.exitcode}"
            finally:
                for process in processes:
                    if process.is_alive():
                        process.kill()
                        process.join()
            async with LogReader(config) as reader:
                hwms = {p: await reader.high_water_mark(p) for p in range(NUM_PARTITIONS)}

        engine = sa.create_engine(pg_url)
        try:
            with engine.connect() as conn:
                applied = conn.execute(
                    sa.select(SQL_APPLIED.c.partition_id, SQL_APPLIED.c.transaction_id)
                ).all()
                instances = conn.execute(sa.select(SQL_APPLIED.c.instance).distinct()).scalars().all()
                total = conn.execute(sa.select(sa.func.sum(SQL_ACCOUNTS.c.balance))).scalar_one()
        finally:
            engine.dispose()
        # Every transaction of the log is in the database once (the primary key refuses a second row), and
        # nothing else is.
        assert sum(h + 1 for h in hwms.values()) == NUM_INSTANCES * DEPOSITS_PER_INSTANCE
        assert sorted(applied) == sorted((p, t) for p, h in hwms.items() for t in range(h + 1))
        assert total == sum((i + 1) * DEPOSITS_PER_INSTANCE for i in range(NUM_INSTANCES))
        assert set(instances) <= set(range(NUM_INSTANCES))

    asyncio.run(main())
