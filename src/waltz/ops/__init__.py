"""Operator tools: repair and verification of a running cluster (``waltz storage recover-partition``,
``sync-partitions``, ``validate``, ``waltz cluster verify``, ``check-connectivity``, ``fix-generation``,
``rebuild-metadata`` for a lost ZooKeeper, ``accept-loss`` for restored disks, and the guard of
``remove-partition -d``), backup and restore (``waltz backup``, ``waltz restore``: :mod:`waltz.ops.backup`,
:mod:`waltz.ops.restore`, format in :mod:`waltz.ops.backup_format`), and the data of the live view
``waltz top`` (:mod:`waltz.ops.top`).

Each tool is a library function over ZooKeeper metadata and the storage and server clients; the ``waltz``
commands in :mod:`waltz.cli` are thin layers over them, and the integration tests call them directly.
"""
