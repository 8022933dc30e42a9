"""Which rank reads which checkpoint chunk from the store, and who sends it to whom: a restore reads each byte once.

A committed checkpoint's files are stored as content-defined chunks (registry/dedup.py), so a byte range of a file
is a run of whole chunks. Each rank needs the chunks under the byte ranges its DCP load plan reads. Ranks that need
the same chunk (data-parallel replicas, hybrid sharding's replica groups, a small tensor every rank loads) do not all
fetch it: exactly one of them, its *owner*, reads it from the store, verifies it and sends it to the others over the
process group. Owners are chosen per group of chunks with the same set of readers, least-loaded first, so replicas
split a shared shard's reads evenly between them.

Pure: no torch, no I/O. `file_spans` and `spans_for_range` map byte ranges to chunks; `assign` is the global
decision the coordinator makes from every rank's needs (tests/unit/test_read_plan.py checks it exhaustively).
"""

from __future__ import annotations

import bisect
import heapq
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple


class Chunk(NamedTuple):
    """One stored chunk: its sha256 (of the raw bytes), raw size and the codec it is stored with."""

    sha: str
    size: int
    codec: str | None


class Span(NamedTuple):
    """A chunk at its place in one file: bytes [start, start + chunk.size) of `name`."""

    name: str
    start: int
    chunk: Chunk


def file_spans(entry: Mapping[str, Any]) -> list[Span]:
    """A manifest file entry's chunks with their offsets in the file, in order."""
    spans, pos, codec = [], 0, entry.get("codec")
    for sha, size in entry["chunks"]:
        spans.append(Span(entry["name"], pos, Chunk(sha, int(size), codec)))
        pos += int(size)
    if pos != entry["bytes"]:
        raise ValueError(f"{entry['name']}: its chunks add up to {pos} bytes, the manifest says {entry['bytes']}")
    return spans


def spans_for_range(spans: Sequence[Span], offset: int, length: int) -> list[Span]:
    """The chunks that hold bytes [offset, offset + length) of the file whose `file_spans` these are."""
    if length <= 0:
        return []
    end = offset + length
    size = spans[-1].start + spans[-1].chunk.size if spans else 0
    if offset < 0 or end > size:
        raise ValueError(f"range [{offset}, {end}) lies outside the file's {size} bytes")
    starts = [s.start for s in spans]
    first = bisect.bisect_right(starts, offset) - 1
    last = bisect.bisect_left(starts, end) - 1
    return list(spans[first:last + 1])


@dataclass
class RankReads:
    """One rank's part of a restore: what it fetches from the store and what it exchanges with its peers. `send[d]`
    and the receiver's `recv[s]` list the same chunks in the same order, so one all-to-all moves them."""

    fetch: list[Chunk] = field(default_factory=list)
    send: dict[int, list[Chunk]] = field(default_factory=dict)
    recv: dict[int, list[Chunk]] = field(default_factory=dict)

    def fetch_bytes(self) -> int:
        return sum(c.size for c in self.fetch)

    def send_sizes(self, world: int) -> list[int]:
        return [sum(c.size for c in self.send.get(d, ())) for d in range(world)]

    def recv_sizes(self, world: int) -> list[int]:
        return [sum(c.size for c in self.recv.get(s, ())) for s in range(world)]


def assign(needs: Sequence[Iterable[Chunk]]) -> list[RankReads]:
    """Every rank's reads and exchanges, from what each rank needs (`needs[r]`). Each needed chunk is fetched by
    exactly one rank that needs it; every other rank that needs it receives it from that one. Chunks with the same
    set of readers are dealt to the least-loaded of those readers (by bytes fetched so far), largest first.
    Deterministic in its input (every order is sorted), so a test can recompute it."""
    world = len(needs)
    readers: dict[Chunk, list[int]] = defaultdict(list)
    for rank, chunks in enumerate(needs):
        for chunk in set(chunks):
            readers[chunk].append(rank)
    groups: dict[tuple[int, ...], list[Chunk]] = defaultdict(list)
    for chunk, ranks in readers.items():
        groups[tuple(sorted(ranks))].append(chunk)
    load = [0] * world
    owner: dict[Chunk, int] = {}
    # Bigger groups of chunks first, so the small shared bits (scalars every rank loads) even out what remains.
    for ranks, chunks in sorted(groups.items(), key=lambda g: (-sum(c.size for c in g[1]), g[0])):
        heap = [(load[r], r) for r in ranks]
        heapq.heapify(heap)
        for chunk in sorted(chunks, key=lambda c: (-c.size, c.sha, c.codec or "")):
            _, r = heapq.heappop(heap)
            owner[chunk] = r
            load[r] += chunk.size
            heapq.heappush(heap, (load[r], r))
    out = [RankReads() for _ in range(world)]
    for chunk in sorted(owner, key=lambda c: (c.sha, c.codec or "", c.size)):
        src = owner[chunk]
        out[src].fetch.append(chunk)
        for dst in readers[chunk]:
            if dst != src:
                out[src].send.setdefault(dst, []).append(chunk)
                out[dst].recv.setdefault(src, []).append(chunk)
    return out
