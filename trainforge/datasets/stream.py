"""Streaming shards from object storage through cache tiers: local disk -> shared folder -> object store.

- `CacheTier`: a folder of verified shard files, LRU-evicted by bytes. Safe with several processes on one node:
  files appear by rename (never half-written), eviction runs under an flock, and a reader that has a shard mapped
  keeps reading it after another process unlinks it (POSIX); a shard evicted between lookup and open is fetched
  again.
- `ShardFetcher`: local tier, then the optional shared tier (e.g. an NFS mount shared by a node pool), then the
  store (ranged reads in chunks, hashed while downloading, verified against the manifest's sha256 before the file
  becomes visible). A background thread pool fetches shards ahead of need (`prefetch`).
- `StreamingShardReader`: a ShardReader whose shards come through a ShardFetcher; datasets larger than the local
  cache work (shards are evicted and fetched again as the order moves on).
- `open_reader(path, manifest)`: the reader for a resolved version folder: local shards, or streaming when the
  folder holds `source.json` (a version in a remote catalog).

Configuration (environment): TRAINFORGE_DATA_CACHE (local tier folder, default $TRAINFORGE_HOME/cache/shards),
TRAINFORGE_DATA_CACHE_GB (local tier bound, default 20), TRAINFORGE_DATA_SHARED_CACHE (shared tier folder, unset =
no shared tier), TRAINFORGE_DATA_FETCH_THREADS (default 4).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from trainforge.datasets.catalog import SOURCE_FILE
from trainforge.datasets.manifest import DatasetManifest, ShardInfo
from trainforge.datasets.shards import ShardReader
from trainforge.home import home
from trainforge.infra.storage import ObjectStore, open_store

logger = logging.getLogger(__name__)
CHUNK = 8 << 20


class ShardIntegrityError(IOError):
    pass


@dataclass
class CacheStats:
    local_hits: int = 0
    shared_hits: int = 0
    store_fetches: int = 0
    bytes_from_store: int = 0
    bytes_from_shared: int = 0
    evictions: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)

    @property
    def lookups(self) -> int:
        return self.local_hits + self.shared_hits + self.store_fetches

    def hit_rate(self) -> float:
        return self.local_hits / self.lookups if self.lookups else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"local_hits": self.local_hits, "shared_hits": self.shared_hits, "store_fetches": self.store_fetches,
                "bytes_from_store": self.bytes_from_store, "bytes_from_shared": self.bytes_from_shared,
                "evictions": self.evictions, "local_hit_rate": round(self.hit_rate(), 4)}


class CacheTier:
    """Verified shard files under `root/{key}`; `max_bytes` None = unbounded. Access order is kept in mtimes."""

    def __init__(self, root: Path, max_bytes: int | None = None):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes

    def path(self, key: str) -> Path:
        return self.root / key

    def lookup(self, key: str) -> Path | None:
        p = self.path(key)
        try:
            os.utime(p)  # mark as recently used
        except FileNotFoundError:
            return None
        return p

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.root / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def temp_file(self, key: str) -> tuple[int, Path]:
        dest = self.path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".part-")
        return fd, Path(tmp)

    def publish(self, tmp: Path, key: str, size: int, keep: str | None = None) -> tuple[Path, int]:
        """Make room for `size` bytes (LRU), then rename `tmp` into place. Returns (path, files evicted)."""
        evicted = self.make_room(size, keep=key) if self.max_bytes is not None else 0
        dest = self.path(key)
        os.replace(tmp, dest)
        return dest, evicted

    def _entries(self) -> list[tuple[float, int, Path]]:
        out = []
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                if name.startswith("."):
                    continue
                p = Path(dirpath) / name
                with contextlib.suppress(FileNotFoundError):
                    st = p.stat()
                    out.append((st.st_mtime, st.st_size, p))
        return out

    def usage(self) -> int:
        return sum(size for _t, size, _p in self._entries())

    def make_room(self, size: int, keep: str | None = None) -> int:
        assert self.max_bytes is not None
        with self._locked():
            entries = sorted(self._entries())
            total = sum(s for _t, s, _p in entries)
            evicted = 0
            for _mtime, s, p in entries:
                if total + size <= self.max_bytes:
                    break
                if keep is not None and p == self.path(keep):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
                    evicted += 1
                total -= s
            return evicted


def _copy_verified(src_chunks: Iterator[bytes], fd: int, expected_sha: str, what: str) -> int:
    h = hashlib.sha256()
    n = 0
    with os.fdopen(fd, "wb") as f:
        for chunk in src_chunks:
            h.update(chunk)
            f.write(chunk)
            n += len(chunk)
    if h.hexdigest() != expected_sha:
        raise ShardIntegrityError(f"{what}: sha256 {h.hexdigest()[:16]}... does not match the manifest's "
                                  f"{expected_sha[:16]}...")
    return n


def _file_chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            yield block


class ShardFetcher:
    """Brings shards of one dataset version to local disk through the tiers, verified; prefetches in threads."""

    def __init__(self, store: ObjectStore, prefix: str, version: str, local: CacheTier,
                 shared: CacheTier | None = None, *, threads: int = 4, chunk: int = CHUNK):
        self.store, self.prefix, self.version = store, prefix.strip("/"), version
        self.local, self.shared = local, shared
        self.chunk = chunk
        self.stats = CacheStats()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="shard-fetch")
        self._inflight: dict[str, Future[Path]] = {}
        self._lock = threading.Lock()

    def _key(self, info: ShardInfo) -> str:
        return f"{self.version}/{info.file}"

    def _ranged(self, key: str, size: int) -> Iterator[bytes]:
        for off in range(0, size, self.chunk):
            yield self.store.get_bytes(key, (off, min(size, off + self.chunk)))

    def _fetch(self, info: ShardInfo) -> Path:
        key = self._key(info)
        if (p := self.local.lookup(key)) is not None:
            self.stats.add(local_hits=1)
            return p
        if self.shared is not None and (sp := self.shared.lookup(key)) is not None:
            fd, tmp = self.local.temp_file(key)
            try:
                n = _copy_verified(_file_chunks(sp), fd, info.sha256, f"shared cache {sp}")
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            path, ev = self.local.publish(tmp, key, n)
            self.stats.add(shared_hits=1, bytes_from_shared=n, evictions=ev)
            return path
        fd, tmp = self.local.temp_file(key)
        try:
            n = _copy_verified(self._ranged(f"{self.prefix}/{info.file}", info.bytes), fd, info.sha256,
                               f"{self.store.url}/{self.prefix}/{info.file}")
            if self.shared is not None:
                self._publish_shared(tmp, key, n)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        path, ev = self.local.publish(tmp, key, n)
        self.stats.add(store_fetches=1, bytes_from_store=n, evictions=ev)
        return path

    def _publish_shared(self, verified: Path, key: str, size: int) -> None:
        assert self.shared is not None
        fd, tmp = self.shared.temp_file(key)
        os.close(fd)
        try:
            shutil.copyfile(verified, tmp)
            self.shared.publish(tmp, key, size)
        except OSError as exc:  # the shared tier is an optimisation: never fail a read because of it
            tmp.unlink(missing_ok=True)
            logger.warning("could not publish %s to the shared cache %s: %s", key, self.shared.root, exc)

    def get(self, info: ShardInfo) -> Path:
        """The local path of a verified shard (waits for an in-flight prefetch of it)."""
        return self._future(info).result()

    def _future(self, info: ShardInfo) -> Future[Path]:
        key = self._key(info)
        with self._lock:
            fut = self._inflight.get(key)
            fresh = fut is None or (fut.done() and (fut.exception() is not None or not fut.result().exists()))
            if fresh:
                fut = self._pool.submit(self._fetch, info)
                self._inflight[key] = fut
        if fresh:
            # Outside the lock: a fetch that already finished runs the callback right here, and `_forget` takes
            # the same (non-reentrant) lock — registering it under the lock deadlocked when the fetch was fast.
            fut.add_done_callback(lambda f, k=key: self._forget(k, f))
        return fut

    def _forget(self, key: str, fut: Future[Path]) -> None:
        with self._lock:
            if self._inflight.get(key) is fut:
                del self._inflight[key]

    def prefetch(self, infos: Sequence[ShardInfo]) -> None:
        for info in infos:
            if self.local.lookup(self._key(info)) is None:
                self._future(info)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class StreamingShardReader(ShardReader):
    """Random access to samples of a version whose shards live in an object store."""

    def __init__(self, manifest: DatasetManifest, fetcher: ShardFetcher, *, max_open: int = 8,
                 prefetch_shards: int = 2):
        super().__init__(Path(fetcher.local.root) / fetcher.version, manifest, max_open=max_open)
        self.fetcher = fetcher
        self.prefetch_shards = prefetch_shards

    def shard_path(self, i: int) -> Path:
        return self.fetcher.get(self.manifest.shards[i])

    def _table(self, i: int):  # type: ignore[no-untyped-def]
        try:
            return super()._table(i)
        except FileNotFoundError:  # evicted by another process between fetch and open: fetch again
            return super()._table(i)

    def prefetch(self, indices: Sequence[int]) -> None:
        """Fetch, in the background, the shards the given upcoming samples live in (in first-use order)."""
        seen: list[int] = []
        for idx in indices:
            shard = self.locate(idx)[0]
            if shard not in seen and shard not in self._tables:
                seen.append(shard)
        self.fetcher.prefetch([self.manifest.shards[s] for s in seen])

    def verify(self) -> list[str]:
        return []  # every shard is verified against the manifest's sha256 as it is fetched

    def close(self) -> None:
        self.fetcher.close()


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheConfig:
    local_dir: Path
    local_max_bytes: int | None
    shared_dir: Path | None = None
    threads: int = 4

    @classmethod
    def from_env(cls) -> CacheConfig:
        gb = float(os.environ.get("TRAINFORGE_DATA_CACHE_GB", "20"))
        shared = os.environ.get("TRAINFORGE_DATA_SHARED_CACHE")
        return cls(local_dir=Path(os.environ.get("TRAINFORGE_DATA_CACHE") or home() / "cache" / "shards"),
                   local_max_bytes=int(gb * 2**30), shared_dir=Path(shared) if shared else None,
                   threads=int(os.environ.get("TRAINFORGE_DATA_FETCH_THREADS", "4")))


def streaming_reader(store: ObjectStore, prefix: str, manifest: DatasetManifest,
                     cache: CacheConfig | None = None) -> StreamingShardReader:
    cache = cache or CacheConfig.from_env()
    biggest = max((s.bytes for s in manifest.shards), default=0)
    if cache.local_max_bytes is not None and cache.local_max_bytes < 2 * biggest:
        logger.warning("the local shard cache (%d bytes) holds fewer than two shards of %d bytes: expect refetches",
                       cache.local_max_bytes, biggest)
    fetcher = ShardFetcher(store, prefix, manifest.version_id, CacheTier(cache.local_dir, cache.local_max_bytes),
                           CacheTier(cache.shared_dir) if cache.shared_dir else None, threads=cache.threads)
    return StreamingShardReader(manifest, fetcher)


def open_reader(path: Path, manifest: DatasetManifest, cache: CacheConfig | None = None) -> ShardReader:
    """The reader for a resolved version folder: its local shards, or streaming when it names a remote source."""
    source = path / SOURCE_FILE
    if not source.is_file():
        return ShardReader(path, manifest)
    src = json.loads(source.read_text())
    if src["store_url"].startswith("lakefs://"):
        from trainforge.datasets.lakefs_catalog import open_lakefs_store

        store: ObjectStore = open_lakefs_store(src["store_url"])  # type: ignore[assignment]
    else:
        store = open_store(src["store_url"])
    return streaming_reader(store, src["prefix"], manifest, cache)
