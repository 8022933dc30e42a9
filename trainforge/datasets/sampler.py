"""The deterministic global sample order. Pure.

The order is a function of (seed, dataset version, epoch) only: a Feistel-free, portable construction that uses
numpy's PCG64 seeded from sha256(seed, version, epoch) to permute sample indices. The position in the stream is one
integer (samples consumed globally), so a resume at any world size continues exactly: the global batch for step k
is samples [k*B, (k+1)*B) of the stream, and data-parallel rank r of d takes the r-th contiguous 1/d of it.
Held-out evaluation samples are removed from the stream by a fixed split of indices.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
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
def _epoch_order(train_key: tuple[int, float, str], seed: int, epoch: int) -> np.ndarray:
    num_samples, eval_fraction, version = train_key
    train = split_indices(num_samples, eval_fraction, version).train
    rng = np.random.Generator(np.random.PCG64(_epoch_seed(seed, version, epoch)))
    return train[rng.permutation(len(train))]


@dataclass(frozen=True, slots=True)
class SampleOrder:
    num_samples: int
    eval_fraction: float
    version: str
    seed: int

    @property
    def train_size(self) -> int:
        return len(split_indices(self.num_samples, self.eval_fraction, self.version).train)

    def global_indices(self, start: int, count: int) -> list[int]:
        """Sample indices at stream positions [start, start+count), crossing epochs as needed."""
        n = self.train_size
        if n == 0:
            raise ValueError("the dataset has no training samples after the held-out split")
        out: list[int] = []
        pos = start
        while len(out) < count:
            epoch, offset = divmod(pos, n)
            order = _epoch_order((self.num_samples, self.eval_fraction, self.version), self.seed, epoch)
            take = min(count - len(out), n - offset)
            out.extend(int(i) for i in order[offset : offset + take])
            pos += take
        return out

    def rank_slice(self, step: int, global_batch: int, dp_rank: int, dp_degree: int) -> list[int]:
        """The samples data-parallel rank `dp_rank` consumes for optimizer step `step`."""
        if global_batch % dp_degree:
            raise ValueError(f"global batch {global_batch} not divisible by dp degree {dp_degree}")
        per_rank = global_batch // dp_degree
        batch = self.global_indices(step * global_batch, global_batch)
        return batch[dp_rank * per_rank : (dp_rank + 1) * per_rank]

    def eval_indices(self, count: int) -> list[int]:
        ev = split_indices(self.num_samples, self.eval_fraction, self.version).eval
        return [int(i) for i in ev[:count]]
