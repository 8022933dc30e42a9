"""The Prefect tasks of a training job. Each is thin: it calls one capability and records what happened.

A training segment's retries are Prefect task retries of `train-segment`, decided by the SegmentController
(trainforge/contract/controller.py) through the flow's driver (tasks/driver.py): infrastructure faults and
divergence rollbacks within their budgets; a user error or a cancellation ends it at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from trainforge.contract.config import SegmentConfig
from trainforge.infra.launch import GangNode
from trainforge.plan.cluster import ClusterSpec, default_cluster
from trainforge.plan.layout import Layout
from trainforge.registry.jobs import JobRecord
from trainforge.spec import JobSpec
from trainforge.tasks import checkpoints as ckpt
from trainforge.tasks import code_source, prepare
from trainforge.tasks.provision import report_checkpoint
from trainforge.tasks.segment import SegmentResult, run_segment
from trainforge.tasks.supervisor import incident_hosts
from trainforge.validate import ValidationReport


@task(name="validate", cache_policy=NO_CACHE)
def validate(doc: dict[str, Any], source: str, base_dir: str, cluster: ClusterSpec | None = None) -> ValidationReport:
    """The spec and the layout it resolved (handed to `plan`, so one submit resolves the layout once)."""
    return prepare.validate_report(doc, source, Path(base_dir), cluster)


@task(name="fetch-code", cache_policy=NO_CACHE)
def fetch_code(spec: JobSpec, base_dir: str, pinned: str | None = None) -> code_source.CodeCheckout:
    """code.repo fetched and its commit checked out (or a local working tree run in place): tasks/code_source.py."""
    return code_source.fetch_code(spec, Path(base_dir), pinned)


@task(name="resolve-dataset", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def resolve_dataset(spec: JobSpec, base_dir: str, pinned: str | None = None) -> dict[str, Any]:
    return prepare.resolve_dataset(spec, Path(base_dir), pinned)


@task(name="resolve-init-weights", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2)
def resolve_init_weights(spec: JobSpec, run_dir: str, base_dir: str,
                         dataset: dict[str, Any] | None = None) -> prepare.InitWeights | None:
    """Fine-tuning: the parent checkpoint, model version or Hugging Face folder as one safetensors file for the
    workers, and the lineage node it is (a folder's tokenizer checked against `dataset`'s)."""
    return prepare.resolve_init_weights(spec, Path(run_dir), Path(base_dir), dataset)


@task(name="publish-inputs", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def publish_inputs(config: SegmentConfig) -> SegmentConfig:
    """A gang on other machines (the `hosts` backend) reads nothing on this host: the code, a local dataset and the
    initial weights go to the job's prefix in the store first (tasks/inputs.py). One host: the config as it is."""
    launcher = default_cluster().launcher
    if launcher.backend != "hosts":
        return config
    prepare.check_store_reaches_nodes(config.storage_url, launcher)  # checked at submit too; the cluster may move
    from trainforge.tasks.inputs import publish_inputs as publish

    return publish(config)


@task(name="plan", cache_policy=NO_CACHE)
def plan(spec: JobSpec, dataset: dict[str, Any], cluster: ClusterSpec | None = None,
         layout: Layout | None = None) -> dict[str, Any]:
    result = prepare.make_plan(spec, cluster, layout)
    prepare.check_dataset_fits(spec, dataset, result)
    return result


