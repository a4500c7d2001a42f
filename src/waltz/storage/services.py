"""What the storage node's ports and scrub use of the node: :class:`NodeServices`, which
:class:`waltz.storage.node.StorageNode` satisfies.

The node starts the ports, the scrub and the partitions; they see the node only through these protocols
(a partition through :class:`waltz.storage.worker.PartitionHost`), so none of them imports the node.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any, Protocol

from waltz.storage.authority import SessionAuthority
from waltz.storage.worker import PartitionHost, StoragePartition


class NodeServices(PartitionHost, Protocol):
    """The storage node as its data port, admin port and scrub see it."""

    partitions: list[StoragePartition]
    """The node's partitions, indexed by partition id."""
    authority: SessionAuthority | None
    """What vouches for session ids above the fence (see :mod:`waltz.storage.authority`); None: nothing."""
    port: int
    """The data port's bound port (0 until it listens)."""

    async def on_partition(self, pid: int, op: Callable[[], Any]) -> Any: ...

    def check_identity(self, key: uuid.UUID, num_partitions: int) -> None: ...

    def damage_report(self) -> tuple[dict[str, list[int]], dict[str, str]]: ...
