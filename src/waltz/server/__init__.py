"""The Waltz server: partitions, lock table, caches, store sessions, quorum writes and recovery."""
