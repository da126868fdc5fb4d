"""CRC32C helpers: the checksum of a payload and the checksum of a concatenation.

``checksum(data, value)`` is the C crc32c package (CPU CRC instructions, the GIL
released on large buffers). ``combine(crc_a, crc_b, len_b)`` gives the CRC32C of
``a + b`` from the CRCs of the two parts and the length of the second (zlib's
``crc32_combine`` algorithm, for the Castagnoli polynomial): parts of one block read
by different threads are checksummed where they land and combined in microseconds.
"""

from __future__ import annotations

import crc32c

_POLY = 0x82F63B78  # CRC32C (Castagnoli), reflected


def checksum(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC32C (Castagnoli) of a payload, continuing from ``value`` (chunked reads)."""
    return int(crc32c.crc32c(data, value))


def _mult_mod_p(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (both reflected, x^0 in the top bit)."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    p = 1 << 30  # x^1
    table = [p]
    for _ in range(1, 32):
        p = _mult_mod_p(p, p)
        table.append(p)
    return table


_X2N = _x2n_table()


def _x2n_mod_p(n: int, k: int) -> int:
    """x^(n * 2^k) modulo the polynomial."""
    p = 1 << 31  # x^0
    while n:
        if n & 1:
            p = _mult_mod_p(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC32C of ``a + b`` given ``crc(a)``, ``crc(b)`` and ``len(b)`` in bytes."""
    if len_b < 0:
        raise ValueError(f"len_b must be >= 0, got {len_b}")
    return _mult_mod_p(_x2n_mod_p(len_b, 3), crc_a) ^ crc_b
