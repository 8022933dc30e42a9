"""How an in-place dataset's objects are cut into chunks, the unit of sampling. Pure: reads go through a callable.

A pinned prefix lists its objects with their sizes, so the chunks are known at submit time without reading a byte
of data: each object is cut into `ceil(size / chunk_bytes)` byte ranges of near-equal size. What a range holds is
decided by the rules Hadoop and Spark use for input splits, so every record belongs to exactly one chunk however
the ranges fall:
- JSONL and text: a chunk owns the lines that *start* inside its range. It skips the partial line at its start
  (unless the range starts the object, or the byte before it is a newline) and reads past its end to finish its
  last line.
- Parquet: a chunk owns the row groups whose midpoint lies inside its range (Spark's rule). The footer says where
  the row groups are.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

READ_AHEAD = 64 << 10
"""Bytes fetched per extra read while finishing a chunk's last line."""


@dataclass(frozen=True, slots=True, order=True)
class Chunk:
    obj: int
    """Index of the object in the manifest's (sorted) object list."""
    start: int
    end: int
    """Byte range [start, end) of the object this chunk is responsible for."""


def plan_chunks(sizes: Sequence[int], chunk_bytes: int) -> list[Chunk]:
    """Every object's byte ranges, in object order; an empty object has none."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    out: list[Chunk] = []
    for i, size in enumerate(sizes):
        if size < 0:
            raise ValueError(f"object {i} has a negative size {size}")
        n = math.ceil(size / chunk_bytes)
        out.extend(Chunk(i, size * k // n, size * (k + 1) // n) for k in range(n))
    return out


Read = Callable[[int, int], bytes]
"""read(start, end) -> the object's bytes [start, min(end, size))."""


def owned_lines(read: Read, start: int, end: int, size: int, *, read_ahead: int = READ_AHEAD) -> bytes:
    """The bytes of the lines that start in [start, end) of an object of `size` bytes (the last one with its
    newline, if it has one). Reads [start - 1, end) and then `read_ahead` bytes at a time until the last line ends."""
    if not 0 <= start <= end <= size:
        raise ValueError(f"range [{start}, {end}) is not inside an object of {size} bytes")
    if start == end:
        return b""
    lo = start - 1 if start else 0
    buf = read(lo, end)
    if start:
        # A line starts at `start` only if the byte before it ends a line; otherwise the chunk before owns it.
        nl = buf.find(b"\n")
        if nl < 0:
            return b""  # no line starts inside this range
        head = nl + 1
    else:
        head = 0
    if head >= end - lo:  # the first line that starts after `start` starts at `end`: the next chunk's
        return b""
    pos = end
    tail = bytearray()
    if not buf.endswith(b"\n") and pos < size:
        while pos < size:
            more = read(pos, min(size, pos + read_ahead))
            if not more:
                break
            nl = more.find(b"\n")
            if nl >= 0:
                tail += more[: nl + 1]
                break
            tail += more
            pos += len(more)
    return bytes(buf[head:]) + bytes(tail)


def owned_row_groups(row_groups: Sequence[tuple[int, int]], start: int, end: int) -> list[int]:
    """Indices of the row groups (given as (file offset, compressed length)) whose midpoint is in [start, end)."""
    return [i for i, (off, length) in enumerate(row_groups) if start <= off + length // 2 < end]
