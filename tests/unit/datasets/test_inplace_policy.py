"""In-place datasets, the rules around the reads: the platform's own stores are never a dataset, a glob narrows
what the job may read, the built-in verdict is kept apart from a team suite's, and a resume trains on the version
the job pinned."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainforge.datasets.catalog import CatalogError
from trainforge.datasets.gate import builtin_part
from trainforge.datasets.pin_prefix import refuse_platform_prefix


def test_the_platforms_own_stores_are_never_a_dataset(monkeypatch):
    monkeypatch.setenv("TRAINFORGE_STORAGE_URL", "s3://ckpts/platform")
    monkeypatch.setenv("TRAINFORGE_DATASETS_URL", "s3://data/catalog")
    for bucket, prefix in (("ckpts", "platform"), ("ckpts", "platform/teams/other"), ("ckpts", ""),
                           ("data", "catalog/web"), ("data", "")):
        with pytest.raises(CatalogError, match="overlaps the platform's own store"):
            refuse_platform_prefix(bucket, prefix)
    for bucket, prefix in (("ckpts", "platform2"), ("ckpts", "corpus"), ("data", "web"), ("corpus", "")):
        refuse_platform_prefix(bucket, prefix)  # beside them, not inside: fine


def test_a_glob_narrows_the_read_grant_to_its_literal_start(tmp_path: Path):
    from tests.segment_configs import segment_config
    from trainforge.datasets.catalog import EmbeddedCatalog
    from trainforge.datasets.prefix_manifest import PrefixManifest, SourceObject
    from trainforge.infra.storage.iam import grant_from_uris
    from trainforge.tasks.job_credentials import in_place_source

    catalog = EmbeddedCatalog(tmp_path / "catalog")
    obj = (SourceObject("shared/team-a-1.jsonl", 5, '"e"'),)
    for pattern, want in (("team-a-*.jsonl", "s3://b/shared/team-a-*"), ("*/x.jsonl", "s3://b/shared/*"),
                          ("", "s3://b/shared")):
        ds = catalog.commit_prefix(PrefixManifest("s3.b.shared", "s3://b/shared", pattern, "jsonl", "text", "MIT",
                                                  1 << 20, False, obj))
        cfg = segment_config(dataset={"ref": "s3://b/shared", "name": ds.name, "version": ds.version,
                                      "path": str(ds.path), "tokenizer": "byte-level-v1"})
        assert in_place_source(cfg) == want
        grant = grant_from_uris("s3://jobs/p", "nlp", "j", [in_place_source(cfg)])
        assert grant is not None
        assert grant.read_patterns()[1] == (want.removeprefix("s3://") if pattern else "b/shared/*")


def test_the_built_in_verdict_is_kept_apart_from_the_team_suites():
    report = {"passed": False, "team_suite": {"path": "t.json"},
              "checks": [{"batch": "documents", "success": True}, {"batch": "team:documents", "success": False}],
              "failures": ["team:documents: expect_x(lang) ..."]}
    own = builtin_part(report)
    assert own["passed"] and own["failures"] == [] and "team_suite" not in own
    assert [c["batch"] for c in own["checks"]] == ["documents"]


def test_a_resume_trains_on_the_version_the_job_pinned():
    from trainforge.flows.train_job import _recorded_dataset
    from trainforge.registry.jobs import JobStore

    store = JobStore()
    store.create("in-place", dataset={"ref": "s3://b/web", "name": "s3.b.web", "version": "abc123",
                                      "pinned_ref": "catalog://s3.b.web@abc123"})
    store.create("cat", dataset={"ref": "catalog://web@main", "name": "web", "version": "def456",
                                 "pinned_ref": "catalog://web@main"})
    store.create("lake", dataset={"ref": "lakefs://r/main/p", "name": "p", "version": "v",
                                  "pinned_ref": "lakefs://r/c0ffee/p"})
    assert _recorded_dataset("in-place") == "catalog://s3.b.web@abc123"
    assert _recorded_dataset("cat") == "catalog://web@def456"  # the version, not the branch that may have moved
    assert _recorded_dataset("lake") == "lakefs://r/c0ffee/p"
    assert _recorded_dataset("never-ran") is None and _recorded_dataset(None) is None
