"""The restore's read plan (trainer/checkpointing/read_plan.py, pure): byte ranges to chunks, and which rank fetches
each chunk and who receives it. Exhaustive over small files, property-checked over random gangs.

Run: .venv/bin/python -m pytest tests/unit/test_read_plan.py -q
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainforge.trainer.checkpointing.read_plan import Chunk, assign, file_spans, spans_for_range


def entry(sizes: list[int], name: str = "f") -> dict:
    return {"name": name, "bytes": sum(sizes), "codec": None,
            "chunks": [[f"{name}{i:04d}", s] for i, s in enumerate(sizes)]}


def test_every_range_maps_to_exactly_the_chunks_under_it():
    spans = file_spans(entry([3, 1, 4, 2, 5]))
    size = 15
    for offset, length in itertools.product(range(size), range(1, size + 1)):
        if offset + length > size:
            continue
        got = spans_for_range(spans, offset, length)
        covered = {b for s in got for b in range(s.start, s.start + s.chunk.size)}
        wanted = set(range(offset, offset + length))
        assert wanted <= covered
        # minimal: every chunk returned holds at least one wanted byte
        assert all(wanted & set(range(s.start, s.start + s.chunk.size)) for s in got)
        assert got == sorted(got, key=lambda s: s.start)
    assert spans_for_range(spans, 5, 0) == []


def test_a_range_outside_the_file_or_a_manifest_that_does_not_add_up_is_refused():
    spans = file_spans(entry([3, 1]))
    with pytest.raises(ValueError, match="outside"):
        spans_for_range(spans, 2, 3)
    bad = entry([3, 1]) | {"bytes": 5}
    with pytest.raises(ValueError, match="add up to 4 bytes"):
        file_spans(bad)


chunks = st.builds(Chunk, st.sampled_from([f"{i:02x}" * 32 for i in range(24)]), st.integers(1, 50),
                   st.sampled_from([None, "zst"]))


@given(st.lists(st.lists(chunks, max_size=12), min_size=1, max_size=8))
def test_each_needed_chunk_is_fetched_once_by_a_rank_that_needs_it_and_sent_to_every_other(needs):
    # the same sha with two sizes cannot exist in a real manifest; keep one size per (sha, codec)
    canon: dict[tuple, Chunk] = {}
    needs = [[canon.setdefault((c.sha, c.codec), c) for c in rank] for rank in needs]
    world = len(needs)
    plan = assign(needs)
    assert len(plan) == world
    fetched = [c for r in plan for c in r.fetch]
    assert len(fetched) == len(set(fetched))  # once in all
    assert set(fetched) == {c for rank in needs for c in rank}
    owner = {c: r for r, reads in enumerate(plan) for c in reads.fetch}
    for r, rank_needs in enumerate(needs):
        got = set(plan[r].fetch) | {c for src in plan[r].recv.values() for c in src}
        assert got == set(rank_needs)  # everything needed, nothing else
        assert owner.keys() >= set(rank_needs)
        for c in plan[r].fetch:
            assert c in rank_needs  # only a rank that needs a chunk fetches it
        for src, received in plan[r].recv.items():
            assert src != r and all(owner[c] == src for c in received)
            assert plan[src].send[r] == received  # same chunks, same order: one all-to-all moves them
    assert sum(r.send_sizes(world)[d] for r in plan for d in range(world)) == \
        sum(r.recv_sizes(world)[s] for r in plan for s in range(world))
    assert assign(needs) == plan  # deterministic


def test_replicas_split_a_shared_shard_evenly():
    shard = [Chunk(f"{i:064x}", 100 + i % 7, None) for i in range(64)]
    other = [Chunk(f"{i + 1000:064x}", 100, None) for i in range(64)]
    # HSDP 2 x 2: ranks 0 and 2 hold shard A, ranks 1 and 3 shard B
    plan = assign([shard, other, shard, other])
    loads = [r.fetch_bytes() for r in plan]
    assert sum(loads) == sum(c.size for c in shard + other)
    assert max(loads[0], loads[2]) - min(loads[0], loads[2]) <= max(c.size for c in shard)
    assert max(loads[1], loads[3]) - min(loads[1], loads[3]) <= 100
    # every rank of a pure data-parallel gang of 8 reads about an eighth
    plan = assign([shard] * 8)
    loads = [r.fetch_bytes() for r in plan]
    assert max(loads) - min(loads) <= max(c.size for c in shard)
