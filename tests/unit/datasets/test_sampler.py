"""The deterministic sampler: elastic safety (same global order at any world size; resume at another world size
continues exactly), the skip list and the windowed order. Property tests with hypothesis.

Run: .venv/bin/python -m pytest tests/unit/datasets/test_sampler.py -q
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainforge.datasets.sampler import SampleOrder

VERSION = "v" * 64
DIVISORS = {12: [1, 2, 3, 4, 6, 12]}


def _run(order: SampleOrder, steps: int, global_batch: int, schedule: list[tuple[int, int]]) -> list[list[int]]:
    """Global batches consumed by a run that switches world size at the given steps (a restart from the position,
    which is the loader's only state). schedule: (start_step, world_size), sorted."""
    batches = []
    for step in range(steps):
        world = [w for s, w in schedule if s <= step][-1]
        batch = []
        for rank in range(world):  # each rank computes its own slice independently
            batch.extend(order.rank_slice(step, global_batch, rank, world))
        batches.append(batch)
    return batches


def _digest(samples: np.ndarray) -> str:
    return hashlib.sha256(samples.tobytes()).hexdigest()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32), n=st.integers(30, 400), restart=st.integers(1, 15), restart2=st.integers(1, 15),
       worlds=st.lists(st.sampled_from([1, 2, 3, 4, 6, 12]), min_size=3, max_size=3),
       window=st.sampled_from([0, 7]))
def test_restarts_at_other_world_sizes_consume_the_same_global_batches(seed, n, restart, restart2, worlds, window):
    sizes = (n // 3, n // 3, n - 2 * (n // 3))
    order = SampleOrder(n, 0.1, VERSION, seed, window=window, shard_sizes=sizes if window else ())
    steps, gb = 20, 12
    reference = _run(order, steps, gb, [(0, 1)])
    a, b = sorted((restart, restart2))
    elastic = _run(order, steps, gb, [(0, worlds[0]), (a, worlds[1]), (b, worlds[2])])
    assert elastic == reference
    # and the data behind the indices hashes the same (order and multiset of every global batch)
    data = np.arange(n * 4, dtype=np.int64).reshape(n, 4)
    assert [_digest(data[x]) for x in elastic] == [_digest(data[x]) for x in reference]


def test_world_size_4_2_3_with_a_restart_matches_an_uninterrupted_run():
    order = SampleOrder(1000, 0.05, VERSION, 7)
    reference = _run(order, 50, 12, [(0, 4)])
    assert _run(order, 50, 12, [(0, 4), (17, 2), (31, 3)]) == reference


def test_default_order_is_unchanged_by_the_new_options():
    # the plain order is exactly the PCG64 permutation of the train split, as before (bit-exact resume of old runs)
    a = SampleOrder(500, 0.1, VERSION, 3)
    b = SampleOrder(500, 0.1, VERSION, 3, skip=frozenset(), window=0)
    assert a.global_indices(0, 1500) == b.global_indices(0, 1500)


def test_each_epoch_is_a_permutation_of_the_train_split():
    order = SampleOrder(300, 0.1, VERSION, 1)
    n = order.train_size
    for epoch in range(3):
        got = order.global_indices(epoch * n, n)
        assert len(set(got)) == n
        assert not set(got) & set(order.eval_indices(1000))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 1000), skip=st.sets(st.integers(0, 199), max_size=20))
def test_skip_removes_samples_and_keeps_the_rest_in_order(seed, skip):
    base = SampleOrder(200, 0.0, VERSION, seed)
    skipped = base.with_skip(skip)
    full = base.global_indices(0, 200)
    assert skipped.global_indices(0, skipped.train_size) == [i for i in full if i not in skip]
    assert skipped.train_size == 200 - len(skip)


def test_divergence_rollback_resumes_exactly_with_the_bad_batch_skipped():
    order = SampleOrder(400, 0.0, VERSION, 5)
    gb, ckpt_step, bad_step = 8, 10, 12
    bad = order.rank_slice(bad_step, gb, 0, 1)
    rolled = order.with_skip(bad)
    # everything up to the checkpoint is unchanged, so resuming from it is exact
    for step in range(ckpt_step + 2):
        assert rolled.rank_slice(step, gb, 0, 1) == order.rank_slice(step, gb, 0, 1)
    after = [i for s in range(ckpt_step, ckpt_step + 6) for i in rolled.rank_slice(s, gb, 0, 2)
             + rolled.rank_slice(s, gb, 1, 2)]
    assert not set(after) & set(bad)
    expected = [i for i in order.global_indices(ckpt_step * gb, 7 * gb) if i not in bad][: 6 * gb]
    assert after == expected


def test_windowed_order_reads_about_one_shard_at_a_time():
    sizes = (100,) * 10
    order = SampleOrder(1000, 0.0, VERSION, 2, window=50, shard_sizes=sizes)
    idx = order.global_indices(0, 1000)
    assert sorted(idx) == list(range(1000))
    shards_per_window = [len({i // 100 for i in idx[s : s + 50]}) for s in range(0, 1000, 50)]
    assert max(shards_per_window) <= 2
    assert order.global_indices(0, 1000) != SampleOrder(1000, 0.0, VERSION, 3, window=50,
                                                         shard_sizes=sizes).global_indices(0, 1000)


def test_windowed_order_needs_the_shard_sizes():
    with pytest.raises(ValueError, match="shard_sizes"):
        SampleOrder(100, 0.0, VERSION, 0, window=10, shard_sizes=(50,))


def test_global_batch_must_divide_by_dp_degree():
    with pytest.raises(ValueError, match="not divisible"):
        SampleOrder(100, 0.0, VERSION, 0).rank_slice(0, 10, 0, 3)
