"""Chunking in-place objects: every record belongs to exactly one chunk, however the byte ranges fall."""

from __future__ import annotations

import random

import pytest

from trainforge.datasets.chunks import Chunk, owned_row_groups, owned_span, plan_chunks
from trainforge.datasets.prefix_manifest import PrefixManifest, SourceObject, derived_name, matches, split_ref


def test_plan_chunks_covers_each_object_exactly():
    sizes = [0, 1, 10, 4096, 4097, 12345]
    chunks = plan_chunks(sizes, 1000)
    for i, size in enumerate(sizes):
        mine = [c for c in chunks if c.obj == i]
        assert len(mine) == -(-size // 1000)
        if mine:
            assert mine[0].start == 0 and mine[-1].end == size
            assert all(a.end == b.start for a, b in zip(mine, mine[1:], strict=False))
            assert max(c.end - c.start for c in mine) - min(c.end - c.start for c in mine) <= 1
    with pytest.raises(ValueError):
        plan_chunks([10], 0)


def owned_lines(read, start: int, end: int, size: int, **kw) -> bytes:
    return owned_span(read, start, end, size, **kw)[1]


def _reader(data: bytes, log: list | None = None):
    def read(a: int, b: int) -> bytes:
        if log is not None:
            log.append((a, b))
        return data[a:b]
    return read


def test_short_lines_take_one_read():
    data = b"".join(b"line %d\n" % i for i in range(100))
    log: list = []
    for c in plan_chunks([len(data)], 100):
        log.clear()
        owned_lines(_reader(data, log), c.start, c.end, len(data), read_ahead=32)
        assert len(log) == 1


@pytest.mark.parametrize("seed", range(40))
def test_owned_lines_partition_the_lines(seed):
    rng = random.Random(seed)
    lines = [b"x" * rng.choice([0, 1, 2, 5, 30, 200]) for _ in range(rng.randint(0, 40))]
    data = b"\n".join(lines) + (b"\n" if rng.random() < 0.5 else b"")
    chunk_bytes = rng.choice([1, 2, 3, 7, 64, 1000])
    got = b"".join(owned_lines(_reader(data), c.start, c.end, len(data), read_ahead=rng.choice([1, 3, 64]))
                   for c in plan_chunks([len(data)], chunk_bytes))
    assert got == data  # concatenated in order, the chunks' lines are the object, each line once


def test_a_long_line_belongs_to_the_chunk_it_starts_in():
    data = b"a\n" + b"b" * 100 + b"\nc\n"
    log: list = []
    assert owned_lines(_reader(data, log), 0, 10, len(data), read_ahead=16) == b"a\n" + b"b" * 100 + b"\n"
    assert log == [(0, 26), (26, 58), (58, 105)]  # read_ahead past the end, then doubling reads to the newline
    assert owned_lines(_reader(data), 10, 50, len(data)) == b""  # starts inside the long line: owns nothing
    assert owned_lines(_reader(data), 50, len(data), len(data)) == b"c\n"
    assert owned_lines(_reader(data), 2, 3, len(data)) == b"b" * 100 + b"\n"  # byte 1 is '\n': a line starts at 2


def test_owned_lines_refuses_a_range_outside_the_object():
    with pytest.raises(ValueError):
        owned_lines(_reader(b"abc"), 2, 5, 3)


def test_row_groups_by_midpoint():
    groups = [(4, 100), (104, 10), (114, 300)]  # midpoints 54, 109, 264
    assert owned_row_groups(groups, 0, 60) == [0]
    assert owned_row_groups(groups, 60, 200) == [1]
    assert owned_row_groups(groups, 200, 414) == [2]
    # any cut of the file assigns each group exactly once
    for cut in range(0, 415, 7):
        assert sorted(owned_row_groups(groups, 0, cut) + owned_row_groups(groups, cut, 415)) == [0, 1, 2]


def test_split_ref_and_matching():
    assert split_ref("s3://b/corpus/en") == ("b", "corpus/en", "")
    assert split_ref("s3://b/corpus/en/") == ("b", "corpus/en", "")
    assert split_ref("s3://b/corpus/*/part-*.jsonl") == ("b", "corpus", "*/part-*.jsonl")
    assert split_ref("s3://b") == ("b", "", "")
    assert matches("a/part-1.jsonl", "", "jsonl") and not matches("a/part-1.parquet", "", "jsonl")
    assert not matches("_SUCCESS", "", "text") and not matches(".hidden/x.txt", "", "text")
    assert not matches("dir/", "", "text")
    assert matches("en/part-1.jsonl", "*/part-*.jsonl", "jsonl") and not matches("part-1.jsonl", "*/part-*.jsonl", "jsonl")
    assert derived_name("My_Bucket", "Corpus/EN v2/") == "s3.my_bucket.corpus.en-v2"


def test_prefix_manifest_digest_pins_every_object():
    objs = (SourceObject("p/a.jsonl", 10, '"e1"'), SourceObject("p/b.jsonl", 20, '"e2"', "v7"))
    m = PrefixManifest("s3.b.p", "s3://b/p", "", "jsonl", "text", "MIT", 1 << 20, True, objs)
    again = PrefixManifest.from_dict(m.to_dict())
    assert again == m and again.version_id == m.version_id
    changed = PrefixManifest("s3.b.p", "s3://b/p", "", "jsonl", "text", "MIT", 1 << 20, True,
                             (objs[0], SourceObject("p/b.jsonl", 20, '"e3"', "v8")))
    assert changed.version_id != m.version_id
    assert m.bucket == "b" and m.prefix == "p" and m.total_bytes == 30
    assert m.chunks() == [Chunk(0, 0, 10), Chunk(1, 0, 20)]
    with pytest.raises(ValueError):
        PrefixManifest.from_dict({"kind": "shards"})
