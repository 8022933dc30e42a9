"""The trainer's DataFeed with online preprocessing: with `dataset.num_workers` it reads through DataLoader worker
processes, and the batches are bitwise the ones the synchronous feed produces, in the same order (so resume stays
exact); a resume at a later step (a jump) restarts the workers there; transforms from the spec apply per sample;
the skip list is honoured; data-wait is measured per step.

Run: .venv/bin/python -m pytest tests/unit/datasets/test_datafeed_pipeline.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.segment_configs import segment_config
from trainforge.contract.config import SegmentConfig
from trainforge.datasets.catalog import EmbeddedCatalog
from trainforge.datasets.demo import tiny_dataset
from trainforge.trainer.loop import DataFeed


def plus_one(sample: np.ndarray, index: int) -> np.ndarray:
    return sample + 1


def _cfg(ds, **dataset) -> SegmentConfig:
    return segment_config(
        layout={"micro_batch_size": 2}, training={"global_batch_size": 8, "seq_len": 16, "seed": 5},
        total_steps=40, checkpoint_interval=10, skip_samples=[3, 17],
        dataset={"path": str(ds.path), "ref": "catalog://feed", "version": ds.version, "eval_fraction": 0.05,
                 **dataset})


@pytest.fixture
def ds():
    return tiny_dataset(EmbeddedCatalog(), "feed", 300, 17)


def _steps(feed: DataFeed, steps) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for s in steps:
        b = feed.step(s)
        out.append((torch.cat(b.inputs), torch.cat(b.targets)))
    return out


def _assert_bitwise(a, b) -> None:
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert xa.dtype == xb.dtype and xa.shape == xb.shape
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


@pytest.mark.parametrize("dp_rank", [0, 1])
def test_two_workers_give_the_same_batches_in_the_same_order(ds, dp_rank):
    plain = DataFeed(_cfg(ds), dp_rank, 2)
    assert plain.source is None  # default: synchronous, unchanged
    piped = DataFeed(_cfg(ds, num_workers=2), dp_rank, 2)
    try:
        steps = list(range(0, 40))  # 40 steps x 8 samples: past the end of the first epoch (285 training samples)
        _assert_bitwise(_steps(plain, steps), _steps(piped, steps))
        assert not hasattr(piped, "reader")  # the training process opens no reader: the workers do
        # a resume from a checkpoint at step 31: the workers restart there, still identical
        _assert_bitwise(_steps(plain, [31, 32, 33]), _steps(piped, [31, 32, 33]))
    finally:
        piped.close()
    assert piped._loader is None


def test_transforms_from_the_spec_apply_with_or_without_workers(ds):
    plain = DataFeed(_cfg(ds), 0, 1)
    inline = DataFeed(_cfg(ds, transforms=[f"{__name__}:plus_one"]), 0, 1)
    piped = DataFeed(_cfg(ds, transforms=[f"{__name__}:plus_one"], num_workers=2), 0, 1)
    try:
        base = _steps(plain, range(6))
        a, b = _steps(inline, range(6)), _steps(piped, range(6))
        _assert_bitwise(a, b)
        for (x, y), (x0, y0) in zip(a, base, strict=True):
            assert torch.equal(x.long(), x0.long() + 1) and torch.equal(y.long(), y0.long() + 1)
    finally:
        piped.close()


def test_skip_list_is_honoured_by_the_workers(ds):
    piped = DataFeed(_cfg(ds, num_workers=2), 0, 1)
    try:
        assert piped.source is not None and tuple(piped.source.skip) == (3, 17)
        for s in range(40):
            assert not {3, 17} & set(piped.source.indices(s))
    finally:
        piped.close()
