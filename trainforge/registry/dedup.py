"""Content-addressed checkpoint chunks: unchanged bytes between checkpoints are stored once.

A checkpoint file is cut into content-defined chunks (a rolling hash over a 64-byte window decides the cut
points, so an insertion early in a file does not shift every later chunk); each chunk is stored once under the
job's prefix at `chunks/{sha[:2]}/{sha}[.codec]`, keyed by the sha256 of its raw bytes, and the manifest lists a
file as its chunks. An incremental checkpoint uploads only the chunks the previous one did not reference, so the
frozen half of a fine-tuned model (or embeddings under LoRA) is written once. Optional compression (zstd where the
`zstandard` package is installed, else zlib) applies per chunk.

Pure I/O on the ObjectStore interface (numpy for the hash, no torch): used by the trainer to write, and by the
control plane to verify, materialize for evaluation/export, and garbage-collect.
"""

from __future__ import annotations

import contextlib
import hashlib
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainforge.infra.storage.base import ObjectNotFoundError, ObjectStore

WINDOW = 64
MIN_CHUNK = 128 * 1024
AVG_BITS = 19  # ~512 KiB average chunk
MAX_CHUNK = 2 * 1024 * 1024
_BLOCK = 8 * 1024 * 1024
_GEAR = np.random.default_rng(0x7F4A7C15).integers(0, 2**32, size=256, dtype=np.uint32)


class ChunkError(RuntimeError):
    """A chunk is missing or its bytes do not hash to its name."""


def chunks_prefix(job_prefix: str) -> str:
    return f"{job_prefix}/chunks"


def chunk_key(job_prefix: str, sha: str, codec: str | None) -> str:
    return f"{chunks_prefix(job_prefix)}/{sha[:2]}/{sha}" + (f".{codec}" if codec else "")


def job_prefix_of(step_prefix: str) -> str:
    """`teams/t/jobs/j/checkpoints/step-N` -> `teams/t/jobs/j`."""
    return step_prefix.rsplit("/checkpoints/", 1)[0]


# ------------------------------------------------------------------ chunking (content-defined)


def _candidates(data: memoryview, start: int, mask: np.uint32) -> np.ndarray:
    """Offsets (exclusive ends) inside data[start:] where the windowed additive hash hits the mask."""
    arr = np.frombuffer(data, dtype=np.uint8, offset=start)
    if arr.size <= WINDOW:
        return np.empty(0, dtype=np.int64)
    csum = np.cumsum(_GEAR[arr], dtype=np.uint32)  # wraps modulo 2**32, which is what we want
    window = csum[WINDOW:] - csum[:-WINDOW]  # hash of bytes (i-WINDOW, i]
    hits = np.flatnonzero((window & mask) == 0) + WINDOW + 1
    return hits + start


def cut_points(data: bytes | memoryview, avg_bits: int = AVG_BITS, min_size: int = MIN_CHUNK,
               max_size: int = MAX_CHUNK) -> list[int]:
    """Chunk end offsets for `data` (the last one is len(data)). Deterministic in the content only."""
    view = memoryview(data)
    n = len(view)
    mask = np.uint32((1 << avg_bits) - 1)
    found = []
    for block_start in range(0, n, _BLOCK):
        base = max(0, block_start - WINDOW)
        hits = _candidates(view[base:min(n, block_start + _BLOCK)], 0, mask) + base
        found.append(hits[hits > block_start])
    hits = np.concatenate(found) if found else np.empty(0, dtype=np.int64)
    ends: list[int] = []
    pos = 0
    while n - pos > 0:
        i = int(np.searchsorted(hits, pos + min_size, side="left"))
        pos = int(hits[i]) if i < len(hits) and hits[i] - pos <= max_size else min(n, pos + max_size)
        ends.append(pos)
    return ends or [0]


# ------------------------------------------------------------------ codecs


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError:
        return None
    return zstandard


def default_codec(compress: bool) -> str | None:
    if not compress:
        return None
    return "zst" if _zstd() is not None else "zlib"


def encode(data: bytes, codec: str | None) -> bytes:
    if codec is None:
        return data
    if codec == "zlib":
        return zlib.compress(data, 1)
    if codec == "zst":
        return _zstd().ZstdCompressor(level=3).compress(data)
    raise ValueError(f"unknown chunk codec {codec!r}")


def decode(data: bytes, codec: str | None) -> bytes:
    if codec is None:
        return data
    if codec == "zlib":
        return zlib.decompress(data)
    if codec == "zst":
        z = _zstd()
        if z is None:
            raise ChunkError("chunk is zstd-compressed: pip install zstandard")
        return z.ZstdDecompressor().decompress(data)
    raise ValueError(f"unknown chunk codec {codec!r}")


# ------------------------------------------------------------------ write


