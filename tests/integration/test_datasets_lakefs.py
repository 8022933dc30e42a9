"""The lakeFS catalog through the real high-level `lakefs` SDK, against the in-process stand-in whose every request
and response is validated against lakeFS's OpenAPI spec (tests/fixtures/lakefs.py; an emulation, not lakeFS):
refs (branch, tag, commit, `main~1`) resolve to commit ids, reads are pinned to the commit, releases are tagged,
lineage goes into commit metadata, shards stream through the cache tiers with ranged reads. Configuration is
lakectl's: a .lakectl.yaml (LAKECTL_CONFIG_FILE) overridden by LAKECTL_* env; the lakeFS server's LAKEFS_*
settings are refused with their LAKECTL_* names. `test_against_a_real_lakefs` runs only against a real lakeFS:
a lakectl configuration (~/.lakectl.yaml, LAKECTL_CONFIG_FILE or LAKECTL_SERVER_ENDPOINT_URL + credentials) and
TRAINFORGE_LAKEFS_TEST_REPO set before pytest starts.

Run: .venv/bin/python -m pytest tests/integration/test_datasets_lakefs.py -q
"""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

from tests.fixtures.lakefs import ACCESS_KEY, SECRET_KEY, lakectl_yaml, no_lakefs_config
from trainforge.datasets.build import BuildConfig, build_version_dir
from trainforge.datasets.catalog import CatalogError
from trainforge.datasets.lakefs_catalog import LakeFSCatalog, lakectl_configured, parse_url
from trainforge.datasets.refs import check_reference, resolve_reference
from trainforge.datasets.sampler import SampleOrder
from trainforge.datasets.shards import ShardReader
from trainforge.datasets.stream import CacheConfig, open_reader

REAL = lakectl_configured() and os.environ.get("TRAINFORGE_LAKEFS_TEST_REPO")


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
    ranged = [r for r in lakefs_standin.requests if " Range=bytes=" in r]
    assert ranged and all("/objects" in r for r in ranged)  # the streaming reader asked for byte ranges


def test_lineage_goes_into_commit_metadata(lakefs_env, lakefs_standin):
    catalog = LakeFSCatalog.from_env()
    cid = catalog.record("data", "main", "run job-42 used corpora/web",
                         {"job_id": "job-42", "code_commit": "abc123"}, allow_empty=True)
    commit = catalog.repository("data").commit(cid).get_commit()
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
    monkeypatch.setenv("LAKECTL_CREDENTIALS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(CatalogError, match="401"):
        LakeFSCatalog.from_env().commit_id("data", "main")


@pytest.mark.skipif(not REAL, reason="needs a real lakeFS: configure lakectl (~/.lakectl.yaml, LAKECTL_CONFIG_FILE, "
                    "or LAKECTL_SERVER_ENDPOINT_URL + LAKECTL_CREDENTIALS_ACCESS_KEY_ID + "
                    "LAKECTL_CREDENTIALS_SECRET_ACCESS_KEY) and set TRAINFORGE_LAKEFS_TEST_REPO (a repository with "
                    "branch main)")
def test_against_a_real_lakefs(tmp_path):
    repo = os.environ["TRAINFORGE_LAKEFS_TEST_REPO"]
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

    req = urllib.request.Request(f"{lakefs_standin.endpoint}/api/v1/repositories/data/branches/main/commits",
                                 data=b'{"metadata": {"a": 1}}', method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": "Basic " +
                                          base64.b64encode(f"{ACCESS_KEY}:{SECRET_KEY}".encode()).decode()})
    with pytest.raises((urllib.error.HTTPError, KeyError)):
        urllib.request.urlopen(req, timeout=10).read()
    assert any("request POST" in v for v in lakefs_standin.violations)  # message missing, metadata not strings
    lakefs_standin.violations.clear()


def test_the_object_store_view_reads_ranges_lists_and_refuses_writes(lakefs_env, lakefs_standin, tmp_path):
    catalog = LakeFSCatalog.from_env()
    v = _version(tmp_path, "v", "store")
    cid = catalog.publish(v.path, "data", "main", "corpora/s", message="store view")
    store = catalog.store("data", cid)
    keys = store.list("corpora/s/")
    assert keys == sorted(f"corpora/s/{p.name}" for p in v.path.iterdir() if p.is_file())
    assert len(keys) > 3  # several shards + the manifest
    assert store.list("corpora/s/", start_after=keys[1]) == keys[2:]
    shard = keys[0]
    whole = store.get_bytes(shard)
    assert whole == (v.path / shard.rsplit("/", 1)[1]).read_bytes()
    assert store.get_bytes(shard, (5, 17)) == whole[5:17]
    assert store.get_bytes(shard, (3, 3)) == b""
    assert any(r.startswith("GET /api/v1/repositories/data/refs/") for r in lakefs_standin.requests)
    store.get_file(shard, tmp_path / "copy")
    assert (tmp_path / "copy").read_bytes() == whole
    assert store.exists(shard) and not store.exists("corpora/s/nope")
    from trainforge.infra.storage import ObjectNotFoundError

    with pytest.raises(ObjectNotFoundError):
        store.get_bytes("corpora/s/nope")
    with pytest.raises(PermissionError, match="immutable"):
        store.put_bytes("x", b"y")
    # the storage config (no pre-signed URLs on the stand-in) is asked once, not per object
    assert lakefs_standin.requests.count("GET /api/v1/config") == 1
    assert lakefs_standin.requests.count("GET /api/v1/repositories/data") == 1