@task(name="provision-gang", cache_policy=NO_CACHE, task_run_name="provision-gang: {reason}")
def provision(record: JobRecord, spec: JobSpec, layout: dict[str, Any], reason: str) -> tuple[dict[str, Any],
                                                                                             dict[str, Any] | None]:
    """Admit the gang (all of its slots or none) and keep the allocation in the job record; returns it and the
    resize it made, if any. While the gang waits in the queue, the task run's name and its log say its position
    and the scheduler's reason (the Prefect UI shows both as they change); once admitted, the name says after how
    long."""
    from prefect.runtime import task_run

    from trainforge.tasks.provision import QueueWait, provision_gang, record_allocation

    log, run_id, t0 = get_run_logger(), task_run.id, time.monotonic()
    waited: list[QueueWait] = []

    def on_wait(wait: QueueWait) -> None:
        waited.append(wait)
        log.info("job %s waits in the queue: %s", record.job_id, wait.describe())
        _rename_task_run(run_id, f"provision-gang: queued {wait.position} of {wait.pending}: {wait.reason}")

    allocation = provision_gang(record.job_id, spec, layout, on_wait)
    if waited:
        took = time.monotonic() - t0
        log.info("job %s admitted after %.0f s in the queue (%s workers)", record.job_id, took, allocation["workers"])
        _rename_task_run(run_id, f"provision-gang: admitted after {took:.0f} s ({reason})")
    return allocation, record_allocation(record, allocation, reason, spec)


def _rename_task_run(run_id: Any, name: str) -> None:
    from prefect.client.orchestration import get_client

    if run_id is None:
        return
    try:
        with get_client(sync_client=True) as client:
            client.set_task_run_name(run_id, name[:200])
    except Exception as exc:  # noqa: BLE001 - a name is information; the provisioning goes on
        get_run_logger().debug("could not rename task run %s: %s", run_id, exc)


def _never_retry(task_: Any, task_run: Any, state: Any) -> bool:
    """Without a driver nothing decides a retry: the flow submits train-segment with its driver's
    `retry_condition` (the SegmentController) and `retries` = the budget left (tasks/driver.py)."""
    return False


@task(name="train-segment", cache_policy=NO_CACHE, retry_condition_fn=_never_retry, retry_delay_seconds=1)
def train_segment(record: JobRecord, config_path: str, config: SegmentConfig, nproc: int, max_restarts: int,
                  cancel: threading.Event, spec: JobSpec | None = None,
                  before_attempt: Callable[[], Any] | None = None) -> SegmentResult:
    """One attempt of a segment. `before_attempt` (the driver's) runs first: after a failed attempt it carries
    out the controller's decision (tier 2: a fresh gang without the nodes the attempt lost, or the same gang)."""
    import os

    from trainforge.infra.launch import device_environment
    from trainforge.registry.jobs import JobStore
    from trainforge.registry.secrets import resolve_secrets
    from trainforge.tasks import job_credentials

    if before_attempt is not None:
        before_attempt()
    # Re-read the record: a retry must see the segments the failed attempt appended, and the new allocation.
    fresh = JobStore(record.folder.parent).get(record.job_id)
    extra = resolve_secrets(fresh.data.get("spec", {}).get("secrets", []))  # into the workers' env only
    # The workers mask these in everything they print (trainer/output_mask.py); the object-store keys always.
    masked = ",".join(sorted(extra))
    extra.update(job_credentials.worker_env(fresh.job_id))  # the job's own S3 identity, if one was issued
    if masked:
        extra["TRAINFORGE_MASKED_ENV"] = masked
    # The gang this segment runs on (an elastic job's size may have changed since the flow submitted it).
    allocation = fresh.data.get("allocation") or {}
    nodes = allocation.get("nodes") or []
    cluster = default_cluster()
    status = _scheduler_status(fresh.job_id) if spec else None
    if cluster.launcher.backend == "hosts" and nodes:  # one node agent per allocated machine
        return run_segment(fresh, Path(config_path), config, nproc=allocation.get("workers", nproc),
                           max_restarts=max_restarts, cancel=cancel, extra_env=extra, scheduler_status=status,
                           layout=allocation.get("layout"), sizes=allocation.get("sizes"),
                           hosts=gang_hosts(cluster, allocation), launcher=cluster.launcher,
                           gpu_type=allocation.get("gpu_type", "cpu"))
    if len(nodes) == 1:  # the local launch: its workers see only the GPUs the scheduler gave this job here
        extra.update(device_environment(allocation.get("gpu_type", "cpu"),
                                        (allocation.get("devices") or {}).get(nodes[0]), os.environ))
    return run_segment(fresh, Path(config_path), config, nproc=allocation.get("workers", nproc),
                       max_restarts=max_restarts, cancel=cancel, extra_env=extra, scheduler_status=status,
                       layout=allocation.get("layout"), sizes=allocation.get("sizes"))


