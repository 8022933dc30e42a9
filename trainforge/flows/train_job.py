"""The `train-job` flow: validate -> resolve dataset -> plan -> provision gang -> train segments -> promote.

While a segment trains, the flow tails the workers' events: metrics stream to MLflow, and every committed
checkpoint gets its bookkeeping and evaluation as tasks that run concurrently with training. A failed segment is
retried by Prefect and resumes from the last committed checkpoint. Orchestration only: the work is in tasks.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

from prefect import flow, get_run_logger
from prefect.futures import PrefectFuture
from pydantic import BeforeValidator

from trainforge.contract.config import SegmentConfig
from trainforge.contract.evaluation import EvaluationScheduler, concurrency_from
from trainforge.contract.router import (
    EventRouter,
    Log,
    RecordResume,
    RecordSecurity,
    StartBookkeeping,
    TrackMetrics,
)
from trainforge.events import read_typed_events
from trainforge.plan.cluster import default_cluster
from trainforge.registry.jobs import JobRecord, JobStore, is_job_id, new_job_id
from trainforge.registry.lineage import LineageStore, parse_target
from trainforge.registry.offline import OfflineStopped
from trainforge.registry.offline import stopped as offline_stopped
from trainforge.registry.secrets import job_access_policy, redact, resolve_secrets
from trainforge.spec import JobSpec, is_remote_repo, is_weights_folder, parse_spec
from trainforge.tasks import code_source, job_credentials, prepare, steps
from trainforge.tasks.checkpoints import CheckpointCorrupt, job_location
from trainforge.tasks.driver import SegmentDriver
from trainforge.tasks.provision import release_gang
from trainforge.tasks.segment import SegmentCancelled, remove_node_folders, terminate_job
from trainforge.tasks.supervisor import give_up_report
from trainforge.validate import ValidationReport

POLL_S = 0.5
# How long a cancelled flow waits for its segment's thread to stop its gang and record the segment (a gang's
# SIGTERM grace is 5 s, then SIGKILL).
CANCEL_WAIT_S = 30.0


class JobFailed(RuntimeError):
    """The job failed for good (user error, or the retry budget spent); the message is the failure report."""
CANCEL_CHECK_S = 2.0


def _as_spec(value: Any) -> Any:
    """A spec document (parsed YAML/JSON, or the Prefect UI's form) through trainforge's own parser: a bad one is
    refused before the flow starts with every problem named (field, value, fix), never echoing a secret."""
    return value if isinstance(value, JobSpec) else parse_spec(value, "spec")


JobSpecParameter = Annotated[JobSpec, BeforeValidator(_as_spec)]
"""The flow's `spec`: its JSON schema is JobSpec's, so the Prefect UI renders a deployment run's form from it."""


class _NoRejectedParameters(logging.Filter):
    """Prefect logs a flow's rejected parameters verbatim ("Parameter validation failed ... Parameters: {...}"); a
    rejected spec may hold the literal secret it was rejected for, so that line is cut to its first words. The
    problems themselves (redacted) are the flow run's failure message."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if message.startswith("Parameter validation failed for flow 'train-job'"):
            record.msg = ("Parameter validation failed for flow 'train-job' (the parameters are not logged: a "
                          "rejected spec may hold a secret; the problems are in the flow run's failure)")
            record.args = ()
        return True


logging.getLogger("prefect.flows").addFilter(_NoRejectedParameters())


def _job_run_name() -> str:
    """The flow run's name is the job id: the one given, or for a new job one chosen here that the flow takes
    (`_new_job_id`), so the Prefect UI and `trainforge status` name a job the same way."""
    from prefect.runtime import flow_run

    params = flow_run.parameters
    if params.get("job_id"):
        return str(params["job_id"])
    spec = params.get("spec")
    return new_job_id(spec.name if isinstance(spec, JobSpec) else "train-job")


def _new_job_id(spec: JobSpec) -> str:
    from prefect.runtime import flow_run

    name = flow_run.name
    return name if name and is_job_id(name, spec.name) else new_job_id(spec.name)


@contextlib.contextmanager
def reusing_validation(report: ValidationReport) -> Iterator[None]:
    """Run the flow with the caller's validation of the very spec it passes (`trainforge submit` and the SDK
    validate before they start the flow), so one submit validates and resolves the layout once. Used only when
    the spec's config hash matches; a deployment run always validates in the flow."""
    token = _SUBMITTED.set(report)
    try:
        yield
    finally:
        _SUBMITTED.reset(token)