@dataclass
class UploadStats:
    files: int = 0
    bytes_logical: int = 0
    """Bytes of the checkpoint's files (what a full save writes)."""
    bytes_written: int = 0
    """Bytes actually uploaded (new chunks, after compression)."""
    chunks_new: int = 0
    chunks_reused: int = 0

    def add(self, other: UploadStats) -> None:
        for name in ("files", "bytes_logical", "bytes_written", "chunks_new", "chunks_reused"):
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class ChunkWriter:
    """Uploads files as chunks under one job prefix, skipping chunks already referenced by a committed checkpoint
    (`known`: only committed ones, which retention keeps while they are the newest, so a reused chunk can never
    be garbage-collected under an in-flight save)."""

    store: ObjectStore
    job_prefix: str
    codec: str | None = None
    known: set[str] = field(default_factory=set)
    put: Callable[[str, bytes], None] | None = None

    def write_file(self, path: Path, name: str, stats: UploadStats) -> dict[str, Any]:
        data = path.read_bytes()
        whole = hashlib.sha256(data)
        chunks = []
        start = 0
        for end in cut_points(data):
            piece = data[start:end]
            sha = hashlib.sha256(piece).hexdigest()
            chunks.append([sha, end - start])
            if sha in self.known:
                stats.chunks_reused += 1
            else:
                body = encode(piece, self.codec)
                (self.put or self._put)(chunk_key(self.job_prefix, sha, self.codec), body)
                self.known.add(sha)
                stats.chunks_new += 1
                stats.bytes_written += len(body)
            start = end
        stats.files += 1
        stats.bytes_logical += len(data)
        return {"name": name, "bytes": len(data), "sha256": whole.hexdigest(), "chunks": chunks, "codec": self.codec}

    def _put(self, key: str, body: bytes) -> None:
        self.store.put_bytes(key, body)


def referenced_chunks(files: Iterable[dict[str, Any]]) -> set[str]:
    return {sha for f in files for sha, _ in f.get("chunks", ())}


# ------------------------------------------------------------------ read


def iter_file_bytes(store: ObjectStore, step_prefix: str, entry: dict[str, Any]) -> Iterator[bytes]:
    """The file's bytes, chunk by chunk, each checked against its sha256 (a legacy whole-object file is read
    as one piece and checked by the caller)."""
    if "chunks" not in entry:
        yield store.get_bytes(f"{step_prefix}/{entry['name']}")
        return
    job = job_prefix_of(step_prefix)
    for sha, size in entry["chunks"]:
        yield read_chunk(store, job, sha, size, entry.get("codec"), what=entry["name"])


def read_chunk(store: ObjectStore, job_prefix: str, sha: str, size: int, codec: str | None, *,
               what: str = "checkpoint") -> bytes:
    """One chunk's raw bytes, read from the store and checked against its recorded size and sha256 (ChunkError
    when it is missing or does not match; `what` names the file in the message)."""
    try:
        stored = store.get_bytes(chunk_key(job_prefix, sha, codec))
    except ObjectNotFoundError as exc:
        raise ChunkError(f"{what}: chunk {sha[:12]} missing") from exc
    try:
        data = decode(stored, codec)
    except ChunkError:
        raise
    except Exception as exc:  # zlib.error, zstd's ZstdError: the stored bytes are not what was written
        raise ChunkError(f"{what}: chunk {sha[:12]} corrupt (does not decompress: {exc})") from exc
    if not chunk_intact(data, sha, size):
        raise ChunkError(f"{what}: chunk {sha[:12]} corrupt (sha256 mismatch)")
    return data


def chunk_intact(data: bytes | memoryview, sha: str, size: int) -> bool:
    return len(data) == size and hashlib.sha256(data).hexdigest() == sha


def file_problem(store: ObjectStore, step_prefix: str, entry: dict[str, Any], dest: Path | None = None) -> str | None:
    """Read one file (into `dest` when given) and check its size and sha256; the problem, or None."""
    h = hashlib.sha256()
    size = 0
    part = dest.with_name(dest.name + ".part") if dest is not None else None
    if part is not None:
        part.parent.mkdir(parents=True, exist_ok=True)
    try:
        with contextlib.ExitStack() as stack:
            out = stack.enter_context(open(part, "wb")) if part is not None else None
            for piece in iter_file_bytes(store, step_prefix, entry):
                h.update(piece)
                size += len(piece)
                if out is not None:
                    out.write(piece)
    except ObjectNotFoundError:
        return f"{entry['name']}: missing"
    except ChunkError as exc:
        return str(exc)
    if size != entry["bytes"]:
        return f"{entry['name']}: truncated ({size} of {entry['bytes']} bytes)"
    if h.hexdigest() != entry["sha256"]:
        return f"{entry['name']}: sha256 mismatch"
    if dest is not None and part is not None:
        part.replace(dest)
    return None
