"""A pinned version's sample order and reader, whichever kind of version it is: tokenized shards (the catalog,
file://, lakeFS) or an s3:// prefix read in place. Every consumer of training data (the trainer's feed, the
preprocessing workers, script mode's data_loader, offline evaluation, the divergence report) opens it here, so
they all see the same samples in the same order."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainforge.datasets import tokenizer
from trainforge.datasets.catalog import ResolvedDataset, load_version_dir
from trainforge.datasets.chunk_order import Anchor, ChunkOrder
from trainforge.datasets.prefix_manifest import PrefixManifest
from trainforge.datasets.sampler import SampleOrder

TOKENIZERS_DIR = "tokenizers"
GROUP_CHUNKS = 8
"""Chunks whose samples are shuffled together in an in-place dataset's order (chunk_order.ChunkOrder)."""


@dataclass
class TrainingData:
    version: ResolvedDataset
    order: Any
    """SampleOrder (shards) or ChunkOrder (in place): rank_slice, global_indices, eval_indices."""
    reader: Any
    """ShardReader / StreamingShardReader, or InPlaceReader: get, prefetch, close."""
    sample_len: int

    def close(self) -> None:
        self.reader.close()


def in_place_tokenizer(version_dir: Path, name: str) -> Any:
    """The tokenizer an in-place job reads with: byte-level, or a tokenizer.json saved (by content digest) with
    the pinned version when the job was submitted (`save_in_place_tokenizer`)."""
    from trainforge.datasets.inplace import TokenizerSpec

    if not name or name == tokenizer.NAME:
        return TokenizerSpec()
    path = version_dir / TOKENIZERS_DIR / f"{name.rsplit(':', 1)[-1]}.json"
    return TokenizerSpec(name=name, json_text=path.read_bytes().decode("utf-8"))


def save_in_place_tokenizer(version_dir: Path, tokenizer_json: str) -> str:
    """Keep a job's tokenizer.json beside an in-place version (content-addressed); returns its id."""
    name = tokenizer.pretrained_id(tokenizer_json)
    folder = version_dir / TOKENIZERS_DIR
    folder.mkdir(exist_ok=True)
    path = folder / f"{name.rsplit(':', 1)[-1]}.json"
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(tokenizer_json.encode("utf-8"))
        tmp.replace(path)
    return name


def open_training_data(path: str | Path, ref: str, *, eval_fraction: float, seed: int, seq_len: int,
                       skip: Any = (), tokenizer_name: str = "", anchor: Anchor | None = None,
                       expect_version: str | None = None) -> TrainingData:
    """The order and reader of the version in folder `path`; `expect_version`: refuse any other version."""
    from trainforge.datasets.stream import open_reader

    ds = load_version_dir(Path(path), ref)
    if expect_version is not None and ds.version != expect_version:
        raise RuntimeError(f"dataset at {path} is version {ds.version}, the job pinned {expect_version}")
    m = ds.manifest
    if isinstance(m, PrefixManifest):
        from trainforge.datasets.inplace import InPlaceReader, open_data_store

        reader = InPlaceReader(m, open_data_store(m), sample_len=seq_len + 1,
                               tokenizer_spec=in_place_tokenizer(ds.path, tokenizer_name))
        order = ChunkOrder(reader.num_chunks, eval_fraction, ds.version, seed, reader.windows,
                           group_chunks=GROUP_CHUNKS, skip=skip, anchor=anchor, warm=reader.warm_counts)
        return TrainingData(ds, order, reader, seq_len + 1)
    order = SampleOrder(m.num_samples, eval_fraction, ds.version, seed, skip=frozenset(skip))
    return TrainingData(ds, order, open_reader(ds.path, m), m.sample_len)


def eval_samples(dataset: Any, seed: int, seq_len: int, count: int) -> Any:
    """The first `count` held-out samples of a job's pinned version (`dataset`: the SegmentConfig's dataset), as
    an int64 array (n, seq_len + 1). The flow reads them with its own access and hands the offline evaluation a
    file: that process runs the user's model code, so it gets no object-store credentials."""
    import numpy as np

    data = open_training_data(dataset.path, dataset.ref, eval_fraction=dataset.eval_fraction, seed=seed,
                              seq_len=seq_len, tokenizer_name=dataset.tokenizer,
                              expect_version=dataset.require_pinned())
    try:
        idx = data.order.eval_indices(count)
        rows = data.reader.get(idx) if idx else np.zeros((0, seq_len + 1), np.int64)
        return np.ascontiguousarray(rows[:, : seq_len + 1], dtype=np.int64)
    finally:
        data.close()
