"""Promotion: any committed checkpoint of a job (final or intermediate) -> an MLflow model version, on user action.

`promote(job, step=N | best=True)` verifies the checkpoint against its manifest, refuses it if lineage has it
quarantined or trained on a withdrawn dataset version, exports safetensors + config, and registers `{team}.{name}` with the metadata legal and ML need
(training config hash, metrics, plan, dataset version and license, code commit, parent checkpoint, job, team).
The step is added to the job's `protected_steps`, which retention never deletes. Aliases (`champion`,
`candidate`) and MLflow stages are set through `set_alias` / `transition_stage`; both are lineage-checked.
`link_run_artifacts` stores the run's logs (secrets redacted), events, evaluation results, TensorBoard files,
profiler traces and HTML reports as artifacts of the job's MLflow run.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainforge.home import current_user
from trainforge.registry.checkpoints import (
    best_step,
    checkpoint_metrics,
    committed_ref,
    export_folder,
    export_safetensors,
    job_store,
)
from trainforge.registry.jobs import JobRecord, JobStore
from trainforge.registry.lineage import LineageStore, checkpoint_id, model_id
from trainforge.registry.manifest import verify
from trainforge.registry.secrets import redact_file
from trainforge.registry.tracking import Tracker
from trainforge.spec import JobSpec

ALIASES = ("champion", "candidate")
STAGES = ("None", "Staging", "Production", "Archived")
ARTIFACT_GLOBS = {"tensorboard": "**/events.out.tfevents*", "profiler": "**/*.pt.trace.json*",
                  "report": "**/*.html"}


def _config(record: JobRecord) -> dict[str, Any]:
    path = record.folder / "worker-config.json"
    if not path.is_file():
        raise LookupError(f"job {record.job_id} never started training: it has no checkpoints to promote")
    return json.loads(path.read_text())


def choose_step(record: JobRecord, metrics: Mapping[int, Mapping[str, float]], step: int | None, best: bool) -> int:
    if (step is None) == (not best):
        raise ValueError("give exactly one of --step N or --best")
    if not metrics:
        raise LookupError(f"job {record.job_id} has no committed checkpoint")
    if best:
        return best_step(JobSpec.model_validate(record.data["spec"]), dict(metrics))
    if step not in metrics:
        raise LookupError(f"job {record.job_id} has no committed checkpoint at step {step}; committed: "
                          f"{sorted(metrics)} (`trainforge checkpoints {record.job_id}`)")
    return int(step)  # type: ignore[arg-type]


def version_tags(record: JobRecord, step: int, prefix: str, metrics: Mapping[str, Any], who: str) -> dict[str, str]:
    data = record.data
    ds = data.get("dataset") or {}
    plan = data.get("plan") or {}
    layout = plan.get("layout") or {}
    tags = {
        "trainforge.job_id": record.job_id, "trainforge.team": data.get("team", ""),
        "trainforge.dataset_ref": ds.get("ref", ""), "trainforge.dataset_version": ds.get("version", ""),
        "trainforge.dataset_license": ds.get("license", ""), "trainforge.code_commit": data.get("code_commit", ""),
        "trainforge.config_hash": data.get("config_hash", ""), "trainforge.step": str(step),
        "trainforge.parent_checkpoint": prefix, "trainforge.promoted_by": who,
        "trainforge.plan": json.dumps({k: layout.get(k) for k in sorted(layout) if not isinstance(layout[k], dict)},
                                      sort_keys=True)[:5000],
    }
    tags |= {f"metric.{k}": f"{v:.6g}" for k, v in metrics.items() if isinstance(v, int | float)}
    return tags


def promote(job: str, *, step: int | None = None, best: bool = False, alias: str | None = "candidate",
            stage: str | None = None, who: str | None = None, lineage: LineageStore | None = None) -> dict[str, Any]:
    """Promote one committed checkpoint of `job`; returns the model version's description."""
    record = JobStore().get(job)
    config = _config(record)
    store = job_store(config)
    metrics = checkpoint_metrics(store, config["storage_prefix"])
    step = choose_step(record, metrics, step, best)
    ref = committed_ref(store, config["storage_prefix"], step)
    problems = verify(store, ref)
    if problems:
        raise ValueError(f"checkpoint step {step} of {record.job_id} is corrupt: {'; '.join(problems)}")
    lineage = lineage or LineageStore()
    lineage.check_usable(checkpoint_id(record.job_id, step))
    who = who or current_user()
    out = export_folder(record.folder, step)
    if not (out / "model.safetensors").is_file():
        export_safetensors(record.folder / "worker-config.json", config, step, out)
    tracker = Tracker()
    run_id = record.data["mlflow_run_id"]
    artifact_path = f"models/step-{step}"
    tracker.log_artifacts(run_id, out, artifact_path)  # the folder is the MLflow model (MLmodel, weights, hf/)
    name = f"{record.data['team']}.{record.data['name']}"
    tags = version_tags(record, step, ref.prefix, metrics[step], who)
    version = tracker.register_model(name, tracker.artifact_uri(run_id, artifact_path), run_id, tags, alias=None)
    protected = sorted(set(record.data.get("protected_steps", [])) | {step})
    promotions = [*record.data.get("promotions", []), {"step": step, "model_name": name, "version": version,
                                                       "by": who, "at": time.time()}]
    record.update(protected_steps=protected, promotions=promotions)
    after_register(record, step, name, version, run_id, lineage=lineage)
    if alias:
        set_alias(name, version, alias, lineage=lineage)
    if stage:
        transition_stage(name, version, stage, lineage=lineage)
    return {"model_name": name, "version": version, "step": step, "path": str(out / "model.safetensors"),
            "alias": alias, "stage": stage, "protected_steps": protected, "tags": tags}


