"""The public API is what docs/client.md documents, no more, no less."""

from __future__ import annotations

import re
from pathlib import Path

import waltz

DOCUMENTED = [
    "AsyncWaltzClient",
    "ClientCallbacks",
    "ClientConfig",
    "PartitionLocalLock",
    "Serializer",
    "Transaction",
    "TransactionBuilder",
    "TransactionContext",
    "WaltzClient",
    "WaltzError",
    "__version__",
]

DOC = Path(__file__).resolve().parents[3] / "docs" / "client.md"


def test_all_is_the_documented_api() -> None:
    assert sorted(waltz.__all__) == sorted(DOCUMENTED)
    for name in waltz.__all__:
        assert hasattr(waltz, name), name


def test_docs_list_every_public_name() -> None:
    text = DOC.read_text(encoding="utf-8")
    section = text.split("## Public API", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\* `(\w+)`", section, flags=re.MULTILINE))
    assert listed == set(DOCUMENTED)


def test_testing_module_exports_the_test_doubles() -> None:
    import waltz.testing

    assert waltz.testing.__all__ == [
        "MockCluster",
        "MockDriver",
        "SimulationDeadlock",
        "VirtualTimeLoop",
        "run_virtual",
    ]
