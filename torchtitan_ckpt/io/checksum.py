"""The CRC-32 of the commit manifest.

The same CRC-32 as `zlib.crc32` (the gzip polynomial; the values are identical), computed by
Intel's ISA-L through `isal`: its carry-less-multiply code runs several times faster than zlib
(`docs/performance.md`) and releases the GIL as zlib does. A
durable save is CPU-bound on a small host (every byte is copied into the page cache and
checksummed), so the checksum's cost is a direct part of the save's time. `isal` has wheels
for x86-64 and ARM64 only (a dependency there); elsewhere zlib computes the same values.
"""

from __future__ import annotations

from collections.abc import Callable

try:
    from isal.isal_zlib import crc32
except ImportError:  # a machine isal has no wheel for
    from zlib import crc32

__all__ = ["crc32", "file_crc32", "stream_crc32"]

_CHUNK = 8 << 20


def hex_crc(crc: int) -> str:
    """A CRC-32 as the commit marker records it: 8 hex digits."""
    return f"{crc:08x}"


def file_crc32(path: str) -> str:
    """The CRC-32 of a file's bytes, as 8 hex digits."""
    with open(path, "rb") as f:
        return stream_crc32(f)


def stream_crc32(f, read: Callable[[int], None] | None = None) -> str:
    """The CRC-32 of the rest of an open binary file, as 8 hex digits; `read(nbytes)` hears of
    each chunk as it is checksummed (a progress report)."""
    crc = 0
    while chunk := f.read(_CHUNK):
        crc = crc32(chunk, crc)
        if read is not None:
            read(len(chunk))
    return hex_crc(crc)
