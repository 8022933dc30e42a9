"""Reading an in-place dataset: pinned ranged reads of the objects themselves, tokenized chunk by chunk.

`InPlaceReader` is the reader for a pinned s3:// prefix (`prefix_manifest.PrefixManifest`). For each chunk
(`datasets.chunks`) it reads the bytes the chunk owns with ranged GETs pinned to the manifest's version id (a
versioned bucket: a later overwrite changes nothing) or ETag (If-Match: a changed object fails with
`DatasetChangedError`, naming the object and the pinned version, and no sample of it is returned). It parses the
documents (JSONL lines' text field, text lines, Parquet row groups' text column), tokenizes them ([BOS] ids EOS,
as `trainforge datasets build` does) and packs them into windows of `sample_len` tokens, the tail shorter than a
window dropped. Tokenized chunks go to the local cache tier (LRU by bytes, `stream.CacheTier`), their window
counts to a small count file that is never evicted, so a chunk is read and tokenized once per host while it stays
cached. A thread pool tokenizes the chunks of upcoming steps ahead of need (`prefetch`).
"""

from __future__ import annotations

import io
import json
import logging
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainforge.datasets import tokenizer
from trainforge.datasets.chunk_order import WINDOW_BITS, split_sample_id
from trainforge.datasets.chunks import READ_AHEAD, Chunk, owned_row_groups, owned_span
from trainforge.datasets.prefix_manifest import PrefixManifest, SourceObject
from trainforge.datasets.stream import CacheConfig, CacheStats, CacheTier
from trainforge.infra.storage import ObjectChangedError

logger = logging.getLogger(__name__)
KEEP_CHUNKS = 16
"""Tokenized chunks a reader keeps at hand (memory-mapped from the cache tier, mostly)."""
_READERS: weakref.WeakSet[InPlaceReader] = weakref.WeakSet()


def _reset_after_fork() -> None:
    for reader in list(_READERS):
        reader._after_fork()


os.register_at_fork(after_in_child=_reset_after_fork)


class DatasetChangedError(RuntimeError):
    """An object of a pinned in-place dataset is not the one pinned: training on it would train on other data."""

    def __init__(self, manifest: PrefixManifest, obj: SourceObject):
        self.key = obj.key
        pinned = f"version {obj.version_id}" if obj.version_id else f"ETag {obj.etag}"
        super().__init__(
            f"dataset {manifest.name}@{manifest.version_id[:12]}: object s3://{manifest.bucket}/{obj.key} is no "
            f"longer the pinned {pinned} (it was overwritten or deleted after the version was pinned); the job "
            "does not train on changed data. Resubmit to pin the prefix as it is now, or restore the object "
            "(a bucket with versioning enabled keeps pinned versions readable)")


class DataFormatError(ValueError):
    """A record of an in-place dataset cannot be read as its format says."""


@dataclass(frozen=True, slots=True)
class TokenizerSpec:
    """How a job tokenizes in-place text: byte-level, or a tokenizer.json (its text, which pins it)."""

    name: str = tokenizer.NAME
    json_text: str | None = None

    def load(self) -> tuple[Callable[[str], np.ndarray], type]:
        """(encode, token dtype), the tokenizer.json parsed once."""
        if self.json_text is None:
            return tokenizer.encode, np.uint16
        tok = tokenizer.JsonTokenizer(self.json_text)
        return tok.encode, tok.dtype


class PinnedObjects:
    """Pinned ranged reads of a manifest's objects through one S3 handle (the job's own credentials)."""

    def __init__(self, manifest: PrefixManifest, store: Any):
        self.manifest, self.store = manifest, store
        self.bytes_read = 0
        self.requests = 0
        self._lock = threading.Lock()

    def read(self, index: int, start: int, end: int) -> bytes:
        obj = self.manifest.objects[index]
        end = min(end, obj.size)
        if end <= start:
            return b""
        try:
            data = self.store.get_range_pinned(obj.key, (start, end), etag=obj.etag, version_id=obj.version_id)
        except ObjectChangedError:
            raise DatasetChangedError(self.manifest, obj) from None
        with self._lock:
            self.bytes_read += len(data)
            self.requests += 1
        return data


