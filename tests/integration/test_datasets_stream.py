"""Streaming dataset shards from a real S3 server (SeaweedFS) through the cache tiers: catalog versions stored in
S3, sha256-verified fetches, LRU eviction with a cache smaller than the dataset, the shared tier, corruption
detection, and the quality gate refusing a bad version.

Run: .venv/bin/python -m pytest tests/integration/test_datasets_stream.py -q
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from trainforge.datasets.catalog import CatalogError, EmbeddedCatalog
from trainforge.datasets.refs import resolve_reference
from trainforge.datasets.sampler import SampleOrder
from trainforge.datasets.shards import ShardReader, write_shard
from trainforge.datasets.stream import CacheConfig, ShardIntegrityError, open_reader

pytestmark = pytest.mark.slow


def _commit(catalog: EmbeddedCatalog, name: str, data: np.ndarray, per_shard: int, license: str = "MIT"):
    def build(folder: Path):
        return [write_shard(folder / f"shard-{i // per_shard:05d}.arrow", data[i : i + per_shard])
                for i in range(0, len(data), per_shard)]

    return catalog.commit(name, build, sample_len=data.shape[1], token_dtype="uint16", vocab_size=260,
                          tokenizer="byte-level-v1", license=license)


@pytest.fixture
def data():
    return np.random.default_rng(0).integers(0, 256, (2000, 65), dtype=np.uint16)


def test_s3_catalog_streams_with_a_cache_smaller_than_the_dataset(s3_store, s3_env, data, tmp_path):
    catalog = EmbeddedCatalog(store=s3_store)
    ds = _commit(catalog, "web", data, per_shard=200)  # 10 shards of ~26 KB
    shard_bytes = ds.manifest.shards[0].bytes
    cache = CacheConfig(local_dir=tmp_path / "nvme", local_max_bytes=3 * shard_bytes + 100,
                        shared_dir=tmp_path / "shared", threads=2)
    reader = open_reader(ds.path, ds.manifest, cache)
    order = SampleOrder(ds.manifest.num_samples, 0.0, ds.version, 1, window=64,
                        shard_sizes=tuple(s.num_samples for s in ds.manifest.shards))
    try:
        for step in range(2 * 2000 // 40):  # two epochs, global batch 40
            reader.prefetch(order.global_indices((step + 1) * 40, 40))
            idx = order.rank_slice(step, 40, 0, 1)
            np.testing.assert_array_equal(reader.get(idx), data[idx].astype(np.int64))
        stats = reader.fetcher.stats
        assert stats.evictions > 0 and stats.store_fetches >= 10
        assert reader.fetcher.local.usage() <= 3 * shard_bytes + 100
        assert stats.shared_hits > 0  # evicted shards came back from the shared tier, not from S3
    finally:
        reader.close()
    # a second node (fresh local tier) reads everything from the shared tier
    cache2 = CacheConfig(local_dir=tmp_path / "nvme2", local_max_bytes=None, shared_dir=tmp_path / "shared")
    reader2 = open_reader(ds.path, ds.manifest, cache2)
    np.testing.assert_array_equal(reader2.get(range(2000)), data.astype(np.int64))
    assert reader2.fetcher.stats.store_fetches == 0 and reader2.fetcher.stats.shared_hits == 10
    reader2.close()


def test_corrupt_shard_in_the_store_is_detected(s3_store, s3_env, data, tmp_path):
    catalog = EmbeddedCatalog(store=s3_store)
    ds = _commit(catalog, "c", data[:400], per_shard=200)
    key = f"c/versions/{ds.version}/{ds.manifest.shards[1].file}"
    blob = bytearray(s3_store.get_bytes(key))
    blob[-100] ^= 0xFF
    s3_store.put_bytes(key, bytes(blob))
    reader = open_reader(ds.path, ds.manifest, CacheConfig(local_dir=tmp_path / "c", local_max_bytes=None))
    try:
        np.testing.assert_array_equal(reader.get([0, 199]), data[[0, 199]].astype(np.int64))
        with pytest.raises(ShardIntegrityError, match="sha256"):
            reader.get([250])
        assert not list((tmp_path / "c").rglob("shard-00001.arrow"))  # never visible in the cache
    finally:
        reader.close()


def test_resolve_reference_through_s3_catalog_and_quality_gate(s3_env, s3_server, monkeypatch, data):
    bucket = s3_server.make_bucket()
    try:
        monkeypatch.setenv("TRAINFORGE_DATASETS_URL", f"s3://{bucket}/datasets")
        catalog = EmbeddedCatalog()
        ds = _commit(catalog, "gated", data[:300], per_shard=100)
        with pytest.raises(CatalogError, match="no quality report.*trainforge datasets check gated@"):
            resolve_reference("catalog://gated@main")
        from trainforge.datasets.gate import run_and_store

        assert run_and_store(ds, catalog=catalog)["passed"]  # the gate reads the shards from S3
        assert resolve_reference("catalog://gated@main").version == ds.version
        catalog.put_quality("gated", ds.version, {"passed": False, "failures": ["samples: token out of range"]})
        with pytest.raises(CatalogError, match="failed its quality gate: samples: token out of range"):
            resolve_reference("catalog://gated@main")
    finally:
        s3_server.delete_bucket(bucket)


def test_local_reader_is_used_for_local_versions(data):
    ds = _commit(EmbeddedCatalog(), "local", data[:100], per_shard=50)
    assert type(open_reader(ds.path, ds.manifest)) is ShardReader
