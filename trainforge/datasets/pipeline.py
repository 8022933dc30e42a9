"""Online preprocessing: per-sample transforms run in DataLoader worker processes, pipelined with training.

`StepSource` computes one data-parallel rank's batch for one optimizer step: the deterministic sample indices,
the tokens (local or streamed shards), then the user's transforms (`"module:function"` names, each called as
`fn(sample: np.ndarray, index: int) -> np.ndarray` with a fixed-length result) in order. `StepLoader` runs it in
`num_workers` processes through torch's DataLoader: worker w produces steps start+w, start+w+W, ..., the loader
hands them back in step order, and at most `num_workers * prefetch` batches wait in the queue (bounded memory).
The loader records the time the training loop waits for each batch (`wait_s`), so stalls are visible.
Transforms must be deterministic in (sample, index) for a resumed run to see the same data.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch.utils.data as tud

Transform = Callable[[np.ndarray, int], np.ndarray]


def load_transform(name: str) -> Transform:
    module, _, func = name.partition(":")
    if not module or not func:
        raise ValueError(f"transform {name!r}: expected 'module:function'")
    try:
        return getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"transform {name!r} cannot be loaded: {exc}") from None


@dataclass
class StepSource:
    """Picklable recipe for one rank's batch at a step (opened lazily in each worker process)."""

    path: str
    ref: str
    eval_fraction: float
    seed: int
    global_batch: int
    dp_rank: int
    dp_degree: int
    transforms: Sequence[str] = ()
    skip: Sequence[int] = ()
    """Sample ids removed from the stream (the sampler's divergence-rollback skip list)."""
    seq_len: int = 0
    """Tokens per training sequence (an in-place version packs samples of seq_len + 1)."""
    tokenizer: str = ""
    """An in-place version's tokenizer (ResolvedDataset.tokenizer)."""
    anchor: dict[str, int] | None = None
    """An in-place version's resume anchor (chunk_order.Anchor as a dict), from the checkpoint resumed."""
    _state: dict[str, Any] = field(default_factory=dict, repr=False)

    def _open(self) -> dict[str, Any]:
        if not self._state:
            from trainforge.datasets.chunk_order import Anchor
            from trainforge.datasets.training_data import open_training_data

            data = open_training_data(self.path, self.ref, eval_fraction=self.eval_fraction, seed=self.seed,
                                      seq_len=self.seq_len, skip=self.skip, tokenizer_name=self.tokenizer,
                                      anchor=Anchor.from_dict(self.anchor) if self.anchor else None)
            self._state.update(reader=data.reader, order=data.order,
                               fns=[load_transform(t) for t in self.transforms])
        return self._state

    def indices(self, step: int) -> list[int]:
        return self._open()["order"].rank_slice(step, self.global_batch, self.dp_rank, self.dp_degree)

    def __call__(self, step: int) -> np.ndarray:
        st = self._open()
        idx = self.indices(step)
        st["reader"].prefetch(self.indices(step + 1))
        batch = st["reader"].get(idx)
        for fn in st["fns"]:
            batch = np.stack([fn(row, i) for row, i in zip(batch, idx, strict=True)])
        return batch

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_state"} | {"_state": {}}


class _Steps(tud.IterableDataset):
    """(step, batch) for steps [start, end), split round-robin over the DataLoader's workers."""

    def __init__(self, source: StepSource, start: int, end: int):
        self.source, self.start, self.end = source, start, end

    def __iter__(self) -> Iterator[tuple[int, np.ndarray]]:
        info = tud.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        for step in range(self.start + wid, self.end, nw):
            yield step, self.source(step)


def _identity(x: Any) -> Any:
    return x


class StepLoader:
    """Iterate (step, batch) for steps [start, end) with batches made in worker processes, in step order."""

    def __init__(self, source: StepSource, start: int, end: int, *, num_workers: int = 2, prefetch: int = 2,
                 mp_context: str | None = None, timeout_s: float = 300.0):
        self.source, self.start, self.end = source, start, end
        self.num_workers, self.prefetch, self.mp_context = num_workers, prefetch, mp_context
        self.timeout_s = timeout_s  # a worker that produces nothing for this long fails the loop (never hangs)
        self.wait_s: list[float] = []

    def __iter__(self) -> Iterator[tuple[int, np.ndarray]]:
        ds = _Steps(self.source, self.start, self.end)
        if self.num_workers == 0:
            it: Iterator[Any] = iter(ds)  # type: ignore[arg-type]
        else:
            loader = tud.DataLoader(ds, batch_size=None, num_workers=self.num_workers,
                                    prefetch_factor=self.prefetch, multiprocessing_context=self.mp_context,
                                    collate_fn=_identity, timeout=self.timeout_s if self.timeout_s else 0)
            it = iter(loader)
        while True:
            t0 = time.perf_counter()
            try:
                step, batch = next(it)
            except StopIteration:
                return
            self.wait_s.append(time.perf_counter() - t0)
            yield step, batch
