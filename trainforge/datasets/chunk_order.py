"""The deterministic sample order of an in-place dataset, whose samples are only counted as they are read. Pure.

An in-place dataset (a pinned s3:// prefix) is cut into chunks from its objects' sizes (`datasets.chunks`); a
chunk, once tokenized, packs into `windows(chunk)` fixed-length samples (the tail shorter than a sample is
dropped). A sample's id is `chunk << WINDOW_BITS | window`, stable whatever the order.

The order is a function of (seed, dataset version, epoch) and the chunks' contents only, as `SampleOrder`'s is:
- a fixed held-out split of the *chunks* (`sampler.split_indices` over chunk indices): evaluation reads whole
  chunks no training step sees;
- each epoch, a permutation of the training chunks, taken in groups of `group_chunks`; the samples of a group
  are shuffled together (so a global batch mixes several chunks' text) and the groups follow one another.
A position in the stream is one integer, samples consumed globally, so the global batch of step k is positions
[k*B, (k+1)*B) at any world size, and data-parallel rank r of d takes the r-th contiguous 1/d of it.

Only the windows of the groups walked are counted (their chunks tokenized): nothing scans the dataset up front.
The walk starts at position 0 or at an `Anchor` (where a group starts, as recorded with a checkpoint), so a resume
counts from its checkpoint's group, not from the start of the epoch.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from trainforge.datasets.sampler import rank_slice, split_indices

WINDOW_BITS = 24
"""A chunk packs into at most 2**24 samples (a 16 MiB chunk of one-token samples): ids fit int64 for 2**39 chunks."""


def sample_id(chunk: int, window: int) -> int:
    if not 0 <= window < 1 << WINDOW_BITS:
        raise ValueError(f"window {window} is out of range")
    return chunk << WINDOW_BITS | window


def split_sample_id(sid: int) -> tuple[int, int]:
    return sid >> WINDOW_BITS, sid & ((1 << WINDOW_BITS) - 1)


def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "little")


@dataclass(frozen=True, slots=True)
class Anchor:
    """Group `group` of epoch `epoch` starts at stream position `position`."""

    epoch: int
    group: int
    position: int

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "group": self.group, "position": self.position}

    @classmethod
    def from_dict(cls, d: dict[str, int]) -> Anchor:
        return cls(int(d["epoch"]), int(d["group"]), int(d["position"]))


class EmptyStreamError(ValueError):
    pass


class ChunkOrder:
    """Stream positions -> sample ids over chunks whose sample counts come from `windows(chunk)`."""

    def __init__(self, num_chunks: int, eval_fraction: float, version: str, seed: int,
                 windows: Callable[[int], int], *, group_chunks: int = 8, skip: Iterable[int] = (),
                 anchor: Anchor | None = None, cache_groups: int = 4,
                 warm: Callable[[list[int]], None] | None = None):
        if group_chunks < 1:
            raise ValueError(f"group_chunks must be >= 1, got {group_chunks}")
        self.num_chunks, self.eval_fraction, self.version, self.seed = num_chunks, eval_fraction, version, seed
        self.windows, self.group_chunks = windows, group_chunks
        self.skip = frozenset(int(i) for i in skip)
        split = split_indices(num_chunks, eval_fraction, version)
        self.train_chunks, self.eval_chunks = split.train, split.eval
        self.groups_per_epoch = -(-len(self.train_chunks) // group_chunks)
        # Known group starts, sorted by position: (position, epoch, group). Position 0 is always known.
        self._starts: list[tuple[int, int, int]] = [(0, 0, 0)]
        if anchor is not None and anchor.position > 0:
            self._starts.append((anchor.position, anchor.epoch, anchor.group))
        self._groups: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._cache_groups = cache_groups
        self._warm = warm  # called with a group's chunks before they are counted (a reader reads them in parallel)

    # ---- the order ---------------------------------------------------------------------------------

    def epoch_chunks(self, epoch: int) -> np.ndarray:
        rng = np.random.Generator(np.random.PCG64(_seed(self.seed, self.version, epoch, "chunks")))
        return self.train_chunks[rng.permutation(len(self.train_chunks))]

    def group_members(self, epoch: int, group: int) -> list[int]:
        """The chunks of group `group` of epoch `epoch`, in order."""
        g = self.group_chunks
        return [int(c) for c in self.epoch_chunks(epoch)[group * g : (group + 1) * g]]

    def group_samples(self, epoch: int, group: int) -> np.ndarray:
        """The sample ids of a group, in stream order (shuffled across its chunks, skipped ids removed)."""
        key = (epoch, group)
        if (hit := self._groups.get(key)) is not None:
            self._groups.move_to_end(key)
            return hit
        members = self.group_members(epoch, group)
        if self._warm is not None:
            self._warm(members)
        parts = [(c << WINDOW_BITS) + np.arange(self.windows(c), dtype=np.int64) for c in members]
        ids = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        rng = np.random.Generator(np.random.PCG64(_seed(self.seed, self.version, epoch, group, "samples")))
        ids = ids[rng.permutation(len(ids))]
        if self.skip:  # after the shuffle: removal keeps everything else where it was (a rollback resumes exactly)
            ids = ids[~np.isin(ids, np.fromiter(self.skip, np.int64, len(self.skip)))]
        self._groups[key] = ids
        while len(self._groups) > self._cache_groups:
            self._groups.popitem(last=False)
        return ids

    def _next(self, epoch: int, group: int) -> tuple[int, int]:
        return (epoch, group + 1) if group + 1 < self.groups_per_epoch else (epoch + 1, 0)

    def _walk_to(self, position: int) -> tuple[int, int, int]:
        """(start position, epoch, group) of the group holding stream position `position`."""
        if not self.groups_per_epoch:
            raise EmptyStreamError("the dataset has no training chunks after the held-out split")
        i = bisect.bisect_right(self._starts, (position, float("inf"), float("inf"))) - 1
        pos, epoch, group = self._starts[i]
        empty_run = 0
        while True:
            n = len(self.group_samples(epoch, group))
            if position < pos + n:
                return pos, epoch, group
            empty_run = empty_run + 1 if n == 0 else 0
            if empty_run > self.groups_per_epoch:
                raise EmptyStreamError("no chunk of the dataset's training split holds a whole sample: the "
                                       "documents are shorter than seq_len + 1 tokens in every chunk")
            pos += n
            epoch, group = self._next(epoch, group)
            start = (pos, epoch, group)
            j = bisect.bisect_left(self._starts, start)
            if j == len(self._starts) or self._starts[j] != start:
                self._starts.insert(j, start)

    def global_indices(self, start: int, count: int) -> list[int]:
        """Sample ids at stream positions [start, start + count), crossing groups and epochs as needed."""
        out: list[int] = []
        pos = start
        while len(out) < count:
            gpos, epoch, group = self._walk_to(pos)
            ids = self.group_samples(epoch, group)
            off = pos - gpos
            take = min(count - len(out), len(ids) - off)
            out.extend(int(i) for i in ids[off : off + take])
            pos += take
        return out

    def rank_slice(self, step: int, global_batch: int, dp_rank: int, dp_degree: int) -> list[int]:
        return rank_slice(self.global_indices, step, global_batch, dp_rank, dp_degree)

    def anchor(self, position: int) -> Anchor:
        """Where the group holding `position` starts: what a checkpoint at `position` records to resume from."""
        pos, epoch, group = self._walk_to(position)
        return Anchor(epoch, group, pos)

    def eval_indices(self, count: int) -> list[int]:
        """The first `count` samples of the held-out chunks, in chunk order."""
        out: list[int] = []
        for c in self.eval_chunks:
            if len(out) >= count:
                break
            n = min(self.windows(int(c)), count - len(out))
            out.extend(sample_id(int(c), w) for w in range(n))
        return out
