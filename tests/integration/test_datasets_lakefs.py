"""The lakeFS catalog through the real `lakefs_sdk` client, against the in-process stand-in whose every request
and response is validated against lakeFS's OpenAPI spec (tests/fixtures/lakefs.py; an emulation, not lakeFS):
refs (branch, tag, commit, `main~1`) resolve to commit ids, reads are pinned to the commit, releases are tagged,
lineage goes into commit metadata, shards stream through the cache tiers with ranged reads. The last test runs
only against a real lakeFS (LAKEFS_ENDPOINT + LAKEFS_TEST_REPO set before pytest starts).

Run: .venv/bin/python -m pytest tests/integration/test_datasets_lakefs.py -q
"""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

from trainforge.datasets.build import BuildConfig, build_version_dir
from trainforge.datasets.catalog import CatalogError
from trainforge.datasets.lakefs_catalog import LakeFSCatalog, parse_url
from trainforge.datasets.refs import check_reference, resolve_reference
from trainforge.datasets.sampler import SampleOrder
from trainforge.datasets.shards import ShardReader
from trainforge.datasets.stream import CacheConfig, open_reader

REAL = os.environ.get("LAKEFS_ENDPOINT") and os.environ.get("LAKEFS_TEST_REPO")


def _version(tmp_path, name: str, text: str):
    src = tmp_path / f"{name}.jsonl"
    src.write_text("".join(f'{{"text": "{text} {i} {"x" * (i % 13)}"}}\n' for i in range(300)))
    return build_version_dir(src, tmp_path / name, name, BuildConfig(license="CC-BY-4.0", seq_len=31,
                                                                     num_workers=1, max_shard_bytes=4096))


def test_refs_resolve_to_commits_and_reads_are_pinned(lakefs_env, lakefs_standin, tmp_path):
    catalog = LakeFSCatalog.from_env()
    v1 = _version(tmp_path, "v1", "first")
    c1 = catalog.publish(v1.path, "data", "main", "corpora/web", message="web v1",
                         metadata={"source": "crawl-1"}, tag="web-v1")
    v2 = _version(tmp_path, "v2", "second")
    c2 = catalog.publish(v2.path, "data", "main", "corpora/web", message="web v2", metadata={"source": "crawl-2"})
    assert c1 != c2
    assert catalog.commit_id("data", "main") == c2
    assert catalog.commit_id("data", "main~1") == c1
    assert catalog.commit_id("data", "web-v1") == c1
    assert catalog.commit_id("data", c1[:12]) == c1

    ds = resolve_reference("lakefs://data/main/corpora/web")
    assert ds.version == v2.version and ds.ref == f"lakefs://data/{c2}/corpora/web" and ds.license == "CC-BY-4.0"
    old = resolve_reference("lakefs://data/web-v1/corpora/web")
    assert old.version == v1.version and old.ref == f"lakefs://data/{c1}/corpora/web"
    assert resolve_reference("lakefs://data/main~1/corpora/web").version == v1.version

    # the branch moves on; a version resolved before keeps reading its own commit's bytes
    catalog.publish(_version(tmp_path, "v3", "third").path, "data", "main", "corpora/web", message="web v3")
    reader = open_reader(old.path, old.manifest, CacheConfig(local_dir=tmp_path / "cache", local_max_bytes=None))
    try:
        order = SampleOrder(old.manifest.num_samples, 0.0, old.version, 0)
        idx = order.global_indices(0, old.manifest.num_samples)
        np.testing.assert_array_equal(reader.get(idx), ShardReader(v1.path, v1.manifest).get(idx))
    finally:
        reader.close()
    assert any("Range" in r or "objects" in r for r in lakefs_standin.requests)


def test_lineage_goes_into_commit_metadata(lakefs_env, lakefs_standin):
    catalog = LakeFSCatalog.from_env()
    cid = catalog.record("data", "main", "run job-42 used corpora/web",
                         {"job_id": "job-42", "code_commit": "abc123"}, allow_empty=True)
    commit = catalog.commits.get_commit("data", cid)
    assert commit.metadata == {"job_id": "job-42", "code_commit": "abc123"}


def test_unknown_refs_and_paths_are_readable_errors(lakefs_env, lakefs_standin, tmp_path):
    with pytest.raises(CatalogError, match="not found"):
        resolve_reference("lakefs://data/nope/corpora/web")
    with pytest.raises(CatalogError, match="not found"):
        resolve_reference("lakefs://missing/main/x")
    with pytest.raises(CatalogError, match="REPOSITORY/REF/PATH"):
        parse_url("lakefs://data/main")
    problem = check_reference("lakefs://data/main/corpora/none", tmp_path)
    assert problem is not None and problem.severity == "error"


def test_wrong_credentials_are_refused(lakefs_env, lakefs_standin, monkeypatch):
    monkeypatch.setenv("LAKEFS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(CatalogError, match="401"):
        LakeFSCatalog.from_env().commit_id("data", "main")


@pytest.mark.skipif(not REAL, reason="needs a real lakeFS: set LAKEFS_ENDPOINT, LAKEFS_ACCESS_KEY_ID, "
                    "LAKEFS_SECRET_ACCESS_KEY and LAKEFS_TEST_REPO (a repository with branch main)")
def test_against_a_real_lakefs(tmp_path):
    repo = os.environ["LAKEFS_TEST_REPO"]
    catalog = LakeFSCatalog.from_env()
    v = _version(tmp_path, "real", "real")
    path = f"trainforge-tests/{uuid.uuid4().hex[:8]}"
    cid = catalog.publish(v.path, repo, "main", path, message="trainforge integration test")
    ds = resolve_reference(f"lakefs://{repo}/main/{path}")
    assert ds.version == v.version and cid in ds.ref


def test_the_stand_in_catches_requests_that_break_the_spec(lakefs_env, lakefs_standin):
    import base64
    import urllib.error
    import urllib.request

    from tests.fixtures.lakefs import ACCESS_KEY, SECRET_KEY

    req = urllib.request.Request(f"{lakefs_standin.endpoint}/api/v1/repositories/data/branches/main/commits",
                                 data=b'{"metadata": {"a": 1}}', method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": "Basic " +
                                          base64.b64encode(f"{ACCESS_KEY}:{SECRET_KEY}".encode()).decode()})
    with pytest.raises((urllib.error.HTTPError, KeyError)):
        urllib.request.urlopen(req, timeout=10).read()
    assert any("request POST" in v for v in lakefs_standin.violations)  # message missing, metadata not strings
    lakefs_standin.violations.clear()