_SUBMITTED: contextvars.ContextVar[ValidationReport | None] = contextvars.ContextVar("trainforge_validated",
                                                                                    default=None)


@flow(name="train-job", log_prints=False, flow_run_name=_job_run_name)
def train_job(spec: JobSpecParameter, source: str = "<spec>", base_dir: str = ".", job_id: str | None = None,
              resume: bool = False) -> dict[str, Any]:
    """Train one job end to end: validate, resolve the dataset, plan, provision the gang, train segments,
    evaluate and promote. The flow run is named after the job id.

    Args:
        spec: The job spec: the fields of a job spec file (`trainforge schema` prints them).
        source: Where the spec came from (a file name), as problems and the job record name it.
        base_dir: The folder relative paths of the spec (code.repo, local datasets) are resolved against.
        job_id: The job's id (default: a new one, NAME-YYYYMMDD-HHMMSS-XXXX).
        resume: Continue job `job_id` from its last committed checkpoint (with the same spec).
    """
    log = get_run_logger()
    doc = spec.model_dump(mode="json", exclude_unset=True)  # what the user wrote (the record keeps it)
    # A bad spec fails here: nothing created, nothing started.
    submitted = _SUBMITTED.get()
    reuse = submitted is not None and submitted.ok() and submitted.spec is not None \
        and submitted.spec.config_hash() == spec.config_hash()
    checked = submitted if reuse else steps.validate(doc, source, base_dir)
    jobspec = checked.spec
    assert jobspec is not None
    resolve_secrets(jobspec.secrets)  # a missing secret fails here too; the values are registered for redaction
    if jobspec.init_from and not is_weights_folder(jobspec.init_from):  # the parent must be in lineage, usable
        LineageStore().check_usable(parse_target(jobspec.init_from), must_exist=True)
    # The code before anything else is resolved or recorded: an unreachable repository or an unknown commit is a
    # clear error here. A resume runs the commit the job first ran, not a HEAD that moved since.
    # (A local working tree runs in place, resumed or not: the edit-and-run loop.)
    code = steps.fetch_code(jobspec, base_dir,
                            _recorded_commit(job_id) if resume and is_remote_repo(jobspec.code.repo) else None)
    # A resume trains on the version the job pinned, not on what its reference names now (a moved branch, a prefix
    # with objects added since): the sample order, its anchors and skip list belong to that version.
    dataset = steps.resolve_dataset(jobspec, base_dir, _recorded_dataset(job_id) if resume else None)
    for warning in dataset.get("warnings", []):
        log.warning(warning)
    plan = steps.plan(jobspec, dataset, layout=checked.layout)
    launcher = default_cluster().launcher  # the one this job runs with (its end cleans up through it)
    prepare.check_store_reaches_nodes(prepare.storage_url(), launcher)  # before any record
    record = _open_record(jobspec, job_id or (None if resume else _new_job_id(jobspec)), resume, doc, source)
    init = steps.resolve_init_weights(jobspec, str(record.folder), str(base_dir), dataset) if jobspec.init_from else None
    config = prepare.worker_config(jobspec, record.job_id, record.folder, Path(base_dir), dataset, plan,
                                   code.commit, init.path if init else None, code_path=code.path)
    config = steps.publish_inputs(config)
    config_path = config.write(record.folder / "worker-config.json")
    lineage = _lineage(jobspec, dataset, config.code_commit, record.job_id)
    run_id = record.data.get("mlflow_run_id") or _start_tracking(jobspec, record, plan, dataset, lineage)
    record.update(dataset=dataset, plan=plan, mlflow_run_id=run_id, code_commit=config.code_commit, code_repo=code.repo,
                  config_hash=jobspec.config_hash(), flow_run_id=_flow_run_id(), state="running",
                  iam=job_access_policy(config.storage_url, jobspec.team, record.job_id))
    LineageStore().record_job(record.job_id, team=jobspec.team, dataset=dataset, code_commit=config.code_commit,
                              code_repo=code.repo,
                              config_hash=jobspec.config_hash(), mlflow_run_id=run_id,
                              fine_tuned_from=init.parent if init else None)
    log.info("job %s: dataset %s@%s (%s), layout %s", record.job_id, dataset["name"], dataset["version"][:12],
             dataset["license"], plan["layout"])
    allocation = _provision(jobspec, record, plan, "provisioned")
    pump = _EventPump(jobspec, record, str(config_path), config, run_id)
    try:
        # The workers' own identity on the object store, made by the server now that the gang is admitted (a
        # failure to make it fails the job here, before any worker starts): tasks/job_credentials.py.
        record.update(iam={**record.data.get("iam", {}),
                           "credentials": job_credentials.issue(config, jobspec.max_runtime_s)})
        # One retry loop for the flow and the chaos drills: the driver asks the SegmentController after every
        # segment (retry / re-provision / resize / preempted / finish / give up); a failed segment's retries are
        # Prefect task retries of train-segment, decided by the same controller.
        SegmentDriver(record, total_steps=config.total_steps, max_retries=jobspec.fault_tolerance.max_segment_retries,
                      run=lambda driver: _run_segment(jobspec, record, config_path, config, driver, pump),
                      gang=_FlowGang(jobspec, record, plan), log=log, allocation=allocation).drive()
        pump.drain()
        model = _promote(jobspec, record, str(config_path), config, run_id, lineage, pump)
        record.update(state="completed", model=model, completed_at=time.time())
        _end_tracking(run_id, "FINISHED", record)
        return {"job_id": record.job_id, "state": "completed", "mlflow_run_id": run_id, "model": model,
                "checkpoints": sorted(pump.committed), "flow_run_id": record.data.get("flow_run_id")}
    except BaseException as exc:
        cancelled = isinstance(exc, SegmentCancelled | KeyboardInterrupt)
        terminate_job(record.job_id)
        try:
            pump.drain(raise_errors=False)
        except Exception as drain_error:  # the bookkeeping of the wind-down must not hide the job's outcome
            log.warning("job %s: winding down, the checkpoint bookkeeping failed: %s", record.job_id, drain_error)
        record.update(state="cancelled" if cancelled else "failed", error=redact(str(exc))[-4000:])
        _end_tracking(run_id, "KILLED" if cancelled else "FAILED", record)
        if not cancelled and record.data.get("segments"):  # the retry budget is spent: say what happened
            report = redact(give_up_report(record, exc))
            log.error("%s", report)
            raise JobFailed(report) from exc
        raise
    finally:
        job_credentials.revoke(record.job_id)
        release_gang(record.job_id, "completed" if record.data.get("state") == "completed" else "ended")
        remove_node_folders(record, launcher, log)  # a hosts job's folders on its machines (never raises)


