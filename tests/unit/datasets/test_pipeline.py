"""Online preprocessing in worker processes: batches come back in step order, identical to computing them in
process (so resume stays exact), transforms apply per sample, the queue is bounded, and the training loop's wait
for data is measured and small when workers keep up.

Run: .venv/bin/python -m pytest tests/unit/datasets/test_pipeline.py -q
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from trainforge.datasets.catalog import EmbeddedCatalog
from trainforge.datasets.demo import tiny_dataset
from trainforge.datasets.pipeline import StepLoader, StepSource, load_transform


def reverse(sample: np.ndarray, index: int) -> np.ndarray:
    return sample[::-1] + index % 3


def slow_identity(sample: np.ndarray, index: int) -> np.ndarray:
    time.sleep(0.002)
    return sample


@pytest.fixture
def source():
    ds = tiny_dataset(EmbeddedCatalog(), "pipe", 400, 17)
    return StepSource(str(ds.path), "catalog://pipe", 0.0, 3, global_batch=8, dp_rank=1, dp_degree=2,
                      transforms=[f"{__name__}:reverse"])


def test_worker_batches_match_in_process_batches_in_step_order(source):
    loader = StepLoader(source, 5, 25, num_workers=2, prefetch=2)
    got = list(loader)
    assert [s for s, _ in got] == list(range(5, 25))
    inline = StepSource(**{k: v for k, v in vars(source).items() if k != "_state"})
    for step, batch in got:
        np.testing.assert_array_equal(batch, inline(step))
    assert len(loader.wait_s) == 20


def test_transforms_apply_per_sample(source):
    from pathlib import Path

    from trainforge.datasets.catalog import load_version_dir
    from trainforge.datasets.shards import ShardReader

    ds = load_version_dir(Path(source.path), source.ref)
    idx = source.indices(0)
    raw = ShardReader(ds.path, ds.manifest).get(idx)
    np.testing.assert_array_equal(source(0), np.stack([r[::-1] + i % 3 for r, i in zip(raw, idx, strict=True)]))


def test_data_wait_is_small_when_workers_keep_up(source):
    src = StepSource(**{**{k: v for k, v in vars(source).items() if k != "_state"},
                        "transforms": [f"{__name__}:slow_identity"]})  # ~8 ms of preprocessing per step
    loader = StepLoader(src, 0, 30, num_workers=2, prefetch=4)
    t_compute = 0.0
    for _step, _batch in loader:
        t0 = time.perf_counter()
        time.sleep(0.03)  # the "training step"
        t_compute += time.perf_counter() - t0
    steady = sum(loader.wait_s[3:])  # after the workers' start-up
    assert steady / t_compute < 0.1, (steady, t_compute)


def test_bad_transform_names_are_readable():
    with pytest.raises(ValueError, match="module:function"):
        load_transform("nocolon")
    with pytest.raises(ValueError, match="cannot be loaded"):
        load_transform("no_such_module_xyz:f")
