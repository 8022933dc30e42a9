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

READ_AHEAD = 16 << 10
"""Bytes read past a chunk's end with its own read, to finish its last line without a second request."""


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


def owned_span(read: Read, start: int, end: int, size: int, *,
               read_ahead: int = READ_AHEAD) -> tuple[int, bytes]:
    """(offset in the object, bytes) of the lines of the lines that start in [start, end) of an object of `size` bytes (the last one with its
    newline, if it has one). One read of [start - 1, end + read_ahead) finds them when lines are shorter than
    `read_ahead`; a longer last line is finished with reads that double in size."""
    if not 0 <= start <= end <= size:
        raise ValueError(f"range [{start}, {end}) is not inside an object of {size} bytes")
    if start == end:
        return start, b""
    lo = start - 1 if start else 0
    hi = min(size, end + read_ahead)
    buf = bytearray(read(lo, hi))
    head = 0
    if start:
        # A line starts at p in [start, end) only after a newline at p - 1 in [start - 1, end - 1).
        nl = buf.find(b"\n", 0, end - 1 - lo)
        if nl < 0:
            return end, b""  # inside one line that started before: the chunk that holds its start owns it
        head = nl + 1
    # The last owned line is the one holding byte end - 1: it ends at the first newline at or after it.
    search, step = end - 1 - lo, max(1, read_ahead)
    while (nl := buf.find(b"\n", search)) < 0 and hi < size:
        search = len(buf)
        step *= 2
        more = read(hi, min(size, hi + step))
        if not more:
            break
        buf += more
        hi += len(more)
    stop = nl + 1 if nl >= 0 else len(buf)
    return lo + head, bytes(buf[head:stop])


def owned_row_groups(row_groups: Sequence[tuple[int, int]], start: int, end: int) -> list[int]:
    """Indices of the row groups (given as (file offset, compressed length)) whose midpoint is in [start, end)."""
    return [i for i, (off, length) in enumerate(row_groups) if start <= off + length // 2 < end]