def _provision(spec: JobSpec, record: JobRecord, plan: dict[str, Any], reason: str) -> dict[str, Any]:
    """Admit the gang as the provision-gang task (idempotent for a running job: it returns the current, possibly
    resized, allocation), kept in the job record; an elastic job's change of size is logged as a resize."""
    allocation, resize = steps.provision(record, spec, plan["layout"], reason)
    if resize is not None:
        get_run_logger().warning("elastic resize: %s -> %s workers (dp %s -> %s, accumulation %s -> %s, global "
                                 "batch %s kept): %s", resize["from_workers"], resize["to_workers"],
                                 resize["from_dp"], resize["to_dp"], *resize["accumulation"],
                                 resize["global_batch_size"], reason)
    return allocation


class _FlowGang:
    """The driver's provisioning (tasks/driver.py `Gang`): the live scheduler, through the flow's tasks."""

    def __init__(self, spec: JobSpec, record: JobRecord, plan: dict[str, Any]):
        self.spec, self.record, self.plan = spec, record, plan

    def provision(self, reason: str) -> dict[str, Any]:
        return _provision(self.spec, self.record, self.plan, reason)

    def release(self, outcome: str = "ended") -> None:
        release_gang(self.record.job_id, outcome)

    def reprovision(self, lost: tuple[str, ...]) -> dict[str, Any]:
        record = JobStore(self.record.folder.parent).get(self.record.job_id)  # the failed attempt's incidents
        return steps.reprovision(record, self.spec, lost)


