"""The Waltz client library."""
