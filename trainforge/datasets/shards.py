"""Arrow IPC shards of fixed-length token samples, and a reader that maps global sample indices to tokens.

A shard is an Arrow IPC file with one column `tokens: fixed_size_list<uint16|uint32>[sample_len]`. The reader
memory-maps shards, so a random-access read costs a page fault, not a file read.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from trainforge.datasets.manifest import DatasetManifest, ShardInfo


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_shard(path: Path, samples: np.ndarray) -> ShardInfo:
    """Write a (num_samples, sample_len) integer array as one Arrow IPC shard."""
    n, length = samples.shape
    arrow_type = pa.uint16() if samples.dtype == np.uint16 else pa.uint32()
    flat = pa.array(samples.reshape(-1), type=arrow_type)
    column = pa.FixedSizeListArray.from_arrays(flat, length)
    table = pa.table({"tokens": column})
    tmp = path.with_suffix(".tmp")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=4096)
    tmp.replace(path)
    return ShardInfo(file=path.name, num_samples=n, bytes=path.stat().st_size, sha256=sha256_file(path))


class ShardReader:
    """Random access to samples of one dataset version stored as local shards."""

    def __init__(self, root: Path, manifest: DatasetManifest):
        self.root = root
        self.manifest = manifest
        self._offsets = manifest.shard_offsets()
        self._arrays: dict[int, np.ndarray] = {}

    def _shard(self, i: int) -> np.ndarray:
        if i not in self._arrays:
            info = self.manifest.shards[i]
            source = pa.memory_map(str(self.root / info.file), "r")
            table = pa.ipc.open_file(source).read_all()
            col = table.column("tokens").combine_chunks()
            values = col.flatten().to_numpy(zero_copy_only=False)
            self._arrays[i] = values.reshape(-1, self.manifest.sample_len)
        return self._arrays[i]

    def get(self, indices: Sequence[int]) -> np.ndarray:
        """Samples at the given global indices, as an int64 array (len(indices), sample_len)."""
        out = np.empty((len(indices), self.manifest.sample_len), dtype=np.int64)
        for row, idx in enumerate(indices):
            shard = bisect.bisect_right(self._offsets, idx) - 1
            out[row] = self._shard(shard)[idx - self._offsets[shard]]
        return out

    def verify(self) -> list[str]:
        """Files whose sha256 does not match the manifest (empty when intact)."""
        bad = []
        for info in self.manifest.shards:
            p = self.root / info.file
            if not p.is_file() or sha256_file(p) != info.sha256:
                bad.append(info.file)
        return bad