def _run_segment(spec: JobSpec, record: JobRecord, config_path: Path, config: SegmentConfig, driver: SegmentDriver,
                 pump: _EventPump) -> Any:
    """One segment as a train-segment task: its retries are Prefect task retries (shown in the UI), as many as
    the budget left, each one decided by the controller (`retry_condition`) and prepared by `before_attempt`."""
    segment = steps.train_segment.with_options(retries=driver.retries_left, retry_condition_fn=driver.retry_condition)
    future = segment.submit(record, str(config_path), config, (driver.allocation or {}).get("workers", 1),
                            spec.fault_tolerance.max_restarts, pump.cancel, spec, driver.before_attempt)
    try:
        while not future.state.is_final():
            pump.poll()
            future.wait(POLL_S)
    except BaseException:
        # Ctrl-C or SIGTERM lands here, in the flow's thread, while the segment runs in a task-runner thread: tell
        # it the job is cancelled before stopping its gang, or it takes the stopped gang for a failure and Prefect
        # retries it (a new gang that the interpreter's exit would then wait for, training on), and wait for it.
        pump.cancel.set()
        terminate_job(record.job_id)
        future.wait(CANCEL_WAIT_S)
        raise
    pump.poll()
    return future.result()


def _recorded_commit(job_id: str | None) -> str | None:
    """The full commit id a job being resumed ran (None for a local working tree run in place)."""
    if not job_id:
        return None
    try:
        commit = JobStore().get(job_id).data.get("code_commit") or ""
    except LookupError:
        return None
    return commit if code_source.FULL_SHA.fullmatch(commit) else None


def _recorded_dataset(job_id: str | None) -> str | None:
    """The exact version a job being resumed trained on, as a reference: `catalog://NAME@VERSION` for catalog
    versions and pinned s3:// prefixes, the recorded pinned reference (a lakeFS commit) otherwise."""
    if not job_id:
        return None
    try:
        ds = JobStore().get(job_id).data.get("dataset") or {}
    except LookupError:
        return None
    ref, name, version = str(ds.get("ref", "")), ds.get("name"), ds.get("version")
    if ref.startswith(("catalog://", "s3://")) and name and version:
        return f"catalog://{name}@{version}"
    return ds.get("pinned_ref") if ref.startswith("lakefs://") else None


def _open_record(spec: JobSpec, job_id: str | None, resume: bool, doc: dict[str, Any], source: str) -> JobRecord:
    store = JobStore()
    if resume:
        if not job_id:
            raise ValueError("resume needs the job id to continue")
        record = store.get(job_id)
        if record.data.get("config_hash") and record.data["config_hash"] != spec.config_hash():
            raise ValueError(f"job {job_id} was started with a different spec (config hash "
                             f"{record.data['config_hash'][:12]} != {spec.config_hash()[:12]}); resume it with the "
                             "same spec, or submit a new job")
        return record
    return store.create(job_id or new_job_id(spec.name), name=spec.name, team=spec.team, spec=doc, source=source)


