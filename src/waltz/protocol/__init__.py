"""Pure wire codecs (no I/O): framing and hello, client<->server, server<->storage, storage admin."""