class _PinnedFile(io.RawIOBase):
    """A seekable read-only file over one pinned object, for pyarrow's Parquet reader (footer, row groups)."""

    def __init__(self, objects: PinnedObjects, index: int):
        self.objects, self.index = objects, index
        self.size = objects.manifest.objects[index].size
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buf: Any) -> int:
        data = self.objects.read(self.index, self.pos, self.pos + len(buf))
        buf[: len(data)] = data
        self.pos += len(data)
        return len(data)

    def readall(self) -> bytes:
        data = self.objects.read(self.index, self.pos, self.size)
        self.pos += len(data)
        return data


def _scalars(record: dict[str, Any]) -> dict[str, Any]:
    """A record's scalar fields (nested lists and objects left out: expectations are on columns)."""
    return {k: v for k, v in record.items() if v is None or isinstance(v, str | int | float | bool)}


def _check_text(where: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise DataFormatError(f"{where}: the text is {type(value).__name__}, not a string")
    return value if value.strip() else None


def jsonl_documents(data: bytes, text_field: str, where: str, base: int = 0) -> list[str]:
    """The documents of the JSONL lines a chunk owns (starting at byte `base` of the object); blank lines are
    skipped, anything else unreadable fails naming the object and the line's byte offset."""
    docs = []
    offset = base
    for line in data.split(b"\n"):
        here = f"{where} (the line at byte {offset})"
        offset += len(line) + 1
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DataFormatError(f"{here}: not a JSON line ({exc})") from None
        if not isinstance(obj, dict) or text_field not in obj:
            raise DataFormatError(f"{here}: no {text_field!r} field (set dataset.text_field to the field that "
                                  "holds the text)")
        if (text := _check_text(here, obj[text_field])) is not None:
            docs.append(text)
    return docs


def text_documents(data: bytes, where: str, base: int = 0) -> list[str]:
    """Each non-blank line of a text chunk is one document (as Hugging Face's `text` loader reads files)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataFormatError(f"{where}: not UTF-8 text ({exc.reason} at byte {base + exc.start})") from None
    return [line for line in text.split("\n") if line.strip()]


class ParquetLayout:
    """Row-group byte ranges of one Parquet object, from its footer (read once per object and process)."""

    def __init__(self, objects: PinnedObjects, index: int, column: str):
        import pyarrow as pa
        import pyarrow.parquet as pq

        key = objects.manifest.objects[index].key
        try:
            self.file = pq.ParquetFile(_PinnedFile(objects, index))
        except DatasetChangedError:
            raise
        except (OSError, pa.ArrowException) as exc:
            raise DataFormatError(f"s3://{objects.manifest.bucket}/{key}: not a readable Parquet file ({exc})") from None
        schema = self.file.schema_arrow
        if column not in schema.names:
            raise DataFormatError(f"s3://{objects.manifest.bucket}/{key}: no {column!r} column (columns: "
                                  f"{', '.join(schema.names)}); set dataset.text_field to the text column")
        if not (pa.types.is_string(schema.field(column).type) or pa.types.is_large_string(schema.field(column).type)):
            raise DataFormatError(f"s3://{objects.manifest.bucket}/{key}: column {column!r} is "
                                  f"{schema.field(column).type}, not a string column")
        meta = self.file.metadata
        self.groups: list[tuple[int, int]] = []
        for i in range(meta.num_row_groups):
            rg = meta.row_group(i)
            cols = [rg.column(j) for j in range(rg.num_columns)]
            starts = [c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset for c in cols]
            self.groups.append((min(starts), sum(c.total_compressed_size for c in cols)))
        self.column = column
        self.lock = threading.Lock()  # one file position: the pool's threads read row groups one at a time

    def read(self, group: int, columns: list[str] | None = None) -> Any:
        with self.lock:
            return self.file.read_row_group(group, columns=columns)

    def documents(self, chunk: Chunk, where: str) -> list[str]:
        docs = []
        for g in owned_row_groups(self.groups, chunk.start, chunk.end):
            values = self.read(g, [self.column]).column(0).to_pylist()
            for r, value in enumerate(values):
                if (text := _check_text(f"{where} row group {g} row {r}", value)) is not None:
                    docs.append(text)
        return docs


class InPlaceReader:
    """Fixed-length samples of a pinned prefix by sample id (`chunk_order.sample_id`), read in place."""

    def __init__(self, manifest: PrefixManifest, store: Any, *, sample_len: int, tokenizer_spec: TokenizerSpec,
                 cache: CacheConfig | None = None, threads: int = 2):
        self.manifest, self.sample_len = manifest, sample_len
        self.chunks = manifest.chunks()
        self.objects = PinnedObjects(manifest, store)
        cache = cache or CacheConfig.from_env()
        tok_key = tokenizer_spec.name.replace(":", "-")
        key = f"inplace/{manifest.version_id}/{tok_key}/L{sample_len}"
        self.tier = CacheTier(Path(cache.local_dir), cache.local_max_bytes)
        self.shared = CacheTier(Path(cache.shared_dir)) if cache.shared_dir else None
        self.key = key
        self.counts_dir = Path(cache.local_dir).parent / "inplace-counts" / key  # tiny, never evicted
        self.counts_dir.mkdir(parents=True, exist_ok=True)
        self.stats = CacheStats()
        self._encode, self._dtype = tokenizer_spec.load()
        self._layouts: dict[int, ParquetLayout] = {}
        self._windows: OrderedDict[int, np.ndarray] = OrderedDict()
        self._counts: dict[int, int] = {}
        self._lock = threading.Lock()
        self._threads = max(1, threads)
        self._pool = ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix="inplace-chunk")
        self._inflight: dict[int, Future[np.ndarray]] = {}
        _READERS.add(self)

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    # ---- one chunk ---------------------------------------------------------------------------------

    def _where(self, chunk: Chunk) -> str:
        return f"s3://{self.manifest.bucket}/{self.manifest.objects[chunk.obj].key} [{chunk.start}, {chunk.end})"

    def documents(self, c: int) -> list[str]:
        chunk = self.chunks[c]
        where = self._where(chunk)
        fmt = self.manifest.format
        if fmt == "parquet":
            with self._lock:
                layout = self._layouts.get(chunk.obj)
            if layout is None:
                layout = ParquetLayout(self.objects, chunk.obj, self.manifest.text_field)
                with self._lock:
                    self._layouts[chunk.obj] = layout
            return layout.documents(chunk, where)
        base, data = self._owned(chunk, chunk.end)
        where = f"s3://{self.manifest.bucket}/{self.manifest.objects[chunk.obj].key}"
        if fmt == "jsonl":
            return jsonl_documents(data, self.manifest.text_field, where, base)
        return text_documents(data, where, base)

    def _owned(self, chunk: Chunk, end: int) -> tuple[int, bytes]:
        """(offset, bytes) of the lines starting in [chunk.start, end), read pinned. Past the end by an eighth of
        the range (at most READ_AHEAD): the last line is usually finished by the same request."""
        ahead = min(READ_AHEAD, max(256, (end - chunk.start) // 8))
        return owned_span(lambda a, b: self.objects.read(chunk.obj, a, b), chunk.start, end,
                          self.manifest.objects[chunk.obj].size, read_ahead=ahead)

    def records(self, c: int, max_bytes: int | None = None) -> list[dict[str, Any]]:
        """The records chunk `c` owns, for the quality gate: each as its scalar fields (a JSON line's top-level
        fields, a Parquet row's columns, a text line as `text`), with `_parsed` False wherever training would
        refuse the record (not a JSON object, no text field, text that is not a string, not UTF-8): the gate
        counts them instead of failing on the first. `max_bytes`: read only the lines that start in the chunk's
        first `max_bytes` (the gate's bound on a sample)."""
        chunk = self.chunks[c]
        field = self.manifest.text_field
        if self.manifest.format == "parquet":
            self.documents(c)  # loads the object's layout (footer) once, and checks the text column's type
            layout = self._layouts[chunk.obj]
            out = []
            for g in owned_row_groups(layout.groups, chunk.start, chunk.end):
                out += [{**row, "_parsed": True} for row in layout.read(g).to_pylist()]
            return [_scalars(r) for r in out]
        _base, data = self._owned(chunk, chunk.end if max_bytes is None else min(chunk.end, chunk.start + max_bytes))
        lines = [line for line in data.split(b"\n") if line.strip()]
        out: list[dict[str, Any]] = []
        for line in lines:
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError:
                out.append({"_parsed": False})
                continue
            if self.manifest.format == "text":
                out.append({"text": text, "_parsed": True})
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError:
                obj = None
            ok = isinstance(obj, dict) and field in obj and (obj[field] is None or isinstance(obj[field], str))
            out.append(_scalars({**obj, "_parsed": True}) if ok else {"_parsed": False})  # type: ignore[dict-item]
        return out

    def _tokenize(self, c: int) -> np.ndarray:
        docs = [self._encode(d) for d in self.documents(c)]
        stream = np.concatenate(docs).astype(self._dtype, copy=False) if docs else np.zeros(0, self._dtype)
        n = len(stream) // self.sample_len
        if n >= 1 << WINDOW_BITS:
            raise DataFormatError(f"{self._where(self.chunks[c])} packs into {n} samples, more than a chunk may hold")
        return stream[: n * self.sample_len].reshape(n, self.sample_len)

    def _load(self, c: int) -> np.ndarray:
        name = f"{self.key}/{c}.npy"
        if (p := self.tier.lookup(name)) is not None:
            try:
                windows = np.load(p, mmap_mode="r")
                self.stats.add(local_hits=1)
                return windows
            except (FileNotFoundError, ValueError):  # evicted or half-visible: read it again
                pass
        if self.shared is not None and (sp := self.shared.lookup(name)) is not None:
            try:  # another node of the pool tokenized it: copy it to this node's tier
                windows = np.load(sp)
                self._publish(self.tier, name, windows)
                self._write_count(c, len(windows))
                self.stats.add(shared_hits=1, bytes_from_shared=windows.nbytes)
                return windows
            except (FileNotFoundError, ValueError, OSError):
                pass
        before = self.objects.bytes_read
        windows = self._tokenize(c)
        path = self._publish(self.tier, name, windows)
        if self.shared is not None:
            try:
                self._publish(self.shared, name, windows)
            except OSError as exc:  # the shared tier is an optimisation: never fail a read because of it
                logger.warning("could not publish %s to the shared cache %s: %s", name, self.shared.root, exc)
        self._write_count(c, len(windows))
        self.stats.add(store_fetches=1, bytes_from_store=self.objects.bytes_read - before)
        try:  # kept as a map of the published file: page cache, not this process's memory
            return np.load(path, mmap_mode="r")
        except (FileNotFoundError, ValueError):  # evicted already (a tier smaller than a few chunks)
            return windows

    @staticmethod
    def _publish(tier: CacheTier, name: str, windows: np.ndarray) -> Path:
        fd, tmp = tier.temp_file(name)
        try:
            with os.fdopen(fd, "wb") as f:
                np.save(f, windows)
            return tier.publish(tmp, name, windows.nbytes)[0]
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _write_count(self, c: int, n: int) -> None:
        path = self.counts_dir / str(c)
        if not path.exists():
            tmp = path.with_name(f".{c}.{os.getpid()}.{threading.get_ident()}")
            tmp.write_text(str(n))
            os.replace(tmp, path)
        with self._lock:
            self._counts[c] = n

    def chunk_windows(self, c: int) -> np.ndarray:
        """The chunk's samples, (windows, sample_len), read and tokenized if not cached (waits for a prefetch)."""
        with self._lock:
            hit = self._windows.get(c)
            if hit is not None:
                self._windows.move_to_end(c)
                return hit
        fut = self._future(c)
        windows = fut.result()
        self._keep(c, windows)
        return windows

    def _future(self, c: int) -> Future[np.ndarray]:
        """The load of chunk `c` in flight, or a new one. Its result goes to the bounded `_windows` when done and
        it leaves `_inflight` then, awaited or not (a chunk read only to be counted is not kept in flight)."""
        with self._lock:
            fut = self._inflight.get(c)
            fresh = fut is None
            if fresh:
                fut = self._pool.submit(self._load, c)
                self._inflight[c] = fut
        assert fut is not None
        if fresh:  # outside the lock: a load that already finished runs the callback here, and it takes the lock
            fut.add_done_callback(lambda f, c=c: self._done(c, f))
        return fut

    def _done(self, c: int, fut: Future[np.ndarray]) -> None:
        with self._lock:
            if self._inflight.get(c) is fut:
                del self._inflight[c]
        if not fut.cancelled() and fut.exception() is None:
            self._keep(c, fut.result())

    def _keep(self, c: int, windows: np.ndarray) -> None:
        with self._lock:
            self._windows[c] = windows
            self._windows.move_to_end(c)
            while len(self._windows) > KEEP_CHUNKS:  # mapped files, mostly: a bound on what stays open
                self._windows.popitem(last=False)

    def windows(self, c: int) -> int:
        """How many samples chunk `c` packs into (its count file, else read and tokenize it)."""
        with self._lock:
            if (n := self._counts.get(c)) is not None:
                return n
        try:
            n = int((self.counts_dir / str(c)).read_text())
        except (FileNotFoundError, ValueError):
            n = len(self.chunk_windows(c))
        with self._lock:
            self._counts[c] = n
        return n

    # ---- the reader interface (as shards.ShardReader) ----------------------------------------------

    def get(self, ids: Sequence[int]) -> np.ndarray:
        out = np.empty((len(ids), self.sample_len), dtype=np.int64)
        for row, sid in enumerate(ids):
            c, w = split_sample_id(int(sid))
            out[row] = self.chunk_windows(c)[w]
        return out

    def prefetch(self, ids: Sequence[int]) -> None:
        """Read and tokenize, in the background, the chunks of the given upcoming samples."""
        self._submit(sorted({split_sample_id(int(sid))[0] for sid in ids}))

    def warm_counts(self, chunks: Sequence[int]) -> None:
        """Start reading, in parallel, the chunks among these whose sample counts are not known yet (ChunkOrder
        calls it with a group's chunks before it counts them)."""
        with self._lock:
            unknown = [c for c in chunks if c not in self._counts]
        self._submit([c for c in unknown if not (self.counts_dir / str(c)).exists()])

    def _after_fork(self) -> None:
        """In a forked child (a DataLoader worker): the parent's threads, held locks and HTTP connections did not
        come along. New locks, pool and S3 client; nothing in flight."""
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix="inplace-chunk")
        self._inflight = {}
        self._layouts = {}
        self.objects = PinnedObjects(self.manifest, open_data_store(self.manifest))

    def _submit(self, chunks: Sequence[int]) -> None:
        for c in chunks:
            with self._lock:
                known = c in self._windows
            if not known:
                self._future(c)

    def verify(self) -> list[str]:
        return []  # every read is pinned (version id or If-Match): a changed object fails the read itself

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._windows.clear()
        _READERS.discard(self)


def open_data_store(manifest: PrefixManifest) -> Any:
    """An S3 handle on the manifest's bucket with this process's credentials (a worker: the job's own identity)."""
    from trainforge.infra.storage.s3 import S3ObjectStore

    return S3ObjectStore.from_url(f"s3://{manifest.bucket}")