def _lineage(spec: JobSpec, dataset: dict[str, Any], commit: str, job_id: str) -> dict[str, str]:
    return {
        "trainforge.job_id": job_id,
        "trainforge.team": spec.team,
        "trainforge.dataset_ref": dataset["ref"],
        "trainforge.dataset_version": dataset["version"],
        "trainforge.dataset_license": dataset["license"],
        "trainforge.code_commit": commit,
        "trainforge.config_hash": spec.config_hash(),
    }


def _start_tracking(spec: JobSpec, record: JobRecord, plan: dict[str, Any], dataset: dict[str, Any],
                    lineage: dict[str, str]) -> str:
    from trainforge.registry.tracking import Tracker

    # Params are the resolved config: the spec (secret *names* only, never values), the layout and the dataset.
    params = {"spec": spec.model_dump(mode="json", exclude={"secrets"}), "layout": plan["layout"],
              "model_parameters": plan["parameters"], "dataset": {k: dataset[k] for k in ("ref", "version")}}
    return Tracker().start_run(spec.team, record.job_id, params, lineage)


def _end_tracking(run_id: str, status: str, record: JobRecord | None = None) -> None:
    from trainforge.registry.tracking import Tracker

    try:  # logs, events, evaluation results, TensorBoard and profiler files: every job's, failed ones too
        from trainforge.registry import promotion

        if record is not None and not record.data.get("model"):  # a registered model's promotion linked them
            promotion.link_run_artifacts(Tracker(), run_id, record)
    except Exception as exc:  # artifacts must never mask the job's own outcome
        get_run_logger().warning("could not log the artifacts of MLflow run %s: %s", run_id, exc)
    try:  # the per-job HTML report (registry/report.py), logged as an artifact before the run closes
        from trainforge.registry.report import report_for_run

        report_for_run(run_id)
    except Exception as exc:  # a report must never mask the job's own outcome
        get_run_logger().warning("could not write the job report of MLflow run %s: %s", run_id, exc)
    try:
        Tracker().end_run(run_id, status)
    except Exception:  # tracking must never mask the job's own outcome
        get_run_logger().warning("could not close MLflow run %s", run_id)


def _flow_run_id() -> str | None:
    from prefect.runtime import flow_run

    return flow_run.id


def _promote(spec: JobSpec, record: JobRecord, config_path: str, config: SegmentConfig, run_id: str,
             lineage: dict[str, str], pump: _EventPump) -> dict[str, Any]:
    from trainforge.tasks.checkpoints import best_step, checkpoint_metrics, job_store

    metrics = checkpoint_metrics(job_store(config), config.storage_prefix)
    step = best_step(spec, metrics)
    model = steps.promote(spec, str(record.folder), config_path, config, run_id, step, lineage, metrics[step],
                          pump.exported(step))
    protected = sorted(set(record.data.get("protected_steps", [])) | {step})
    record.update(protected_steps=protected)
    return model


def _evaluation_scheduler(spec: JobSpec) -> EvaluationScheduler:
    """One evaluation at a time per job by default ($TRAINFORGE_EVAL_CONCURRENCY); every checkpoint is evaluated
    when keep_best ranks them by a metric (retention and promotion may need any of them)."""
    import os

    return EvaluationScheduler(limit=concurrency_from(os.environ), keep_all=spec.checkpoint.keep_best is not None)


EXPORT_STOP_WAIT_S = 60.0
"""How long a failed or cancelled job waits for its stopped early export (its download or process is stopped)."""


def promotes_on_commit(step: int, total_steps: int, spec: JobSpec) -> bool:
    """Whether the checkpoint of `step`, just committed, is the one the job will promote if it completes: its last
    step's, and promotion takes the newest (no keep_best metric to rank by)."""
    return step >= total_steps and spec.checkpoint.keep_best is None


def _superseded(step: int, committed: dict[int, dict[str, Any]]) -> bool:
    return any(other > step for other in committed)


