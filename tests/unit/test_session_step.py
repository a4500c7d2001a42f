"""The bound a standalone storage node puts on new session ids (``storage.maxSessionIdStep``)."""

from __future__ import annotations

from waltz.storage.authority import step_refusal
from waltz.storage.config import StorageConfig

BASE = {
    "storage.port": 5000,
    "storage.admin.port": 5001,
    "storage.directory": "/data/waltz",
    "storage.cluster.key": "3e1d2c4b-5a69-4788-8796-a5b4c3d2e1f0",
    "storage.cluster.numPartitions": 4,
}


def test_the_default_step_is_a_million_and_configurable() -> None:
    assert StorageConfig.from_mapping(dict(BASE)).max_session_id_step == 1_000_000
    assert StorageConfig.from_mapping({**BASE, "storage.maxSessionIdStep": 10}).max_session_id_step == 10


def test_a_step_up_to_the_bound_is_accepted() -> None:
    assert step_refusal(1, 0, 10) is None
    assert step_refusal(10, 0, 10) is None
    assert step_refusal(9, -1, 10) is None  # a partition that never took part in a session starts at -1
    assert step_refusal(1_000_005, 5, 1_000_000) is None


def test_an_absurd_jump_is_refused_with_the_reason() -> None:
    why = step_refusal(2**62, 7, 1_000_000)
    assert why is not None
    assert f"session id {2**62} is {2**62 - 7} above 7" in why
    assert "storage.maxSessionIdStep allows 1000000" in why
    assert step_refusal(11, 0, 10) is not None
    assert step_refusal(10, -1, 10) is not None  # 11 above -1
