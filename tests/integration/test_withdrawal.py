"""Withdrawal that bites (issue 23), on the real embedded catalog, lineage store and MLflow (SQLite in the test's
TRAINFORGE_HOME): once `trainforge lineage withdraw` has run, `validate` and the flow's resolve step refuse the
version by branch and by id (naming who, when, why and what to do), the MLflow run and model version trained on it
carry `trainforge.dataset_withdrawn`, aliases are refused, and `lineage trained-on` lists the model with its
checkpoint, marked withdrawn. No training run: the lineage records are written as the flow's tasks write them.

Run: .venv/bin/python -m pytest tests/integration/test_withdrawal.py   (a few seconds, most of it MLflow's schema)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from trainforge.cli import app
from trainforge.datasets.catalog import DatasetWithdrawn, EmbeddedCatalog
from trainforge.datasets.demo import tiny_dataset
from trainforge.registry.lineage import LineageStore, QuarantinedError
from trainforge.registry.lineage_withdrawal import WITHDRAWN_TAG
from trainforge.registry.promotion import set_alias
from trainforge.registry.tracking import Tracker
from trainforge.spec import JobSpec
from trainforge.tasks.prepare import resolve_dataset
from trainforge.validate import validate_document

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
pytestmark = pytest.mark.timeout(300)


def spec_doc(ref: str) -> dict:
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    doc["dataset"] = {**doc["dataset"], "ref": ref, "license": "CC0-1.0"}
    doc["training"]["seq_len"] = 64
    return doc


def test_withdrawn_version_is_refused_tagged_and_listed():
    catalog = EmbeddedCatalog()
    ds = tiny_dataset(catalog, "webtext", num_samples=64, sample_len=65, seed=1)
    spec = JobSpec.model_validate(spec_doc("catalog://webtext@main"))
    resolved = resolve_dataset(spec, EXAMPLES)  # fine before the withdrawal
    assert resolved["version"] == ds.version

    # what the train-job flow records: the job (with its MLflow run), a committed checkpoint, the model version
    tracker, store = Tracker(), LineageStore()
    run_id = tracker.start_run("nlp", "job-a", {}, {"trainforge.job_id": "job-a"})
    store.record_job("job-a", team="nlp", dataset=resolved, mlflow_run_id=run_id)
    store.record_checkpoint("job-a", 8, team="nlp", attrs={"prefix": "teams/nlp/jobs/job-a/step-0000000008"})
    version = tracker.register_model("nlp.m", tracker.artifact_uri(run_id, "model"), run_id, {}, alias=None)
    store.record_promotion("job-a", 8, "nlp.m", version, team="nlp")

    # a branch is not a version: withdrawal names the immutable version it points at
    refused = CliRunner().invoke(app, ["lineage", "withdraw", "webtext@main", "--why", "x"])
    assert refused.exit_code == 1 and "branch or tag" in refused.output
    out = CliRunner().invoke(app, ["lineage", "withdraw", f"webtext@{ds.version[:12]}", "--why", "takedown 7",
                                   "--who", "legal@example", "--json"])
    assert out.exit_code == 0, out.output
    result = json.loads(out.stdout)
    assert set(result["tagged"]) == {f"models:/nlp.m/{version}", f"runs:/{run_id} (job job-a)"}
    assert result["tag_errors"] == []

    # MLflow: the model version and the run are tagged
    tags = tracker.model_version("nlp.m", version).tags
    assert tags[WITHDRAWN_TAG] == f"webtext@{ds.version}" and tags[f"{WITHDRAWN_TAG}_by"] == "legal@example"
    assert tracker.client.get_run(run_id).data.tags[f"{WITHDRAWN_TAG}_why"] == "takedown 7"

    # no new job resolves it: by branch (the flow's resolve step) and by version id (validate)
    with pytest.raises(DatasetWithdrawn, match="withdrawn by legal@example") as err:
        resolve_dataset(spec, EXAMPLES)
    assert "takedown 7" in str(err.value) and "pick another version of 'webtext'" in str(err.value)
    report = validate_document(spec_doc(f"catalog://webtext@{ds.version}"), "job.yaml", EXAMPLES)
    problem = next(p for p in report.errors() if p.path == "dataset.ref")
    assert "takedown 7" in problem.message and ds.version in problem.message and "UTC" in problem.message
    assert "pick another version" in problem.fix

    # refused for promotion (aliases, stages and `promote` all go through check_usable)
    with pytest.raises(QuarantinedError, match="takedown 7"):
        set_alias("nlp.m", version, "champion")

    # trained-on lists the model with its checkpoint, marked withdrawn
    listed = CliRunner().invoke(app, ["lineage", "trained-on", f"webtext@{ds.version[:12]}", "--json"])
    rows = {r["id"]: r for r in json.loads(listed.stdout)["affected"]}
    model = rows[f"model:nlp.m/{version}"]
    assert (model["checkpoint"], model["prefix"]) == ("job-a@8", "teams/nlp/jobs/job-a/step-0000000008")
    assert model["withdrawn"] == rows["checkpoint:job-a@8"]["withdrawn"] == f"webtext@{ds.version}"

    # the fix works: a new version on main resolves
    fresh = tiny_dataset(catalog, "webtext", num_samples=64, sample_len=65, seed=2)
    assert resolve_dataset(spec, EXAMPLES)["version"] == fresh.version
