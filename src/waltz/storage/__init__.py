"""The storage node: on-disk segments, index, control file, and the asyncio node serving them."""
