"""The ``waltz`` command line.

Each module here with a ``register(subparsers)`` function adds a command group.
"""
