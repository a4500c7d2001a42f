"""``waltz local``: a whole Waltz cluster on one machine, one OS process per component.

:mod:`waltz.local.cluster` has the commands (:func:`~waltz.local.cluster.up`, ``down``, ``kill``, ``start``,
``restart``); :mod:`waltz.local.overview` what ``status`` and ``up`` show; :mod:`waltz.local.configs` each
process's configuration and the orchestrator's ZooKeeper and admin access; :mod:`waltz.local.state` the
``cluster.json`` record; :mod:`waltz.local.procs` the detached processes and port checks;
:mod:`waltz.local.probe` the ``/health`` and ``/metrics`` readers.
"""

from waltz.local.cluster import UpOptions, down, kill, restart, start, up
from waltz.local.overview import ClusterStatus, status
from waltz.local.state import DEFAULT_ZK_SESSION_TIMEOUT_MS, LocalCluster, ProcessRecord

__all__ = [
    "DEFAULT_ZK_SESSION_TIMEOUT_MS",
    "ClusterStatus",
    "LocalCluster",
    "ProcessRecord",
    "UpOptions",
    "down",
    "kill",
    "restart",
    "start",
    "status",
    "up",
]
