"""The `dataset_release` Prefect flow and the quality gate: build -> gate -> tag -> record; a version that fails
the gate moves no ref and fails the flow with the report; a job referencing a failed version is refused; the
gate catches out-of-vocabulary tokens, empty samples, duplicates and a missing license.

Run: .venv/bin/python -m pytest tests/integration/test_datasets_release.py -q
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from trainforge.datasets.catalog import CatalogError, EmbeddedCatalog
from trainforge.datasets.quality import run_gate
from trainforge.datasets.refs import check_reference, resolve_reference
from trainforge.datasets.shards import write_shard

pytestmark = pytest.mark.slow


def _corpus(tmp_path):
    src = tmp_path / "corpus.jsonl"
    rng = np.random.default_rng(1)
    words = ["data", "model", "token", "shard", "cache", "graph", "loss", "step", "batch", "rank"]
    src.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, 12))}) + "\n" for _ in range(400)))
    return src


def test_release_flow_builds_gates_tags_and_records(prefect_api, tmp_path):
    from trainforge.flows.dataset_release import dataset_release

    out = dataset_release(name="web", source=str(_corpus(tmp_path)), license="CC0-1.0", tag="r1", seq_len=31,
                          num_workers=1)
    catalog = EmbeddedCatalog()
    assert catalog.resolve("web", "r1").version == out["version"] == catalog.resolve("web", "main").version
    assert catalog.get_quality("web", out["version"])["passed"] is True
    assert resolve_reference("catalog://web@r1").version == out["version"]
    # import an already built version under another name
    dataset_release(name="web-copy", import_ref="catalog://web@r1", tag="imported")
    assert EmbeddedCatalog().resolve("web-copy", "imported").manifest.num_samples == \
        catalog.resolve("web", "r1").manifest.num_samples


def test_failed_gate_moves_no_ref_and_jobs_are_refused(prefect_api, tmp_path):
    from trainforge.flows.dataset_release import QualityGateFailed, dataset_release

    bad = tmp_path / "bad"
    bad.mkdir()
    data = np.full((50, 16), 7, dtype=np.uint16)  # every sample identical: duplicate rate 98%
    catalog = EmbeddedCatalog()
    ds = catalog.commit("dups", lambda d: [write_shard(d / "s.arrow", data)], sample_len=16, token_dtype="uint16",
                        vocab_size=260, tokenizer="byte-level-v1", license="MIT", ref=None)
    with pytest.raises(QualityGateFailed, match="proportion_of_unique"):
        dataset_release(name="dups2", import_ref=f"catalog://dups@{ds.version}", tag="r1")
    with pytest.raises(CatalogError):
        catalog.resolve("dups2", "r1")
    version = catalog.versions("dups2")[0]
    catalog.set_ref("dups2", "main", version)  # even if someone moves a branch by hand, jobs are refused
    problem = check_reference("catalog://dups2@main", tmp_path)
    assert problem is not None and "failed its quality gate" in problem.message


def test_gate_catches_vocab_empty_and_license_problems(tmp_path):
    catalog = EmbeddedCatalog()
    data = np.random.default_rng(0).integers(0, 256, (100, 16), dtype=np.uint16)
    data[3, 5] = 300  # >= vocab 260
    data[7] = 258  # all PAD: an empty sample
    ds = catalog.commit("bad", lambda d: [write_shard(d / "s.arrow", data)], sample_len=16, token_dtype="uint16",
                        vocab_size=260, tokenizer="byte-level-v1", license="unknown")
    report = run_gate(ds)
    assert not report["passed"]
    failed = {(c["column"], c["expectation"]) for c in report["checks"] if not c["success"]}
    assert ("max_token", "expect_column_values_to_be_between") in failed
    assert ("num_tokens", "expect_column_values_to_be_between") in failed
    assert ("license", "expect_column_values_to_not_be_in_set") in failed
    assert {c["column"] for c in report["checks"] if c["success"]} >= {"schema_matches", "sha256_matches"}
    json.dumps(report)  # storable


def test_release_tasks_retry_a_transient_storage_error_but_not_a_user_error(prefect_api, tmp_path, monkeypatch):
    from trainforge.flows.dataset_release import dataset_release

    calls = []
    original = EmbeddedCatalog.set_ref

    def flaky_set_ref(self, *args, **kwargs):  # the storage edge: the first write of the ref fails
        calls.append(args)
        if len(calls) == 1:
            raise ConnectionResetError("storage connection reset (injected)")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(EmbeddedCatalog, "set_ref", flaky_set_ref)
    out = dataset_release(name="web-retry", source=str(_corpus(tmp_path)), license="CC0-1.0", seq_len=31,
                          num_workers=1)
    assert len(calls) == 2  # tag-dataset-version failed once, then its retry released the version
    assert EmbeddedCatalog().resolve("web-retry", "main").version == out["version"]

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName

    missing = tmp_path / "no-such-folder"
    with pytest.raises(Exception, match="no-such-folder"):
        dataset_release(name="web-missing", source=str(missing), license="CC0-1.0", seq_len=31)
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_="build-dataset")))
    failed = [r for r in runs if r.state and r.state.is_failed()]
    assert failed and all(r.run_count == 1 for r in failed), [(r.name, r.run_count) for r in failed]