class _EventPump:
    """Tails events.jsonl: metrics -> MLflow, checkpoints -> commit + evaluate tasks, cancel requests -> stop."""

    def __init__(self, spec: JobSpec, record: JobRecord, config_path: str, config: SegmentConfig, run_id: str):
        from trainforge.registry.tracking import Tracker

        self.spec, self.record, self.config_path, self.config, self.run_id = spec, record, config_path, config, run_id
        self.tracker = Tracker()
        # A resumed job continues its events file: what earlier runs reported is already booked in the record.
        self.offset = record.events_path.stat().st_size if record.events_path.is_file() else 0
        self.cancel = threading.Event()
        self.committed: dict[int, dict[str, Any]] = {int(k): v for k, v in record.data.get("checkpoints", {}).items()}
        self.futures: list[tuple[int, PrefectFuture[Any]]] = []  # commit bookkeeping in flight, every checkpoint
        self.evaluations = _evaluation_scheduler(spec)  # evaluations: bounded, newest first (contract/evaluation)
        self.pending_entries: dict[int, dict[str, Any]] = {}  # committed, evaluation pending
        self.running: dict[int, PrefectFuture[Any]] = {}  # evaluations in flight
        self.export: tuple[int, PrefectFuture[Any]] | None = None  # the last checkpoint's, begun as it committed
        self._last_cancel_check = 0.0
        self.log = get_run_logger()
        from trainforge.registry.alerts import MetricsObserver, load_rules

        self.observer = MetricsObserver(load_rules(), (record.data.get("plan") or {}).get("predicted"))
        self.router = EventRouter(observe=self.observer.rows)
        from trainforge.registry.tensorboard import FOLDER, ScalarLog

        self.tensorboard = ScalarLog(record.folder / FOLDER)  # the same rows as MLflow, for `tensorboard --logdir`

    def poll(self) -> None:
        events, self.offset, problems = read_typed_events(self.record.events_path, self.offset)
        for problem in problems:  # a worker of another version, or a corrupt line: said, and the rest still read
            self.log.warning("ignored an event: %s", problem)
        rows: list[Any] = []
        security: list[dict[str, Any]] = []
        for ev in events:
            for action in self.router.route(ev, self.committed):  # the routing rules: trainforge/contract/router.py
                match action:
                    case TrackMetrics():
                        rows.extend(action.rows)
                    case StartBookkeeping():
                        self._on_checkpoint(action.step)
                    case Log(level="warning"):
                        self.log.warning("%s", action.message)
                    case Log():
                        self.log.info("%s", action.message)
                    case RecordResume():
                        LineageStore().record_resume(self.record.job_id, action.step)
                    case RecordSecurity():
                        security.append(action.entry)
        if security:  # one record write per poll, however many refusals the poll brought
            self.record.update(security=[*self.record.data.get("security", []), *security][-1000:])
        if rows:
            self.tracker.log_metrics(self.run_id, rows)
            self._tensorboard(rows)
        self.observer.check_stalled(time.time())
        self._publish_alerts()
        self._collect(block=False)
        self._check_cancel()

    def _tensorboard(self, rows: list[Any]) -> None:
        try:
            self.tensorboard.add(rows)
        except Exception as exc:  # a full disk loses the TensorBoard copy, never the job (MLflow has the metrics)
            self.log.warning("could not write TensorBoard events to %s: %s", self.tensorboard.folder, exc)

    def _publish_alerts(self) -> None:
        """Fired alerts: a warning in the flow log, the job record, a run tag and a Prefect event (automations)."""
        fired = self.observer.take_alerts()
        if not fired:
            return
        from prefect.events import emit_event

        alerts = self.record.data.get("alerts", [])
        for a in fired:
            self.log.warning("alert %s at step %s: %s", a.rule, a.step, a.message)
            alerts.append({**a.to_dict(), "time": time.time()})
            try:
                self.tracker.set_tags(self.run_id, {f"trainforge.alert.{a.rule}": f"step {a.step}: {a.message}"})
                emit_event(event=f"trainforge.alert.{a.kind}", payload=a.to_dict(),
                           resource={"prefect.resource.id": f"trainforge.job.{self.record.job_id}",
                                     "trainforge.team": self.spec.team})
            except Exception as exc:  # publishing must never stop the job
                self.log.warning("could not publish alert %s: %s", a.rule, exc)
        self.record.update(alerts=alerts)

    def _on_checkpoint(self, step: int) -> None:
        """Commit bookkeeping for every committed checkpoint at once; its evaluation waits for the scheduler."""
        self.committed[step] = {"step": step}
        self.evaluations.committed(step)
        self.observer.platform_started(f"commit-{step}", time.time())  # the alert rules do not judge meanwhile
        self.futures.append((step, steps.commit_checkpoint.submit(self.config, step)))

    def _collect(self, block: bool, raise_errors: bool = True, evaluate: bool = True) -> None:
        """Book what finished: commits (then queue their evaluation), evaluations (then book the entry + metrics);
        start the evaluations the scheduler allows. `block`: until every commit and evaluation is done.
        `evaluate=False` (a failed or cancelled job winding down): start no more evaluations, book the rest."""
        while True:
            pending = []
            for step, commit in self.futures:
                if not block and not commit.state.is_final():
                    pending.append((step, commit))
                    continue
                entry = self._result(step, commit, raise_errors)
                self.observer.platform_finished(f"commit-{step}", time.time())
                if entry is None:
                    continue
                if evaluate:  # not while a failed or cancelled job winds down: nothing will promote
                    self._export_early(step)
                if self.spec.evaluation.enabled:
                    self.pending_entries[step] = entry
                    self.evaluations.ready(step)
                else:
                    self._book(step, entry)
            self.futures = pending
            plan = self.evaluations.take() if evaluate else self.evaluations.stop()
            for step in plan.skip:  # superseded while it waited (retention and promotion do not need it), or the
                # job is winding down
                entry = self.pending_entries.pop(step, None)
                if entry is not None:
                    self.log.info("checkpoint %s: evaluation skipped (%s)", step, f"superseded by step "
                                  f"{self.evaluations.newest}" if evaluate else "the job is ending")
                    self._book(step, entry)
            for step in plan.start:
                self.observer.platform_started(f"evaluate-{step}", time.time())
                self.running[step] = steps.evaluate.submit(self.config_path, self.config, step,
                                                            self.spec.evaluation.batches)
            for step, evaluation in list(self.running.items()):
                if not block and not evaluation.state.is_final():
                    continue
                del self.running[step]
                self.evaluations.finished(step)
                result = self._result(step, evaluation, raise_errors)
                self.observer.platform_finished(f"evaluate-{step}", time.time())
                entry = self.pending_entries.pop(step, {"step": step})
                if result is None:
                    continue
                entry.update(result)
                self.tracker.log_metrics(self.run_id, [(step, result)])
                self._tensorboard([(step, result)])
                self._book(step, entry)
            if not block or (not self.futures and self.evaluations.idle):
                return

    def _export_early(self, step: int) -> None:
        """The job's last checkpoint is exported as soon as it commits, while the gang winds down, when promotion
        will take it: the newest, unless keep_best ranks the checkpoints by an evaluation still to come. The
        promotion then only registers it: a tiny job's end came 2.5-3 s sooner (stop 54)."""
        if self.export is None and promotes_on_commit(step, self.config.total_steps, self.spec):
            self.export = (step, steps.export.submit(self.config_path, self.config, step, str(self.record.folder)))

    def exported(self, step: int) -> dict[str, Any] | None:
        """The early export's result when it is of `step` and succeeded; None: the promotion exports."""
        if self.export is None or self.export[0] != step:
            return None
        try:
            return self.export[1].result()
        except Exception as exc:  # the promotion exports again: the export's own error is said there if it recurs
            self.log.warning("checkpoint %s: its export as it committed failed (%s): exporting again", step, exc)
            return None

    def _result(self, step: int, future: PrefectFuture[Any], raise_errors: bool) -> Any:
        """A commit's or an evaluation's result; None when it failed (logged, or raised when `raise_errors`)."""
        try:
            return future.result()
        except OfflineStopped:
            # The job is winding down (drain): the checkpoint is committed, only its metrics are missing
            self.log.info("checkpoint %s: evaluation stopped (the job is ending)", step)
            self.evaluations.drop(step)
            self._book(step, self.pending_entries.pop(step, {"step": step}))
            return None
        except CheckpointCorrupt as exc:
            if _superseded(step, self.committed):
                # Retention removed it before its bookkeeping ran: newer checkpoints replace it.
                self.log.info("checkpoint %s was retired before its evaluation: %s", step, exc)
                self.committed.pop(step, None)
                self.evaluations.drop(step)
                return None
            if raise_errors:
                raise
            self.log.warning("checkpoint %s bookkeeping failed: %s", step, exc)
        except Exception as exc:
            if raise_errors:
                raise
            self.log.warning("checkpoint %s bookkeeping failed: %s", step, exc)
        self.evaluations.drop(step)
        return None

    def _book(self, step: int, entry: dict[str, Any]) -> None:
        """The checkpoint's catalog entry in the record, then retention (which spares checkpoints whose pending
        evaluation may keep them: contract/evaluation.py `awaiting`)."""
        self.committed[step] = entry
        checkpoints = self.record.data.get("checkpoints", {})
        checkpoints[str(step)] = entry
        self.record.update(checkpoints=checkpoints)
        protected = sorted(set(self.record.data.get("protected_steps", [])) | self.evaluations.awaiting)
        deleted = steps.apply_retention(self.spec, self.config, protected)
        if deleted:
            for s in deleted:
                checkpoints.pop(str(s), None)
                self.evaluations.drop(s)
                self.pending_entries.pop(s, None)
            self.record.update(checkpoints=checkpoints)

    def drain(self, raise_errors: bool = True) -> None:
        self.poll() if raise_errors else None
        # A job that failed or was cancelled stops quickly: queued evaluations are skipped and running ones stopped
        # (their commits booked without metrics), or a cancel would wait out an evaluation nothing will promote.
        with contextlib.nullcontext() if raise_errors else offline_stopped(job_location(self.config)):
            self._collect(block=True, raise_errors=raise_errors, evaluate=raise_errors)
            if not raise_errors and self.export is not None:  # begun before the failure: stopped (refused if
                self.export[1].wait(EXPORT_STOP_WAIT_S)  # it had not started), and waited for here, not by the
                # task runner at the flow's end
        self.record.update(alert_coverage=dict(self.observer.engine.coverage))
        self._log_profiles()

    def _log_profiles(self) -> None:
        """torch.profiler traces of a requested window (trainer/profiling.py): merged summary + run artifacts."""
        from trainforge.trainer.profiling import merge_folder

        folder = self.record.folder / "profiles"
        if not folder.is_dir() or (folder / ".logged").exists():
            return
        try:
            merged = merge_folder(folder)
            self.tracker.log_artifacts(self.run_id, folder, "profiles")
            (folder / ".logged").touch()
            if merged:
                self.record.update(profile=merged)
                self.log.info("profile: straggler rank %s, comm overlap %.0f%%", merged.get("straggler_rank"),
                              100 * merged.get("overlap_fraction_mean", 0.0))
        except Exception as exc:
            self.log.warning("could not log the profile: %s", exc)

    def _check_cancel(self) -> None:
        now = time.monotonic()
        if now - self._last_cancel_check < CANCEL_CHECK_S:
            return
        self._last_cancel_check = now
        flow_run_id = self.record.data.get("flow_run_id")
        if not flow_run_id:
            return
        from prefect.client.orchestration import get_client

        try:
            with get_client(sync_client=True) as client:
                state = client.read_flow_run(flow_run_id).state
        except Exception:
            return
        if state is not None and state.name in ("Cancelling", "Cancelled"):
            self.log.warning("cancel requested: stopping every worker of %s", self.record.job_id)
            self.cancel.set()
