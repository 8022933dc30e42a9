"""MLflow tracking and model registry (imported lazily: the CLI and the pure core never load mlflow).

Default store: SQLite in $TRAINFORGE_HOME with artifacts in $TRAINFORGE_HOME/mlartifacts; $MLFLOW_TRACKING_URI
points it at a server. One experiment per team; one run per job, tagged with its lineage. `job_metric` is the metrics API of HPO drivers.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trainforge.home import home

LINEAGE_TAGS = ("trainforge.job_id", "trainforge.team", "trainforge.dataset_ref", "trainforge.dataset_version",
                "trainforge.dataset_license", "trainforge.code_commit", "trainforge.config_hash")


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{home() / 'mlflow.db'}"


def artifact_root() -> str:
    return os.environ.get("TRAINFORGE_ARTIFACT_ROOT") or (home() / "mlartifacts").as_uri()


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            out.update(flatten(v, key))
        else:
            out[key] = str(v)[:6000]
    return out


class Tracker:
    """A thin adapter over MlflowClient; every call names its run explicitly (no global active run)."""

    def __init__(self, uri: str | None = None):
        from mlflow.tracking import MlflowClient

        self.uri = uri or tracking_uri()
        self.client = MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)

    def experiment_id(self, team: str) -> str:
        name = f"trainforge/{team}"
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        try:
            return self.client.create_experiment(name, artifact_location=f"{artifact_root()}/{team}")
        except Exception:  # created concurrently by another job of the team
            exp = self.client.get_experiment_by_name(name)
            if exp is None:
                raise
            return exp.experiment_id

    def start_run(self, team: str, job_id: str, params: Mapping[str, Any], tags: Mapping[str, str]) -> str:
        from mlflow.entities import Param

        from trainforge.registry.secrets import redact_obj

        # Defence in depth: params hold secret names only, but a value registered as a secret never gets out.
        run = self.client.create_run(self.experiment_id(team), run_name=job_id, tags=redact_obj(dict(tags)))
        flat = redact_obj(flatten(params))
        items = [Param(k, v) for k, v in sorted(flat.items())]
        for i in range(0, len(items), 100):
            self.client.log_batch(run.info.run_id, params=items[i : i + 100])
        return run.info.run_id

    def log_metrics(self, run_id: str, rows: list[tuple[int, Mapping[str, float]]]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, step) for step, values in rows for k, v in values.items()
                   if isinstance(v, int | float)]
        for i in range(0, len(metrics), 900):
            self.client.log_batch(run_id, metrics=metrics[i : i + 900])

    def set_tags(self, run_id: str, tags: Mapping[str, str]) -> None:
        from trainforge.registry.secrets import redact

        for k, v in tags.items():
            self.client.set_tag(run_id, k, redact(str(v)))

    def log_artifact(self, run_id: str, path: Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(run_id, str(path), artifact_path)

    def log_artifacts(self, run_id: str, folder: Path, artifact_path: str | None = None) -> None:
        self.client.log_artifacts(run_id, str(folder), artifact_path)

    def list_artifacts(self, run_id: str, path: str | None = None) -> list[str]:
        return [f.path for f in self.client.list_artifacts(run_id, path)]

    def end_run(self, run_id: str, status: str) -> None:
        self.client.set_terminated(run_id, status=status)

    def artifact_uri(self, run_id: str, path: str) -> str:
        return f"{self.client.get_run(run_id).info.artifact_uri}/{path}"

    def register_model(self, name: str, source: str, run_id: str, tags: Mapping[str, str],
                       alias: str | None = "candidate") -> str:
        from mlflow.exceptions import MlflowException

        with contextlib.suppress(MlflowException):  # exists already
            self.client.create_registered_model(name)
        from trainforge.registry.secrets import redact_obj

        version = self.client.create_model_version(name, source=source, run_id=run_id, tags=redact_obj(dict(tags)))
        if alias:
            self.client.set_registered_model_alias(name, alias, version.version)
        return str(version.version)

    def model_version(self, name: str, version: str) -> Any:
        return self.client.get_model_version(name, version)

    def set_alias(self, name: str, alias: str, version: str) -> None:
        """Point `alias` (champion, candidate, ...) at a version; it moves off whichever version held it."""
        self.client.set_registered_model_alias(name, alias, str(version))

    def version_by_alias(self, name: str, alias: str) -> Any:
        return self.client.get_model_version_by_alias(name, alias)

    def aliases(self, name: str) -> dict[str, str]:
        return {a: str(v) for a, v in (self.client.get_registered_model(name).aliases or {}).items()}

    def set_version_tags(self, name: str, version: str, tags: Mapping[str, str]) -> None:
        for k, v in tags.items():
            self.client.set_model_version_tag(name, str(version), k, str(v))

    def transition_stage(self, name: str, version: str, stage: str, archive_existing: bool = False) -> str:
        """MLflow's stage (None/Staging/Production/Archived). Deprecated upstream since 2.9 in favour of aliases
        but still served by MLflow 3 and shown in its UI; recorded as the `trainforge.stage` tag as well."""
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mv = self.client.transition_model_version_stage(name, str(version), stage,
                                                            archive_existing_versions=archive_existing)
        self.client.set_model_version_tag(name, str(version), "trainforge.stage", mv.current_stage)
        return str(mv.current_stage)


# ---- the metrics API of hyper-parameter search drivers (Optuna, Ray Tune, ...) ----------------------------------

METRIC_MODES = ("latest", "min", "max")


@dataclass(frozen=True)
class MetricValue:
    """One value of a run's metric, with what an HPO driver needs to judge it (is the run still going?)."""

    job_id: str
    run_id: str
    metric: str
    mode: str
    value: float
    step: int
    timestamp_ms: int
    run_status: str  # MLflow's: RUNNING, FINISHED, FAILED, KILLED

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_id_for_job(job_id: str, tracker: Tracker | None = None) -> str:
    """The MLflow run of a job: from the job record when this host has it (a job name finds its newest submission),
    else the run tagged `trainforge.job_id` in a trainforge/* experiment: a driver on another host needs only the
    tracking server."""
    from trainforge.registry.jobs import JobStore

    try:
        record = JobStore().get(job_id)
        if record.data.get("mlflow_run_id"):
            return str(record.data["mlflow_run_id"])
        job_id = record.job_id
    except LookupError:
        pass
    client = (tracker or Tracker()).client
    experiments = [e.experiment_id for e in client.search_experiments(filter_string="name LIKE 'trainforge/%'")]
    runs = client.search_runs(experiments, filter_string=f"tags.`trainforge.job_id` = '{job_id.replace(chr(39), '')}'",
                              max_results=2) if experiments else []
    if not runs:
        raise LookupError(f"no MLflow run for job {job_id!r} (not in the job store, no run tagged trainforge.job_id="
                          f"{job_id} at {(tracker or Tracker()).uri}); a job has a run once its flow has started")
    return str(runs[0].info.run_id)


