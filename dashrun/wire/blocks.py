"""A shard's checksum at every block boundary, and the checksum of any byte range of it from them.

dash-memd computes a shard's CRC-32C as the shard arrives; it keeps that running
value at every :data:`BLOCK` boundary too (the shard's *marks*: ``marks[j]`` is
the CRC-32C of its first ``min(j * BLOCK, nbytes)`` bytes, the last mark the
whole shard's). From them, :func:`range_crc` gives the CRC-32C of any byte range
while reading at most the two blocks at its edges: each block wholly inside the
range adds through CRC-32C's linearity (appending ``B`` to ``A`` shifts ``A``'s
value as ``len(B)`` zero bytes would, then adds ``B``'s), and each edge block is
read whole, which checks its bytes against the marks on the way.

So a range goes out with the checksum of the bytes as they arrived, not as they
are in RAM now: bytes changed at rest fail at the receiver (or, at an edge, in
dash-memd) rather than being served with a checksum computed over them. And
dash-memd does not read a range's bytes a second time to checksum them.
"""

from __future__ import annotations

import array
import functools
from typing import Sequence

from dashrun.errors import ChecksumError
from dashrun.wire.protocol import crc32c

__all__ = ["BLOCK", "Marks", "range_crc", "shift_block", "check_marks"]

#: Bytes between two marks: small enough that an edge block costs little to read, large enough that a GiB
#: has few marks (4 KiB of them).
BLOCK = 1 << 20

#: A shard's marks: ``marks[0] == 0`` (no bytes), then one per block boundary, the last for the shard's end.
Marks = array.array


@functools.cache
def _shift_tables() -> tuple[tuple[int, ...], ...]:
    """Byte-wise tables of the linear map that appending BLOCK zero bytes is on a CRC-32C's register.

    For zero bytes the register's update is linear, and the pre- and post-inversion cancel between two
    values: ``shift(v) = crc32c(zeros, v) ^ crc32c(zeros, 0)``. One such value per bit gives the map.
    """
    zeros = bytes(BLOCK)
    offset = crc32c(zeros, 0)
    columns = [crc32c(zeros, 1 << bit) ^ offset for bit in range(32)]
    tables = []
    for byte in range(4):
        table = []
        for value in range(256):
            image = 0
            for bit in range(8):
                if value >> bit & 1:
                    image ^= columns[8 * byte + bit]
            table.append(image)
        tables.append(tuple(table))
    return tuple(tables)


def shift_block(crc: int) -> int:
    """``crc`` as appending BLOCK zero bytes to what it checks would change it, without the inversions:
    ``crc32c(a + b) == shift_block(crc32c(a)) ^ crc32c(b)`` for any ``b`` of BLOCK bytes."""
    t0, t1, t2, t3 = _shift_tables()
    return t0[crc & 0xFF] ^ t1[crc >> 8 & 0xFF] ^ t2[crc >> 16 & 0xFF] ^ t3[crc >> 24]


def check_marks(marks: Sequence[int], nbytes: int, crc: int) -> None:
    """Raise ValueError unless ``marks`` has the shape of ``nbytes``' marks ending at ``crc``."""
    if len(marks) != -(-nbytes // BLOCK) + 1 or marks[0] != 0 or marks[-1] != crc:
        raise ValueError(f"{len(marks)} marks do not describe {nbytes} bytes of CRC-32C {crc:#010x}")


def range_crc(view: memoryview, marks: Sequence[int], start: int, stop: int) -> int:
    """The CRC-32C of ``view[start:stop]`` as the bytes were when ``marks`` were taken (``view``: the whole
    shard). The blocks at the range's edges are read whole and checked against the marks; ChecksumError if
    one has changed since."""
    if not 0 <= start <= stop <= len(view):
        raise ValueError(f"range [{start}, {stop}) of {len(view)} bytes")
    crc = 0
    for block in range(start // BLOCK, -(-stop // BLOCK)):
        begin, end = block * BLOCK, min((block + 1) * BLOCK, len(view))
        lo, hi = max(start, begin), min(stop, end)
        if (lo, hi) == (begin, end) and end - begin == BLOCK:
            # The block's own CRC-32C from the marks around it, appended to the range's so far.
            crc = shift_block(crc) ^ marks[block + 1] ^ shift_block(marks[block])
            continue
        part = view[lo:hi]
        running = crc32c(part, crc32c(view[begin:lo], marks[block]))
        if crc32c(view[hi:end], running) != marks[block + 1]:
            raise ChecksumError(f"bytes {begin}-{end} have changed in RAM since they arrived")
        crc = crc32c(part, crc)
    return crc