def gang_hosts(cluster: ClusterSpec, allocation: dict[str, Any]) -> list[GangNode]:
    """The allocation's nodes as the machines the hosts launcher starts them on (address, rack, accelerators)."""
    out = []
    for name in allocation["nodes"]:
        host = cluster.host(name)
        if host is None:
            raise ValueError(f"the scheduler placed the job on {name!r}, which no node group of cluster "
                             f"{cluster.name!r} lists under `hosts`: the hosts launcher cannot start it")
        devices = tuple((allocation.get("devices") or {}).get(name) or ())
        out.append(GangNode(name, host.address, host.rack, devices))
    return out


def reprovision(record: JobRecord, spec: JobSpec, lost: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Release the gang and request it again; a node the last attempt lost whole (`lost`, by default read from
    the record's incidents) is marked unhealthy first so the scheduler places the gang elsewhere. An elastic job that cannot get its full size back continues at a
    smaller valid one (a `resize` in the record); the allocation is returned and kept in the job record."""
    from trainforge.infra.scheduler.live import LiveScheduler, SchedulingTimeout
    from trainforge.plan.cluster import default_cluster
    from trainforge.tasks.provision import RecoveryTimeout, provision_gang, record_allocation, release_gang

    attempt = record.data["segments"][-1]["attempt"]
    kinds: dict[str, str] = {}
    for i in record.data.get("incidents", []):
        if i["attempt"] == attempt:
            for h in incident_hosts(i):
                kinds.setdefault(h, i["kind"])
    if lost is None:
        lost = tuple(kinds)
    scheduler = LiveScheduler(default_cluster())
    for node in sorted(lost):
        try:
            scheduler.node_failed(node, f"{kinds.get(node, 'lost')} in job {record.job_id}'s segment {attempt}")
        except (KeyError, ValueError):  # a host name the scheduler does not place on (the local backend)
            continue
    release_gang(record.job_id)
    # what the recovery is for, as `status` and the failure say it: the cut or loss the attempt's incidents name
    causes = [i["message"] for i in record.data.get("incidents", []) if i["attempt"] == attempt
              and incident_hosts(i) and set(incident_hosts(i)) & set(lost)]
    cause = "; ".join(causes) or f"segment {attempt} failed"
    wait_s = spec.fault_tolerance.recovery_wait_s
    try:
        allocation = provision_gang(record.job_id, spec, record.data["plan"]["layout"],
                                    _log_wait(record, cause, time.time() + wait_s), timeout_s=wait_s)
    except SchedulingTimeout as exc:
        raise RecoveryTimeout(f"job {record.job_id} found no gang within fault_tolerance.recovery_wait_s "
                              f"({wait_s} s) after {cause}: {exc.reason}") from exc
    finally:
        if record.data.get("waiting"):
            record.update(waiting=None)
    why = f"re-provisioned after segment {attempt} failed" + (f" (lost {', '.join(sorted(lost))})" if lost else "")
    record_allocation(record, allocation, why, spec)
    return allocation


def _log_wait(record: JobRecord, cause: str, until: float) -> Any:
    """Re-provisioning runs inside train-segment: its wait in the queue goes to that task's log, and to the job
    record's `waiting` (what `status` shows: the fault it recovers from, the scheduler's reason, its deadline)."""
    try:
        log = get_run_logger()
    except Exception:  # noqa: BLE001 - outside a Prefect run (a chaos drill): the module logger
        import logging

        log = logging.getLogger(__name__)
    since = time.time()

    def on_wait(wait: Any) -> None:
        reason = f"re-provisioning after {cause}: {wait.describe()}"
        log.info("job %s waits in the queue: %s (gives up at %s)", record.job_id, reason,
                 time.strftime("%H:%M:%S", time.localtime(until)))
        record.update(waiting={"reason": reason, "since": since, "until": until})

    return on_wait


def _scheduler_status(job_id: str) -> Any:
    def status() -> dict[str, Any] | None:
        from trainforge.infra.scheduler.live import LiveScheduler
        from trainforge.plan.cluster import default_cluster

        return LiveScheduler(default_cluster()).status(job_id)

    return status


@task(name="commit-checkpoint", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1)
def commit_checkpoint(config: SegmentConfig, step: int) -> dict[str, Any]:
    from trainforge.registry.lineage import LineageStore

    entry = ckpt.commit_bookkeeping(config, step)
    LineageStore().record_checkpoint(config.job_id, step, team=config.team, attrs={"prefix": entry["prefix"]})
    # the scheduler picks preemption victims by work lost since their last commit: it hears of each one
    failed = report_checkpoint(config.job_id)
    if failed:
        get_run_logger().warning("checkpoint %s: not reported to the scheduler (%s)", step, failed)
    return entry


def _unless_stopped(task: Any, task_run: Any, state: Any) -> bool:
    """Retry a failed evaluation once, unless the job's wind-down stopped it (registry/offline.py)."""
    from trainforge.registry.offline import OfflineStopped

    try:
        state.result(raise_on_failure=True)
    except OfflineStopped:
        return False
    except BaseException:
        return True
    return True


@task(name="evaluate", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=1, retry_condition_fn=_unless_stopped)
def evaluate(config_path: str, config: SegmentConfig, step: int, batches: int) -> dict[str, float]:
    return ckpt.evaluate(Path(config_path), config, step, batches)


@task(name="apply-retention", cache_policy=NO_CACHE)
def apply_retention(spec: JobSpec, config: SegmentConfig, protected: list[int]) -> list[int]:
    return ckpt.apply_retention(spec, config, protected)


@task(name="export", cache_policy=NO_CACHE)
def export(config_path: str, config: SegmentConfig, step: int, record_folder: str) -> dict[str, Any]:
    """The checkpoint as the model promotion registers (safetensors, HF folder, MLmodel), in the job's folder."""
    return ckpt.export_safetensors(Path(config_path), config, step, ckpt.export_folder(record_folder, step))


@task(name="promote", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2)
def promote(spec: JobSpec, record_folder: str, config_path: str, config: SegmentConfig, run_id: str,
            step: int, lineage: dict[str, str], metrics: dict[str, float],
            exported: dict[str, Any] | None = None) -> dict[str, Any]:
    """Register the checkpoint of `step` as the team's next model version. `exported`: the result of its `export`
    task, already run (the flow starts it as the last checkpoint commits); else exported here."""
    from trainforge.registry.lineage import LineageStore, checkpoint_id
    from trainforge.registry.tracking import Tracker

    # The dataset may have been withdrawn while the job ran: such a checkpoint is never registered (QuarantinedError).
    LineageStore().check_usable(checkpoint_id(config.job_id, step))
    out = ckpt.export_folder(record_folder, step)
    if exported is None or not (out / "model.safetensors").is_file():  # an export renames its folder in when done
        exported = ckpt.export_safetensors(Path(config_path), config, step, out)
    tracker = Tracker()
    tracker.log_artifacts(run_id, out, "model")  # the folder is the MLflow model (MLmodel, weights, hf/)
    name = f"{spec.team}.{spec.name}"
    tags = {**lineage, "trainforge.step": str(step), **{f"metric.{k}": f"{v:.6g}" for k, v in metrics.items()
                                                          if isinstance(v, int | float)}}
    version = tracker.register_model(name, tracker.artifact_uri(run_id, "model"), run_id, tags)
    from trainforge.registry.jobs import JobStore
    from trainforge.registry.promotion import after_register

    after_register(JobStore(Path(record_folder).parent).get(Path(record_folder).name), step, name, version, run_id)
    return {"model_name": name, "version": version, "step": step, "path": str(out / "model.safetensors"),
            "parameters": exported["parameters"], "promoted_at": time.time()}