def after_register(record: JobRecord, step: int, name: str, version: str, run_id: str, *,
                   lineage: LineageStore | None = None) -> None:
    """What follows every registration (the flow's automatic one too): lineage edge, run artifacts linked, and
    the `trainforge.dataset_withdrawn` tags if the data was withdrawn while the job ran (the version is then
    refused for aliases and Staging/Production like every other one trained on it)."""
    from trainforge.registry.lineage_withdrawal import tag_if_withdrawn

    lineage = lineage or LineageStore()
    node = lineage.record_promotion(record.job_id, step, name, version, team=record.data.get("team", ""),
                                    attrs={"run_id": run_id})
    tracker = Tracker()
    tag_if_withdrawn(lineage, node, tracker)
    link_run_artifacts(tracker, run_id, record)


def set_alias(name: str, version: str, alias: str, *, lineage: LineageStore | None = None) -> None:
    if alias not in ALIASES:
        raise ValueError(f"alias {alias!r}: use one of {', '.join(ALIASES)}")
    (lineage or LineageStore()).check_usable(model_id(name, version))
    Tracker().set_alias(name, alias, version)


def transition_stage(name: str, version: str, stage: str, *, lineage: LineageStore | None = None) -> str:
    canonical = {s.lower(): s for s in STAGES}.get(stage.lower())
    if canonical is None:
        raise ValueError(f"stage {stage!r}: use one of {', '.join(STAGES)}")
    if canonical in ("Staging", "Production"):
        (lineage or LineageStore()).check_usable(model_id(name, version))
    return Tracker().transition_stage(name, version, canonical, archive_existing=canonical == "Production")


def link_run_artifacts(tracker: Any, run_id: str, record: JobRecord) -> list[str]:
    """Upload the job's logs (redacted), events, evaluation results and any TensorBoard / profiler / HTML files
    found in its folder to its MLflow run. Returns the artifact folders written."""
    written = []
    with tempfile.TemporaryDirectory(prefix="tf-artifacts-") as tmp:
        staging = Path(tmp)
        logs = staging / "logs"
        for src in sorted(p for p in (record.folder / "logs").rglob("*") if p.is_file()):
            dst = logs / src.relative_to(record.folder / "logs")
            dst.parent.mkdir(parents=True, exist_ok=True)
            redact_file(src, dst)
        if record.events_path.is_file():
            logs.mkdir(exist_ok=True)
            redact_file(record.events_path, logs / "events.jsonl")
        if logs.is_dir():
            tracker.log_artifacts(run_id, logs, "logs")
            written.append("logs")
        results = {str(k): v for k, v in sorted(record.data.get("checkpoints", {}).items(), key=lambda kv: int(kv[0]))}
        if results:
            (staging / "evaluation").mkdir()
            (staging / "evaluation" / "results.json").write_text(json.dumps(results, indent=1, sort_keys=True))
            tracker.log_artifacts(run_id, staging / "evaluation", "evaluation")
            written.append("evaluation")
        for folder, pattern in ARTIFACT_GLOBS.items():
            found = [p for p in record.folder.glob(pattern) if p.is_file() and "export" not in p.parts]
            for src in found:
                rel = src.relative_to(record.folder)  # the flow's tensorboard/ files land at tensorboard/, not twice
                dst = staging / folder / (rel.relative_to(folder) if rel.parts[0] == folder else rel)
                dst.parent.mkdir(parents=True, exist_ok=True)
                if folder == "tensorboard":  # binary records with CRCs; their tags were redacted when written
                    shutil.copyfile(src, dst)
                else:
                    redact_file(src, dst)
            if found:
                tracker.log_artifacts(run_id, staging / folder, folder)
                written.append(folder)
    return written
