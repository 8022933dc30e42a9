"""Registry + lineage through real flow runs: the train-job flow records the dataset version (license, files),
the job, every committed checkpoint and the model version as they happen; `trainforge promote JOB --step N`
registers an intermediate checkpoint with full metadata, alias and stage, protects it from retention and links
the run's logs and evaluation results; a second job fine-tuned from the first model (on another dataset) is found
through its ancestry; withdrawing the first dataset with --quarantine blocks promotion of both jobs' checkpoints;
the `lineage-query` Prefect flow answers the same question as the CLI.

Run: .venv/bin/python -m pytest tests/integration/test_lineage_flow.py   (two flow runs, about 1.5 minutes)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.integration.test_train_job import run_flow, small_spec
from trainforge.cli import app
from trainforge.datasets.catalog import EmbeddedCatalog
from trainforge.datasets.demo import ensure_demo_dataset, tiny_dataset
from trainforge.registry.jobs import JobStore
from trainforge.registry.lineage import LineageStore
from trainforge.registry.manifest import list_committed
from trainforge.registry.tracking import Tracker
from trainforge.spec import JobSpec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def cli(*args: str) -> dict:
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def ids(rows: list[dict]) -> set[str]:
    return {r["id"] for r in rows}


def test_lineage_promotion_fine_tune_withdrawal(prefect_api):
    demo = ensure_demo_dataset()
    first = run_flow(small_spec())
    job_a, model_a = first["job_id"], first["model"]
    store = LineageStore()

    # --- written by the flow as it ran
    a_ckpts = {f"checkpoint:{job_a}@{s}" for s in first["checkpoints"]}
    name_a, version_a = model_a["model_name"], model_a["version"]
    deps = cli("lineage", "datasets-of", f"models:/{name_a}/{version_a}")["datasets"]
    assert [(d["name"], d["version"], d["license"], d["license_class"]) for d in deps] == [
        ("demo-text", demo.version, "PSF-2.0", "permissive")]
    assert deps[0]["attrs"]["provenance"]["source"] == "python-stdlib"
    affected = cli("lineage", "trained-on", f"demo-text@{demo.version[:12]}")["affected"]
    assert a_ckpts | {f"model:{name_a}/{version_a}"} <= ids(affected)
    shard = f"{demo.path}/shard-00000.arrow"
    assert ids(cli("lineage", "trained-on", "--file", shard)["affected"]) == ids(affected)

    # --- promote an intermediate checkpoint: metadata, alias, stage, protection, run artifacts
    promoted = cli("promote", job_a, "--step", "8", "--alias", "champion", "--stage", "Staging")
    tracker = Tracker()
    version = tracker.model_version(promoted["model_name"], promoted["version"])
    assert version.current_stage == "Staging" and version.tags["trainforge.step"] == "8"
    assert version.tags["trainforge.parent_checkpoint"].endswith("step-0000000008")
    assert version.tags["trainforge.dataset_license"] == "PSF-2.0" and "metric.eval_loss" in version.tags
    assert tracker.aliases(promoted["model_name"]) == {"champion": promoted["version"], "candidate": version_a}
    record = JobStore().get(job_a)
    assert 8 in record.data["protected_steps"]
    assert record.data["iam"]["policy"]["Statement"][0]["Resource"][0].endswith(f"/jobs/{job_a}/*")
    artifacts = tracker.list_artifacts(record.data["mlflow_run_id"])
    assert {"logs", "evaluation", "model", "models"} <= set(artifacts)
    assert "evaluation/results.json" in tracker.list_artifacts(record.data["mlflow_run_id"], "evaluation")
    # protected from GC: a retention pass that keeps only the newest leaves step 8 in place
    from trainforge.tasks.checkpoints import apply_retention, job_store

    config = json.loads((record.folder / "worker-config.json").read_text())
    spec = JobSpec.model_validate({**record.data["spec"], "checkpoint": {
        **record.data["spec"]["checkpoint"], "keep_last": 1, "keep_best": None}})
    apply_retention(spec, config, record.data["protected_steps"])
    assert {r.step for r in list_committed(job_store(config), config["storage_prefix"])} >= {8, 24}
    bad = CliRunner().invoke(app, ["promote", job_a, "--step", "9"])
    assert bad.exit_code == 1 and "no committed checkpoint at step 9" in bad.output

    # --- a job fine-tuned from model A, on another dataset (CC0)
    other = tiny_dataset(EmbeddedCatalog(), "rand-cc0", num_samples=256, sample_len=65, seed=3)
    doc = small_spec(max_steps=8)
    doc.update(name="tiny-ft", init_from=f"models:/{name_a}/{version_a}")
    doc["dataset"] = {**doc["dataset"], "ref": "catalog://rand-cc0@main", "license": "CC0-1.0"}
    second = run_flow(doc)
    name_b, version_b = second["model"]["model_name"], second["model"]["version"]
    # the workers started from model A's weights: the registered safetensors, byte for byte
    config_b = json.loads((JobStore().get(second["job_id"]).folder / "worker-config.json").read_text())
    init = Path(config_b["init_weights"])
    assert init.read_bytes() == Path(first["model"]["path"]).read_bytes()
    deps_b = {(d["name"], d["license_class"]) for d in
              cli("lineage", "datasets-of", f"{name_b}/{version_b}")["datasets"]}
    assert deps_b == {("demo-text", "permissive"), ("rand-cc0", "public-domain")}
    assert f"model:{name_b}/{version_b}" in ids(cli("lineage", "trained-on", "demo-text")["affected"])
    assert f"model:{name_b}/{version_b}" not in ids(
        cli("lineage", "trained-on", f"rand-cc0@{other.version}")["affected"]) - {f"model:{name_b}/{version_b}"}
    assert {j["name"] for j in cli("lineage", "license", "public-domain")["jobs"]} == {second["job_id"]}

    # --- the legal team's flow gives the CLI's answer
    from trainforge.flows.lineage_query import lineage_query

    by_flow = lineage_query(query="trained-on", dataset="demo-text")
    assert ids(by_flow["affected"]) == ids(cli("lineage", "trained-on", "demo-text")["affected"])

    # --- withdrawal + quarantine: both jobs' checkpoints and models are blocked, with who and why
    out = cli("lineage", "withdraw", f"demo-text@{demo.version}", "--why", "takedown request 7", "--quarantine",
              "--who", "legal@example")
    assert {r["status"] for r in out["affected"]} == {"quarantined"}
    refused = CliRunner().invoke(app, ["promote", second["job_id"], "--step", "8"])
    assert refused.exit_code == 1 and "takedown request 7" in refused.output, refused.output
    refused = CliRunner().invoke(app, ["model", "alias", name_a, version_a, "champion"])
    assert refused.exit_code == 1 and "quarantined" in refused.output
    assert store.history(f"model:{name_b}/{version_b}")[-1]["who"] == "legal@example"
    # a new job may not start from a quarantined parent
    with pytest.raises(Exception, match="quarantined"):
        run_flow({**doc, "name": "tiny-ft2"})
