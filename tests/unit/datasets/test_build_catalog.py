"""Dataset build (text / JSONL / Parquet, parallel tokenization, packing, bad rows with file and row, nothing
half-written), the embedded catalog over an ObjectStore (branches, immutable tags, prefixes) and 16-bit feature
columns viewed as torch tensors without a copy.

Run: .venv/bin/python -m pytest tests/unit/datasets/test_build_catalog.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from trainforge.datasets import tokenizer
from trainforge.datasets.build import BuildConfig, BuildError, build_dataset, build_version_dir
from trainforge.datasets.catalog import CatalogError, EmbeddedCatalog
from trainforge.datasets.demo import DEMO_NAME, build_demo_dataset
from trainforge.datasets.manifest import DatasetManifest, ShardInfo
from trainforge.datasets.refs import resolve_reference
from trainforge.datasets.shards import ShardReader, to_bf16_words, write_shard

DOCS = [f"document number {i} " + "lorem ipsum " * (i % 7 + 1) for i in range(200)]


def _jsonl(path: Path, docs: list[object]) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def _expected_samples(docs: list[str], sample_len: int) -> np.ndarray:
    return tokenizer.pack([tokenizer.encode(d) for d in docs], sample_len)


@pytest.mark.parametrize("workers", [1, 2])
def test_jsonl_build_packs_in_order_whatever_the_worker_count(tmp_path, workers):
    src = _jsonl(tmp_path / "a.jsonl", DOCS)
    cfg = BuildConfig(license="MIT", seq_len=31, num_workers=workers, docs_per_task=16, max_shard_bytes=64 * 50)
    ds = build_dataset(src, "web", cfg)
    assert len(ds.manifest.shards) > 1  # bounded shard size
    got = ShardReader(ds.path, ds.manifest).get(range(ds.manifest.num_samples))
    np.testing.assert_array_equal(got, _expected_samples(DOCS, 32))
    assert ds.manifest.provenance["documents"] == 200
    assert ds.license == "MIT"


def test_version_id_does_not_depend_on_workers(tmp_path):
    src = _jsonl(tmp_path / "a.jsonl", DOCS)
    a = build_dataset(src, "one", BuildConfig(license="MIT", seq_len=15, num_workers=1))
    b = build_dataset(src, "one", BuildConfig(license="MIT", seq_len=15, num_workers=2, docs_per_task=7))
    assert a.version == b.version


def test_text_and_parquet_sources(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "x.txt").write_text(DOCS[0])
    pq.write_table(pa.table({"text": DOCS[1:50], "id": list(range(49))}), tmp_path / "src" / "y.parquet")
    ds = build_dataset(tmp_path / "src", "mixed", BuildConfig(license="MIT", seq_len=15, num_workers=1))
    got = ShardReader(ds.path, ds.manifest).get(range(ds.manifest.num_samples))
    np.testing.assert_array_equal(got, _expected_samples(DOCS[:50], 16))


def test_no_pack_pads_each_document(tmp_path):
    src = _jsonl(tmp_path / "a.jsonl", ["ab", "c" * 100])
    ds = build_dataset(src, "pad", BuildConfig(license="MIT", seq_len=7, num_workers=1, pack=False))
    rows = ShardReader(ds.path, ds.manifest).get([0, 1])
    assert rows[0].tolist() == [tokenizer.BOS, 97, 98, tokenizer.EOS] + [tokenizer.PAD] * 4
    assert rows[1].tolist() == [tokenizer.BOS] + [99] * 7


def test_bad_rows_are_reported_with_file_and_row_and_nothing_is_committed(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    _jsonl(src / "a.jsonl", DOCS[:20])
    (src / "b.jsonl").write_text('{"text": "fine"}\n{"text": 3}\n{oops\n\n{"text": "   "}\n{"body": "x"}\n')
    pq.write_table(pa.table({"text": ["ok", None, "fine"]}), src / "c.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), src / "d.parquet")
    (src / "e.txt").write_bytes(b"\xff\xfe not utf8")
    catalog = EmbeddedCatalog()
    with pytest.raises(BuildError) as err:
        build_dataset(src, "bad", BuildConfig(license="MIT", seq_len=15, num_workers=2), catalog=catalog)
    rows = {(Path(b.file).name, b.row) for b in err.value.bad_rows}
    assert rows == {("b.jsonl", 2), ("b.jsonl", 3), ("b.jsonl", 5), ("b.jsonl", 6), ("c.parquet", 2),
                    ("d.parquet", 0), ("e.txt", 0)}
    assert "b.jsonl:3: invalid JSON" in str(err.value)
    assert catalog.names() in ([], ["bad"])
    if catalog.names():
        assert catalog.versions("bad") == []
    assert not list(Path(catalog.root).rglob("manifest.json"))
    with pytest.raises(CatalogError):
        catalog.resolve("bad")
    # --skip-bad: the same source builds, and the skipped rows are counted
    ds = build_dataset(src, "bad", BuildConfig(license="MIT", seq_len=15, num_workers=1, skip_bad=True),
                       catalog=catalog)
    assert ds.manifest.provenance["skipped_rows"] == 7


def test_a_failure_mid_build_leaves_no_version(tmp_path, monkeypatch):
    src = _jsonl(tmp_path / "a.jsonl", DOCS)
    import trainforge.datasets.build as build_mod

    calls = {"n": 0}
    real = build_mod.write_shard

    def failing_write_shard(*a, **kw):  # the third shard write fails: a disk filling mid-build
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk full")
        return real(*a, **kw)

    monkeypatch.setattr(build_mod, "write_shard", failing_write_shard)
    catalog = EmbeddedCatalog()
    with pytest.raises(OSError, match="disk full"):
        build_dataset(src, "web", BuildConfig(license="MIT", seq_len=15, num_workers=1, max_shard_bytes=200),
                      catalog=catalog)
    assert catalog.versions("web") == []
    assert not [p for p in (Path(catalog.root) / "web" / "versions").iterdir()]


def test_file_reference_output(tmp_path):
    src = _jsonl(tmp_path / "a.jsonl", DOCS)
    out = tmp_path / "out" / "v1"
    ds = build_version_dir(src, out, "v1", BuildConfig(license="MIT", seq_len=15, num_workers=1))
    assert resolve_reference(out.as_uri()).version == ds.version
    with pytest.raises(BuildError, match="already exists"):
        build_version_dir(src, out, "v1", BuildConfig(license="MIT", seq_len=15, num_workers=1))


def test_too_little_text_is_an_error(tmp_path):
    with pytest.raises(BuildError, match="fewer than one sample"):
        build_dataset(_jsonl(tmp_path / "a.jsonl", ["hi"]), "tiny", BuildConfig(license="MIT", seq_len=99))


def test_branches_move_and_tags_are_immutable(tmp_path):
    catalog = EmbeddedCatalog()
    a = build_dataset(_jsonl(tmp_path / "a.jsonl", DOCS[:50]), "d", BuildConfig(license="MIT", seq_len=15),
                      catalog=catalog)
    assert catalog.tag("d", "v1") == a.version
    assert catalog.tag("d", "v1", a.version[:10]) == a.version  # same version: idempotent
    b = build_dataset(_jsonl(tmp_path / "b.jsonl", DOCS[50:]), "d", BuildConfig(license="MIT", seq_len=15),
                      catalog=catalog)
    assert catalog.resolve("d", "main").version == b.version
    assert catalog.resolve("d", "v1").version == a.version
    with pytest.raises(CatalogError, match="immutable"):
        catalog.tag("d", "v1", "main")
    assert catalog.refs("d") == {"branches": {"main": b.version}, "tags": {"v1": a.version}}
    assert sorted(catalog.versions("d")) == sorted([a.version, b.version])
    # nothing has checked v1 yet: refused, naming the command that checks it; once checked, its verdict decides
    with pytest.raises(CatalogError, match=rf"no quality report.*`trainforge datasets check d@{a.version[:12]}`"):
        resolve_reference("catalog://d@v1")
    from trainforge.datasets.gate import run_and_store

    report = run_and_store(catalog.resolve("d", "v1"), catalog=catalog)
    assert not report["passed"]  # DOCS repeat themselves: about 38% of the samples are distinct
    with pytest.raises(CatalogError, match=r"failed its quality gate: .*\(sample_hash\)"):
        resolve_reference("catalog://d@v1")
    catalog.put_quality("d", a.version, {**report, "passed": True, "failures": []})  # as if a fixed gate passed it
    assert resolve_reference("catalog://d@v1").version == a.version


def test_catalog_in_a_prefix_of_a_store(tmp_path):
    from trainforge.infra.storage import LocalObjectStore

    store = LocalObjectStore(tmp_path / "bucket").scoped("teams/nlp/datasets")
    catalog = EmbeddedCatalog(store=store, prefix="teams/nlp/datasets")
    assert not catalog.local
    ds = build_dataset(_jsonl(tmp_path / "a.jsonl", DOCS), "d", BuildConfig(license="MIT", seq_len=15),
                       catalog=catalog)
    assert (ds.path / "source.json").is_file()
    assert store.exists(f"teams/nlp/datasets/d/versions/{ds.version}/manifest.json")
    assert catalog.names() == ["d"]
    from trainforge.datasets.stream import open_reader

    reader = open_reader(ds.path, ds.manifest)
    np.testing.assert_array_equal(reader.get(range(ds.manifest.num_samples)), _expected_samples(DOCS, 16))
    reader.close()


def test_existing_demo_version_id_is_stable():
    # Adding optional manifest fields must not change the version ids of existing datasets.
    m = DatasetManifest(name="x", shards=(ShardInfo("s", 1, 2, "h"),), sample_len=3, token_dtype="uint16",
                        vocab_size=260, tokenizer="t", license="MIT")
    assert "features" not in m.to_dict()
    assert DatasetManifest.from_dict(m.to_dict()).version_id == m.version_id
    ds = build_demo_dataset(max_bytes=200_000)
    assert ds.name == DEMO_NAME and ds.manifest.num_samples > 0


def test_bf16_and_fp16_features_are_viewed_without_a_copy(tmp_path):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (10, 9), dtype=np.uint16)
    emb = rng.standard_normal((10, 4)).astype(np.float32)
    half = rng.standard_normal((10, 2)).astype(np.float16)
    catalog = EmbeddedCatalog()
    features = {"emb": {"dtype": "bfloat16", "dim": 4}, "score": {"dtype": "float16", "dim": 2}}
    ds = catalog.commit("feat", lambda d: [write_shard(d / "s.arrow", tokens, {"emb": ("bfloat16", emb),
                                                                               "score": ("float16", half)},
                                                       max_chunksize=None)],
                        sample_len=9, token_dtype="uint16", vocab_size=260, tokenizer="byte-level-v1",
                        license="MIT", features=features)
    reader = ShardReader(ds.path, ds.manifest)
    view = reader.feature_view(0, "emb")
    assert view.dtype == torch.bfloat16 and view.shape == (10, 4)
    words = reader._column(0, "emb")
    assert view.data_ptr() == words.__array_interface__["data"][0]  # same memory as the mapped file
    torch.testing.assert_close(view, torch.from_numpy(emb).to(torch.bfloat16), rtol=0, atol=0)
    np.testing.assert_array_equal(to_bf16_words(emb), torch.from_numpy(emb).to(torch.bfloat16).view(torch.uint16)
                                  .numpy())
    rows = reader.features("score", [3, 1])
    assert rows.dtype == torch.float16
    torch.testing.assert_close(rows, torch.from_numpy(half[[3, 1]]), rtol=0, atol=0)
    np.testing.assert_array_equal(reader.get([2]), tokens[[2]])


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
@pytest.mark.parametrize("chunk", [None, 3])
def test_shards_of_one_or_many_record_batches_read_back_exactly(tmp_path, dtype, chunk):
    tokens = np.random.default_rng(1).integers(0, 60000, (10, 7)).astype(dtype)
    path = tmp_path / "s.arrow"
    write_shard(path, tokens, max_chunksize=chunk)
    manifest = DatasetManifest(name="t", shards=(ShardInfo(file=path.name, num_samples=10, bytes=1, sha256=""),),
                               sample_len=7, token_dtype=np.dtype(dtype).name, vocab_size=60000,
                               tokenizer="byte-level-v1", license="MIT")
    reader = ShardReader(tmp_path, manifest)
    np.testing.assert_array_equal(reader.get([9, 0, 4]), tokens[[9, 0, 4]].astype(np.int64))


def test_reading_a_shard_does_not_import_pandas(tmp_path):
    """pyarrow's `to_numpy` imports pandas (0.25 s of CPU in every worker): the reader reads the values buffer."""
    import subprocess
    import sys

    path = tmp_path / "s.arrow"
    write_shard(path, np.arange(70, dtype=np.uint16).reshape(10, 7))
    code = ("import sys, numpy as np, pyarrow as pa\n"
            "from trainforge.datasets.shards import _column_words\n"
            f"table = pa.ipc.open_file(pa.memory_map({str(path)!r}, 'r')).read_all()\n"
            "assert _column_words(table, 'tokens', 7)[3].tolist() == list(range(21, 28))\n"
            "print('pandas' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