def test_configured_from_a_lakectl_yaml_file(lakefs_standin, monkeypatch, tmp_path):
    no_lakefs_config(monkeypatch, tmp_path)
    assert not lakectl_configured()
    monkeypatch.setenv("LAKECTL_CONFIG_FILE", str(lakectl_yaml(lakefs_standin, tmp_path / "lakectl.yaml")))
    assert lakectl_configured()
    catalog = LakeFSCatalog.from_env()
    v = _version(tmp_path, "v1", "file")
    cid = catalog.publish(v.path, "data", "main", "corpora/web", message="from the file", tag="web-file")
    ds = resolve_reference("lakefs://data/web-file/corpora/web")
    assert ds.version == v.version and ds.ref == f"lakefs://data/{cid}/corpora/web"
    assert check_reference("lakefs://data/main/corpora/web", tmp_path) is None


def test_env_overrides_the_lakectl_yaml_file(lakefs_standin, monkeypatch, tmp_path):
    no_lakefs_config(monkeypatch, tmp_path)
    monkeypatch.setenv("LAKECTL_CONFIG_FILE", str(lakectl_yaml(lakefs_standin, tmp_path / "lakectl.yaml",
                                                               secret="wrong-in-the-file")))
    with pytest.raises(CatalogError, match="401"):
        LakeFSCatalog.from_env().commit_id("data", "main")
    monkeypatch.setenv("LAKECTL_CREDENTIALS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("LAKECTL_CREDENTIALS_SECRET_ACCESS_KEY", SECRET_KEY)
    head = LakeFSCatalog.from_env().commit_id("data", "main")
    assert head == lakefs_standin.repos["data"].branches["main"]
    # and the endpoint: the env's wins over the file's
    (tmp_path / "lakectl.yaml").write_text((tmp_path / "lakectl.yaml").read_text().replace(
        lakefs_standin.endpoint, "http://127.0.0.1:9"))
    with pytest.raises(CatalogError, match="cannot reach"):
        LakeFSCatalog.from_env().commit_id("data", "main")
    monkeypatch.setenv("LAKECTL_SERVER_ENDPOINT_URL", lakefs_standin.endpoint)
    assert LakeFSCatalog.from_env().commit_id("data", "main") == head


def test_nothing_configured_is_a_clear_error(monkeypatch, tmp_path):
    no_lakefs_config(monkeypatch, tmp_path)
    assert not lakectl_configured()
    with pytest.raises(CatalogError) as info:
        LakeFSCatalog.from_env()
    text = str(info.value)
    for name in ("~/.lakectl.yaml", "LAKECTL_CONFIG_FILE", "LAKECTL_SERVER_ENDPOINT_URL",
                 "LAKECTL_CREDENTIALS_ACCESS_KEY_ID", "LAKECTL_CREDENTIALS_SECRET_ACCESS_KEY", "lakectl config"):
        assert name in text, (name, text)
    with pytest.raises(CatalogError, match="LAKECTL_SERVER_ENDPOINT_URL"):
        resolve_reference("lakefs://data/main/corpora/web")


def test_an_endpoint_without_credentials_names_them(lakefs_standin, monkeypatch, tmp_path):
    no_lakefs_config(monkeypatch, tmp_path)
    monkeypatch.setenv("LAKECTL_SERVER_ENDPOINT_URL", lakefs_standin.endpoint)
    with pytest.raises(CatalogError, match="no credentials.*LAKECTL_CREDENTIALS_ACCESS_KEY_ID.*"
                                           "LAKECTL_CREDENTIALS_SECRET_ACCESS_KEY"):
        LakeFSCatalog.from_env()


def test_the_lakefs_servers_own_settings_are_refused_with_their_lakectl_names(lakefs_standin, monkeypatch, tmp_path):
    no_lakefs_config(monkeypatch, tmp_path)
    monkeypatch.setenv("LAKEFS_ENDPOINT", lakefs_standin.endpoint)
    monkeypatch.setenv("LAKEFS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("LAKEFS_SECRET_ACCESS_KEY", SECRET_KEY)
    assert not lakectl_configured()
    with pytest.raises(CatalogError) as info:
        LakeFSCatalog.from_env()
    text = str(info.value)
    assert "lakeFS server" in text
    for old, new in (("LAKEFS_ENDPOINT", "LAKECTL_SERVER_ENDPOINT_URL"),
                     ("LAKEFS_ACCESS_KEY_ID", "LAKECTL_CREDENTIALS_ACCESS_KEY_ID"),
                     ("LAKEFS_SECRET_ACCESS_KEY", "LAKECTL_CREDENTIALS_SECRET_ACCESS_KEY")):
        assert f"{old} -> {new}" in text, text
    assert lakefs_standin.requests == []  # not silently used
    problem = check_reference("lakefs://data/main/corpora/web", tmp_path)
    assert problem is not None and problem.severity == "not-checked"
    assert "lakeFS server" in problem.message and "LAKECTL_SERVER_ENDPOINT_URL" in problem.fix


def test_validate_reports_a_lakefs_ref_as_not_checked_when_unconfigured(monkeypatch, tmp_path):
    no_lakefs_config(monkeypatch, tmp_path)
    problem = check_reference("lakefs://data/main/corpora/web", tmp_path)
    assert problem is not None and problem.severity == "not-checked"
    assert "no lakeFS client is configured" in problem.message
    assert "LAKECTL_CONFIG_FILE" in problem.fix and "drop --strict" in problem.fix
