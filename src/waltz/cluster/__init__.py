"""Cluster coordination on ZooKeeper: metadata, membership and partition assignment."""
