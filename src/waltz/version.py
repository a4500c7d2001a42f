"""The version of Waltz: here, not in the package root, so that reading it imports nothing else (every
storage node and server reports it, and none of them loads the client library)."""

__version__ = "0.2.0.dev0"
