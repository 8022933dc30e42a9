"""The deterministic global sample order. Pure.

The order is a function of (seed, dataset version, epoch) only: a Feistel-free, portable construction that uses
numpy's PCG64 seeded from sha256(seed, version, epoch) to permute sample indices. The position in the stream is one
integer (samples consumed globally), so a resume at any world size continues exactly: the global batch for step k
is samples [k*B, (k+1)*B) of the stream, and data-parallel rank r of d takes the r-th contiguous 1/d of it.
Held-out evaluation samples are removed from the stream by a fixed split of indices.

Two opt-in refinements leave the default order (and so every existing run's resume) unchanged:
- `skip`: sample indices removed from the stream (divergence rollback: resume from the last good checkpoint with
  the offending batch's samples skipped). Removal keeps the relative order of everything else, so positions before
  the first skipped sample are untouched and a resume from such a position continues exactly.
- `window` (with `shard_sizes`): a streaming-friendly order: a permutation of the shards, then a shuffle within
  consecutive blocks of `window` samples, so a reader touches about one shard at a time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np


def _epoch_seed(seed: int, version: str, epoch: int) -> int:
    digest = hashlib.sha256(f"{seed}:{version}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


@dataclass(frozen=True, slots=True)
class Split:
    train: np.ndarray
    eval: np.ndarray


@lru_cache(maxsize=8)
def split_indices(num_samples: int, eval_fraction: float, version: str) -> Split:
    """Deterministic held-out split: a version-seeded permutation; the first n_eval indices are evaluation."""
    n_eval = int(num_samples * eval_fraction)
    if eval_fraction > 0 and num_samples >= 2:
        n_eval = max(1, n_eval)
    perm = np.random.Generator(np.random.PCG64(_epoch_seed(0, version, -1))).permutation(num_samples)
    return Split(train=np.sort(perm[n_eval:]), eval=np.sort(perm[:n_eval]))


@lru_cache(maxsize=4)
def _epoch_order(train_key: tuple[int, float, str], seed: int, epoch: int,
                 layout: tuple[int, tuple[int, ...]] = (0, ()), skip: frozenset[int] = frozenset()) -> np.ndarray:
    num_samples, eval_fraction, version = train_key
    train = split_indices(num_samples, eval_fraction, version).train
    rng = np.random.Generator(np.random.PCG64(_epoch_seed(seed, version, epoch)))
    window, shard_sizes = layout
    order = train[rng.permutation(len(train))] if not window else _windowed(train, shard_sizes, window, rng)
    if skip:
        order = order[~np.isin(order, np.fromiter(skip, dtype=np.int64, count=len(skip)))]
    return order


def _windowed(train: np.ndarray, shard_sizes: tuple[int, ...], window: int, rng: np.random.Generator) -> np.ndarray:
    """Shards in a random order; within the concatenation, a shuffle inside each block of `window` samples."""
    bounds = np.cumsum((0, *shard_sizes))
    if bounds[-1] < (train[-1] + 1 if len(train) else 0):
        raise ValueError(f"shard sizes sum to {bounds[-1]}, fewer than the dataset's samples")
    shard_of = np.searchsorted(bounds, train, side="right") - 1
    by_shard = [train[shard_of == s] for s in range(len(shard_sizes))]
    seq = np.concatenate([by_shard[s] for s in rng.permutation(len(shard_sizes))]) if by_shard else train
    out = seq.copy()
    for start in range(0, len(seq), window):
        block = seq[start : start + window]
        out[start : start + len(block)] = block[rng.permutation(len(block))]
    return out


def rank_slice(global_indices: Callable[[int, int], list[int]], step: int, global_batch: int, dp_rank: int,
               dp_degree: int) -> list[int]:
    """Rank `dp_rank`'s contiguous 1/dp_degree of step `step`'s global batch (positions [step*B, (step+1)*B) of a
    stream): the same rule for every order, so any world size sees the same global batches."""
    if global_batch % dp_degree:
        raise ValueError(f"global batch {global_batch} not divisible by dp degree {dp_degree}")
    per_rank = global_batch // dp_degree
    batch = global_indices(step * global_batch, global_batch)
    return batch[dp_rank * per_rank : (dp_rank + 1) * per_rank]


@dataclass(frozen=True, slots=True)
class SampleOrder:
    num_samples: int
    eval_fraction: float
    version: str
    seed: int
    skip: frozenset[int] = frozenset()
    """Sample indices left out of the stream (divergence rollback); empty = the plain order."""
    window: int = 0
    """0: a full permutation per epoch. >0: shard permutation + shuffle within blocks of `window` samples."""
    shard_sizes: tuple[int, ...] = ()
    """Samples per shard, in manifest order (needed with `window`)."""

    def __post_init__(self) -> None:
        if self.window < 0:
            raise ValueError(f"window must be >= 0, got {self.window}")
        if self.window and sum(self.shard_sizes) != self.num_samples:
            raise ValueError(f"shard_sizes sum to {sum(self.shard_sizes)}, the dataset has {self.num_samples} samples")
        if not isinstance(self.skip, frozenset):
            object.__setattr__(self, "skip", frozenset(int(i) for i in self.skip))

    def _order(self, epoch: int) -> np.ndarray:
        return _epoch_order((self.num_samples, self.eval_fraction, self.version), self.seed, epoch,
                            (self.window, self.shard_sizes), self.skip)

    @property
    def train_size(self) -> int:
        """Samples per epoch of the stream (training split, minus skipped samples)."""
        if self.skip:
            return len(self._order(0))
        return len(split_indices(self.num_samples, self.eval_fraction, self.version).train)

    def with_skip(self, indices: Iterable[int]) -> SampleOrder:
        """The same order with more samples skipped."""
        return replace(self, skip=self.skip | frozenset(int(i) for i in indices))

    def global_indices(self, start: int, count: int) -> list[int]:
        """Sample indices at stream positions [start, start+count), crossing epochs as needed."""
        n = self.train_size
        if n == 0:
            raise ValueError("the dataset has no training samples after the held-out split")
        out: list[int] = []
        pos = start
        while len(out) < count:
            epoch, offset = divmod(pos, n)
            order = self._order(epoch)
            take = min(count - len(out), n - offset)
            out.extend(int(i) for i in order[offset : offset + take])
            pos += take
        return out

    def rank_slice(self, step: int, global_batch: int, dp_rank: int, dp_degree: int) -> list[int]:
        """The samples data-parallel rank `dp_rank` consumes for optimizer step `step`."""
        return rank_slice(self.global_indices, step, global_batch, dp_rank, dp_degree)

    def eval_indices(self, count: int) -> list[int]:
        ev = split_indices(self.num_samples, self.eval_fraction, self.version).eval
        return [int(i) for i in ev[:count]]
