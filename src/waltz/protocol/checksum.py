"""The CRC-32 behind every checksum of the formats (zlib's, ``java.util.zip.CRC32``), from the fastest
implementation installed.

``crc32(data, value=0)`` has zlib's signature and values: ``crc32(b, crc32(a)) == crc32(a + b)``. It is
zlib-ng's when the ``zlib-ng`` package is installed (a dependency of waltz-log): a carry-less-multiply CRC
that takes about a quarter of the time of the standard library's on a 512-byte record, which matters because a
storage node computes three CRCs per appended record (the client's data checksum, checked, and the record
checksum, computed) and every range read verifies one or two per record. Without zlib-ng it falls back to
:func:`zlib.crc32`; the values are the same either way (``tests/unit/test_checksum.py``).
"""

from __future__ import annotations

__all__ = ["IMPLEMENTATION", "crc32"]

try:
    from zlib_ng.zlib_ng import crc32

    IMPLEMENTATION = "zlib-ng"
except ImportError:  # pragma: no cover - zlib-ng is a declared dependency; this keeps a bare install working
    from zlib import crc32

    IMPLEMENTATION = "zlib"
