"""The Waltz client library.

Public names are re-exported from :mod:`waltz`; the modules are:

* :mod:`waltz.client.sync` / :mod:`waltz.client.core`: ``WaltzClient`` (threads) and ``AsyncWaltzClient``;
* :mod:`waltz.client.api`, :mod:`~waltz.client.context`, :mod:`~waltz.client.builder`,
  :mod:`~waltz.client.transaction`, :mod:`~waltz.client.serializer`, :mod:`~waltz.client.locks`: what
  applications implement and use;
* :mod:`waltz.client.config`: ``ClientConfig``;
* :mod:`waltz.client.monitor`, :mod:`~waltz.client.retry`: append failure detection and retry policy;
* :mod:`waltz.client.driver`: the ``ClientDriver`` contract; :mod:`~waltz.client.mock`: the in-memory driver;
* :mod:`waltz.client.sql`: ``SqlClientCallbacks``, exactly-once application to a SQL database.
"""
