"""Arrow IPC shards of fixed-length token samples, and a reader that maps global sample indices to tokens.

A shard is an Arrow IPC file with one column `tokens: fixed_size_list<uint16|uint32>[sample_len]`, plus optional
feature columns `fixed_size_list<uint16>[dim]` holding bf16/fp16 values as raw 16-bit words (Arrow has no bf16
type; the words are viewed as torch.bfloat16/float16 without a copy). The reader memory-maps shards, so a
random-access read costs a page fault, not a file read.
"""

from __future__ import annotations

import bisect
import hashlib
import warnings
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from trainforge.datasets.manifest import FEATURE_DTYPES, DatasetManifest, ShardInfo


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def to_bf16_words(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even (as torch's .to(torch.bfloat16))."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))
    words = (rounded >> 16).astype(np.uint16)
    nan = np.isnan(values)
    words[nan] = 0x7FC0
    return words


def feature_words(dtype: str, values: np.ndarray) -> np.ndarray:
    """A feature column's values as 16-bit words: uint16 words as given, float16 bits, or float -> bf16 bits."""
    if dtype not in FEATURE_DTYPES:
        raise ValueError(f"feature dtype {dtype!r} is not one of {FEATURE_DTYPES}")
    if values.ndim != 2:
        raise ValueError(f"a feature column must be (num_samples, dim), got shape {values.shape}")
    if values.dtype == np.uint16:
        return values
    if dtype == "float16":
        return values.astype(np.float16).view(np.uint16)
    return to_bf16_words(values)


def write_shard(path: Path, samples: np.ndarray,
                features: Mapping[str, tuple[str, np.ndarray]] | None = None, *,
                max_chunksize: int | None = 4096) -> ShardInfo:
    """Write a (num_samples, sample_len) integer array (and optional (num_samples, dim) 16-bit feature columns,
    given as name -> (dtype, values)) as one Arrow IPC shard, atomically. max_chunksize=None writes one record
    batch, which the reader maps without any copy."""
    n, length = samples.shape
    arrow_type = pa.uint16() if samples.dtype == np.uint16 else pa.uint32()
    columns: dict[str, Any] = {
        "tokens": pa.FixedSizeListArray.from_arrays(pa.array(samples.reshape(-1), type=arrow_type), length)
    }
    for name, (dtype, values) in (features or {}).items():
        words = feature_words(dtype, values)
        if words.shape[0] != n:
            raise ValueError(f"feature {name!r} has {words.shape[0]} rows, the shard has {n} samples")
        columns[name] = pa.FixedSizeListArray.from_arrays(pa.array(words.reshape(-1), type=pa.uint16()),
                                                          words.shape[1])
    table = pa.table(columns)
    tmp = path.with_suffix(".tmp")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=max_chunksize)
    tmp.replace(path)
    return ShardInfo(file=path.name, num_samples=n, bytes=path.stat().st_size, sha256=sha256_file(path))


_WORDS = {pa.uint16(): np.dtype(np.uint16), pa.uint32(): np.dtype(np.uint32)}


def _column_words(table: pa.Table, name: str, width: int) -> np.ndarray:
    """The column's values as an (n, width) array, over the memory map when the shard is one record batch.

    Read from the values buffer, not with `to_numpy`: pyarrow's `to_numpy` imports pandas to check for pandas
    types, 0.25 s of CPU in every worker that reads a shard."""
    col = table.column(name)
    values = (col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()).flatten()
    nulls = col.null_count + values.null_count  # a null row would vanish in flatten and shift the rows after it
    if nulls or values.type not in _WORDS:
        raise ValueError(f"column {name!r}: {values.type} with {nulls} nulls; a shard holds "
                         f"{' or '.join(map(str, _WORDS))} words without nulls (write_shard)")
    if len(values) == 0:
        return np.empty((0, width), dtype=_WORDS[values.type])
    words = np.frombuffer(values.buffers()[1], dtype=_WORDS[values.type])
    return words[values.offset: values.offset + len(values)].reshape(-1, width)


class ShardReader:
    """Random access to samples of one dataset version stored as local shards.

    `max_open` bounds how many shards stay mapped (None: all); subclasses override `shard_path` to fetch shards
    from elsewhere (see stream.StreamingShardReader)."""

    def __init__(self, root: Path, manifest: DatasetManifest, *, max_open: int | None = None):
        self.root = root
        self.manifest = manifest
        self._offsets = manifest.shard_offsets()
        self._tables: OrderedDict[int, pa.Table] = OrderedDict()
        self._arrays: dict[tuple[int, str], np.ndarray] = {}
        self.max_open = max_open

    def shard_path(self, i: int) -> Path:
        return self.root / self.manifest.shards[i].file

    def _table(self, i: int) -> pa.Table:
        if i in self._tables:
            self._tables.move_to_end(i)
            return self._tables[i]
        source = pa.memory_map(str(self.shard_path(i)), "r")
        table = pa.ipc.open_file(source).read_all()
        self._tables[i] = table
        if self.max_open is not None and len(self._tables) > self.max_open:
            old, _ = self._tables.popitem(last=False)
            for key in [k for k in self._arrays if k[0] == old]:
                del self._arrays[key]
        return table

    def _column(self, i: int, name: str) -> np.ndarray:
        table = self._table(i)
        key = (i, name)
        if key not in self._arrays:
            width = self.manifest.sample_len if name == "tokens" else self.manifest.features[name]["dim"]
            self._arrays[key] = _column_words(table, name, width)
        return self._arrays[key]

    def _shard(self, i: int) -> np.ndarray:
        return self._column(i, "tokens")

    def locate(self, idx: int) -> tuple[int, int]:
        """(shard, row) of a global sample index."""
        shard = bisect.bisect_right(self._offsets, idx) - 1
        return shard, idx - self._offsets[shard]

    def get(self, indices: Sequence[int]) -> np.ndarray:
        """Samples at the given global indices, as an int64 array (len(indices), sample_len)."""
        out = np.empty((len(indices), self.manifest.sample_len), dtype=np.int64)
        for row, idx in enumerate(indices):
            shard, r = self.locate(idx)
            out[row] = self._shard(shard)[r]
        return out

    def feature_view(self, shard: int, name: str) -> Any:
        """A whole shard's feature column as a torch bf16/fp16 tensor that shares memory with the mapped file."""
        import torch

        words = self._column(shard, name)
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[self.manifest.features[name]["dtype"]]
        with warnings.catch_warnings():  # the map is read-only; torch warns about non-writable arrays
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(words).view(dtype)

    def features(self, name: str, indices: Sequence[int]) -> Any:
        """Feature rows at the given global indices (gathered as 16-bit words, viewed as bf16/fp16: no float
        conversion)."""
        import torch

        dim = self.manifest.features[name]["dim"]
        words = np.empty((len(indices), dim), dtype=np.uint16)
        for row, idx in enumerate(indices):
            shard, r = self.locate(idx)
            words[row] = self._column(shard, name)[r]
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[self.manifest.features[name]["dtype"]]
        return torch.from_numpy(words).view(dtype)

    def prefetch(self, indices: Sequence[int]) -> None:
        """Hint: these samples are needed soon (local shards: nothing to do; see stream.StreamingShardReader)."""

    def close(self) -> None:
        self._tables.clear()
        self._arrays.clear()

    def verify(self) -> list[str]:
        """Files whose sha256 does not match the manifest (empty when intact)."""
        bad = []
        for i, info in enumerate(self.manifest.shards):
            p = self.shard_path(i)
            if not p.is_file() or sha256_file(p) != info.sha256:
                bad.append(info.file)
        return bad
