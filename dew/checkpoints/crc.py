"""CRC-32 (zlib's polynomial) of fixed-size chunks, and the combination of CRCs.

Each saved piece carries the CRC-32 of every `chunk_bytes` chunk of its raw bytes, so a reader
that needs part of a piece verifies just the chunks it reads. The zip member that holds a piece
needs the CRC-32 of the whole member (the .npy header, then the data); `combine` derives it from
the chunk CRCs without a second pass over the data (zlib's crc32_combine, in Python).
"""

import zlib

_POLY = 0xEDB88320  # reflected CRC-32 polynomial


def _multiply(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (reflected bit order)."""
    m = 1 << 31
    product = 0
    while True:
        if a & m:
            product ^= b
            if (a & (m - 1)) == 0:
                return product
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


_X_POW_2N = [1 << 30]  # x^(2^n) modulo the polynomial, for n = 0..31
for _ in range(31):
    _X_POW_2N.append(_multiply(_X_POW_2N[-1], _X_POW_2N[-1]))


def _shift_operator(nbytes: int) -> int:
    """x^(8 * nbytes) modulo the polynomial: appending nbytes zero bytes to a CRC."""
    power, k, operator = nbytes, 3, 1 << 31
    while power:
        if power & 1:
            operator = _multiply(_X_POW_2N[k & 31], operator)
        power >>= 1
        k += 1
    return operator


def combine(crc_a: int, crc_b: int, length_b: int) -> int:
    """CRC-32 of A + B from crc32(A), crc32(B) and len(B)."""
    return _multiply(_shift_operator(length_b), crc_a) ^ crc_b


def chunk_crcs(data: memoryview, chunk_bytes: int) -> list[int]:
    """CRC-32 of each `chunk_bytes` chunk of `data` (the last one may be shorter)."""
    data = data.cast("B") if data.format != "B" or data.ndim != 1 else data
    return [zlib.crc32(data[i : i + chunk_bytes]) for i in range(0, len(data), chunk_bytes)]


def whole_crc(crcs: list[int], chunk_bytes: int, total_bytes: int, initial: int = 0) -> int:
    """CRC-32 of `initial`'s bytes followed by all chunks, from the chunk CRCs."""
    full_chunk = _shift_operator(chunk_bytes)
    crc = initial
    for i, chunk_crc in enumerate(crcs):
        length = min(chunk_bytes, total_bytes - i * chunk_bytes)
        operator = full_chunk if length == chunk_bytes else _shift_operator(length)
        crc = _multiply(operator, crc) ^ chunk_crc
    return crc
