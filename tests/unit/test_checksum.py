"""The CRC-32 every format uses (:mod:`waltz.protocol.checksum`) gives zlib's values, whichever implementation
is installed, including chained (``crc32(b, crc32(a)) == crc32(a + b)``) and over memoryview slices."""

from __future__ import annotations

import random
import zlib

from waltz.protocol.checksum import IMPLEMENTATION, crc32


def test_the_fast_implementation_is_installed() -> None:
    # zlib-ng is a declared dependency: without it every append and read pays ~4x for its checksums.
    assert IMPLEMENTATION == "zlib-ng"


def test_values_are_zlibs_for_every_length_and_start_value() -> None:
    rng = random.Random(11)
    for n in [0, 1, 3, 4, 15, 16, 17, 31, 36, 63, 64, 65, 255, 512, 548, 4096, 70_001]:
        data = rng.randbytes(n)
        for start in (0, 1, 0x12345678, 0xFFFFFFFF):
            assert crc32(data, start) == zlib.crc32(data, start), (n, start)
        assert crc32(data) == zlib.crc32(data)


def test_chained_and_over_memoryview_slices() -> None:
    data = random.Random(12).randbytes(1000)
    view = memoryview(data)
    assert crc32(view[36:900], crc32(view[:36])) == zlib.crc32(data[:900])
    assert crc32(b"") == 0
    assert crc32(b"123456789") == 0xCBF43926  # the CRC-32 check value
