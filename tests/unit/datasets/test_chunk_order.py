"""The in-place sample order: deterministic, world-size independent, resumable from an anchor, lazy."""

from __future__ import annotations

import random

import pytest

from trainforge.datasets.chunk_order import (
    WINDOW_BITS,
    Anchor,
    ChunkOrder,
    EmptyStreamError,
    sample_id,
    split_sample_id,
)


def _counts(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice([0, 1, 3, 7, 20]) for _ in range(n)]


def _order(counts, **kw):
    asked: list[int] = []

    def windows(c: int) -> int:
        asked.append(c)
        return counts[c]

    kw.setdefault("group_chunks", 3)
    order = ChunkOrder(len(counts), kw.pop("eval_fraction", 0.1), "v1", kw.pop("seed", 7), windows, **kw)
    return order, asked


def test_ids_round_trip():
    assert split_sample_id(sample_id(12345, 678)) == (12345, 678)
    assert sample_id(1, 0) == 1 << WINDOW_BITS
    with pytest.raises(ValueError):
        sample_id(0, 1 << WINDOW_BITS)


def test_each_epoch_is_every_training_sample_once():
    counts = _counts(40)
    order, _ = _order(counts)
    train = {sample_id(int(c), w) for c in order.train_chunks for w in range(counts[int(c)])}
    held = {sample_id(int(c), w) for c in order.eval_chunks for w in range(counts[int(c)])}
    assert train and not train & held
    n = len(train)
    epoch0 = order.global_indices(0, n)
    epoch1 = order.global_indices(n, n)
    assert sorted(epoch0) == sorted(train) == sorted(epoch1) and epoch0 != epoch1
    assert order.global_indices(n - 3, 6) == epoch0[-3:] + epoch1[:3]  # crosses the epoch boundary


def test_same_global_order_at_any_world_size_and_when_rebuilt():
    counts = _counts(30, seed=3)
    a, _ = _order(counts)
    b, _ = _order(counts)
    for step in range(10):
        whole = a.global_indices(step * 12, 12)
        for d in (1, 2, 3, 4, 6):
            parts = [x for r in range(d) for x in b.rank_slice(step, 12, r, d)]
            assert parts == whole


def test_resume_from_an_anchor_replays_without_counting_earlier_chunks():
    counts = _counts(60, seed=5)
    full, _ = _order(counts)
    expected = full.global_indices(0, 400)
    anchor = full.anchor(250)
    assert anchor.position <= 250
    resumed, asked = _order(counts, anchor=Anchor.from_dict(anchor.to_dict()))
    assert resumed.global_indices(250, 1) == expected[250:251]
    # only the anchor's group was counted to find position 250, not the groups before it
    assert set(asked) == set(resumed.group_members(anchor.epoch, anchor.group))
    assert resumed.global_indices(250, 150) == expected[250:400]


def test_counts_only_what_it_walks():
    counts = [5] * 1000
    order, asked = _order(counts, group_chunks=4)
    order.global_indices(0, 30)
    assert len(set(asked)) <= 8  # two groups of four chunks, not a thousand chunks


def test_skip_removes_samples_and_keeps_everything_before_them():
    counts = _counts(30, seed=9)
    plain, _ = _order(counts)
    stream = plain.global_indices(0, 100)
    bad = stream[60:64]
    skipped, _ = _order(counts, skip=bad)
    got = skipped.global_indices(0, 96)
    assert got[:60] == stream[:60] and not set(bad) & set(got)
    assert got[60:96] == [i for i in stream[64:] + plain.global_indices(100, 10) if i not in bad][:36]


def test_warm_sees_a_group_before_it_is_counted():
    counts = [2] * 12
    seen: list[list[int]] = []
    order = ChunkOrder(12, 0.0, "v", 1, lambda c: counts[c], group_chunks=4, warm=seen.append)
    order.global_indices(0, 9)
    assert [len(g) for g in seen] == [4, 4] and len({c for g in seen for c in g}) == 8


def test_eval_indices_are_held_out_chunks_in_order():
    counts = [4] * 20
    order, _ = _order(counts, eval_fraction=0.2)
    ev = order.eval_indices(10)
    assert len(ev) == 10 and {split_sample_id(i)[0] for i in ev} <= {int(c) for c in order.eval_chunks}


def test_a_dataset_without_whole_samples_says_so():
    order, _ = _order([0] * 10)
    with pytest.raises(EmptyStreamError, match="seq_len"):
        order.global_indices(0, 1)
    empty = ChunkOrder(0, 0.1, "v", 1, lambda c: 3)
    with pytest.raises(EmptyStreamError):
        empty.global_indices(0, 1)
