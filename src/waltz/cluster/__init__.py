"""Cluster coordination on ZooKeeper: metadata, membership and partition assignment.

Modules (see docs/zookeeper.md for the znode layout and every value's bytes):

* values, one module each: ``cluster_params``, ``store_params``, ``partition_assignment``,
  ``server_descriptor``, ``replica_assignments``, ``group_descriptor``, ``connection_metadata``,
  ``counter``, ``partition_metadata``; their shared primitives in ``codec``;
* ``zk``: connecting, the path layout, kazoo errors mapped onto Waltz's, compare-and-set;
* ``store_metadata``: create/delete/read a cluster, edit storage nodes and replica assignments;
* ``assignment``: the pure partition -> server policy;
* ``membership``: ``ClusterMember`` (servers) and ``ClusterWatcher`` (clients), asyncio;
* ``zkserver``: run a real ZooKeeper (or a 3-node ensemble) on loopback.
"""
