"""Test support for Waltz applications: an in-memory cluster, no network, ZooKeeper or storage.

::

    from waltz import WaltzClient, ClientConfig
    from waltz.testing import MockDriver

    driver = MockDriver()                      # client 0, one partition
    with WaltzClient(callbacks, ClientConfig(), driver=driver) as client:
        client.submit(context)
        client.flush_transactions()

Several clients share one :class:`MockCluster` (``MockDriver(cluster=cluster)`` each). Fault injection:
:meth:`MockDriver.set_fault_rate`, :meth:`~MockDriver.force_next_append_fail`,
:meth:`~MockDriver.force_next_lock_fail`, :meth:`~MockDriver.set_max_delay`,
:meth:`~MockDriver.suspend_feed` / :meth:`~MockDriver.resume_feed`,
:meth:`~MockDriver.corrupt_next_fetch`, :meth:`~MockDriver.disconnect`.

For Waltz's own deterministic tests: :class:`VirtualTimeLoop` / :func:`run_virtual` (asyncio on virtual
time, see :mod:`waltz.testing.simloop`); the in-memory storage nodes and metadata store the fault simulator
drives, and a replica that holds nothing (for measuring the server alone), live in :mod:`waltz.testing.store`;
a store that commits when the test says so, for testing a server partition alone, in
:mod:`waltz.testing.partition_store`.
"""

from waltz.client.mock import MockCluster, MockDriver
from waltz.testing.simloop import SimulationDeadlock, VirtualTimeLoop, run_virtual

__all__ = ["MockCluster", "MockDriver", "SimulationDeadlock", "VirtualTimeLoop", "run_virtual"]