def job_metric(job_id: str, metric: str, mode: str = "latest", tracker: Tracker | None = None) -> MetricValue:
    """A job's metric from MLflow: the `latest` value (highest step; after a failure the replayed, i.e. newest,
    value of that step), or the `min` / `max` over the whole history. Raises LookupError, naming the metrics the
    run has, when this one was never logged (yet)."""
    if mode not in METRIC_MODES:
        raise ValueError(f"mode {mode!r}: use one of {', '.join(METRIC_MODES)}")
    tracker = tracker or Tracker()
    run_id = run_id_for_job(job_id, tracker)
    run = tracker.client.get_run(run_id)
    job_id = run.data.tags.get("trainforge.job_id", job_id)
    history = tracker.client.get_metric_history(run_id, metric)
    if not history:
        known = ", ".join(sorted(k for k in run.data.metrics if "/" not in k)) or "none yet"
        raise LookupError(f"job {job_id}'s run {run_id} ({run.info.status}) has no metric {metric!r}; it has: "
                          f"{known}")
    if mode == "latest":
        best = max(history, key=lambda m: (m.step, m.timestamp))
    else:
        pick = min if mode == "min" else max
        best = pick(history, key=lambda m: m.value)
    return MetricValue(job_id, run_id, metric, mode, float(best.value),
                       int(best.step), int(best.timestamp), str(run.info.status))
