"""``make demo``: until the full demo exists, a storage-node round trip (see :mod:`demo.run`)."""
