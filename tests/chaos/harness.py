"""Drive a small real job through `run_segment` (real torchrun, 2 gloo workers, real checkpoints) with faults
injected, retrying segments like the train-job flow does, and measure detection latency, MTTR and lost work from
the run's own records (events.jsonl, fault markers). Shared by tests/chaos/ and bench/chaos_mttr.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trainforge.datasets.demo import ensure_demo_dataset
from trainforge.events import read_events
from trainforge.registry.jobs import JobRecord, JobStore
from trainforge.tasks import prepare
from trainforge.tasks.segment import SegmentFailed, run_segment
from trainforge.trainer.faults import fired_at

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
FAST_HEALTH = {"heartbeat_interval_s": 0.25, "heartbeat_timeout_s": 3.0, "hang_timeout_s": 4.0,
               "straggler_patience": 4}


@dataclass
class ChaosJob:
    record: JobRecord
    config_path: Path
    config: Any
    segments: list[Any] = field(default_factory=list)
    failures: list[SegmentFailed] = field(default_factory=list)
    wall_s: float = 0.0
    spec: Any = None
    workers: int = 2
    placements: list[list[str]] = field(default_factory=list)
    """Multi-node jobs: the scheduler's nodes of each segment, in rank order."""
    regang_s: list[float] = field(default_factory=list)
    """Seconds each release + re-request of the gang took (after a preemption or a failed segment)."""


# Multi-node chaos jobs are placed by the live scheduler on this cluster: 3 "nodes" of 2 CPU worker slots, all on
# this host (one torchrun agent per node); a job of 4 workers takes 2 of them and a lost one can be replaced.
CHAOS_CLUSTER = {"name": "chaos-nodes", "node_mtbf_hours": 10000, "node_groups": [
    {"name": "chaos", "gpu_type": "cpu", "nodes": 3, "gpus_per_node": 2, "nodes_per_rack": 3,
     "memory_per_node_gb": 16, "intra_node_link": "loopback", "inter_node_link": "loopback"}]}


@contextlib.contextmanager
def chaos_cluster(active: bool = True) -> Iterator[None]:
    """$TRAINFORGE_CLUSTER -> the chaos cluster while planning / scheduling a multi-node job (restored after)."""
    if not active:
        yield
        return
    from trainforge.home import home

    path = home() / "chaos-cluster.yaml"
    path.write_text(yaml.safe_dump(CHAOS_CLUSTER))
    before = os.environ.get("TRAINFORGE_CLUSTER")
    os.environ["TRAINFORGE_CLUSTER"] = str(path)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TRAINFORGE_CLUSTER", None)
        else:
            os.environ["TRAINFORGE_CLUSTER"] = before


def make_job(job_id: str, *, steps: int = 24, interval: int = 8, segment_max_steps: int | None = None,
             workers: int = 2) -> ChaosJob:
    """The tiny model on `workers` gloo ranks; 4 workers are laid out as 2 nodes of 2 (see CHAOS_CLUSTER)."""
    ensure_demo_dataset()
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    doc["training"].update({"max_steps": steps, "global_batch_size": 8, "seq_len": 64})
    doc["checkpoint"]["interval_steps"] = interval
    if workers != 2:
        doc["resources"].update({"min_gpus": workers, "gpus_per_node": 2})
        doc["parallelism"].update({"dp": workers, "micro_batch_size": 8 // workers})
    if segment_max_steps:
        doc["fault_tolerance"]["segment_max_steps"] = segment_max_steps
    with chaos_cluster(workers > 2):
        spec = prepare.validate_spec(doc, "chaos.yaml", EXAMPLES)
        dataset = prepare.resolve_dataset(spec, EXAMPLES)
        plan = prepare.make_plan(spec)
    record = JobStore().create(job_id, name=spec.name, team=spec.team, spec=doc, source="chaos.yaml")
    record.update(plan=plan, dataset=dataset)
    config = prepare.worker_config(spec, job_id, record.folder, EXAMPLES, dataset, plan, "chaos")
    path = record.folder / "worker-config.json"
    path.write_text(config.to_json())
    return ChaosJob(record, path, config, spec=spec, workers=workers)


def placement(job: ChaosJob) -> list[str]:
    """The gang's nodes in rank order (the live scheduler's request is idempotent for an admitted job)."""
    from trainforge.infra.scheduler.live import GangRequest
    from trainforge.tasks.provision import live_scheduler

    spec, layout = job.spec, job.record.data["plan"]["layout"]
    request = GangRequest(job_id=job.record.job_id, team=spec.team, priority=spec.priority.value,
                          gpu_type=spec.resources.gpu_type.value, num_gpus=spec.resources.world_size,
                          gpus_per_node=min(spec.resources.gpus_per_node, spec.resources.world_size),
                          tp=layout["tp"], pp=layout["pp"], dp=layout["dp"], max_runtime_s=spec.max_runtime_s)
    return [name for name, _ in live_scheduler().request(request, timeout_s=30).nodes]


def unhealthy_nodes() -> set[str]:
    import sqlalchemy as sa

    from trainforge.infra.scheduler.live import NODES
    from trainforge.tasks.provision import live_scheduler

    with live_scheduler().engine.connect() as conn:
        return {r.name for r in conn.execute(sa.select(NODES)) if not r.healthy}


def run_job(job: ChaosJob, *, fault: str = "", max_retries: int = 2, max_restarts: int = 0,
            health: dict[str, Any] | None = None, max_segments: int = 8) -> ChaosJob:
    """Segments until the job finishes, retrying infra / divergence failures like the flow (raises the last
    SegmentFailed when the budget is spent). A multi-node job (4 workers) goes through the live scheduler like the
    train-job flow: provisioned, re-provisioned after a failed segment (`reprovision`: a node lost whole is marked
    failed first) and released + re-requested after a preemption."""
    env = {"TRAINFORGE_FAULT": fault, "TRAINFORGE_HEALTH": json.dumps({**FAST_HEALTH, **(health or {})}),
           "OMP_NUM_THREADS": "1"}
    retries = max_retries
    multi = job.workers > 2
    t0 = time.monotonic()
    with chaos_cluster(multi):
        try:
            nodes = _provision(job) if multi else []
            for _ in range(max_segments):
                fresh = JobStore(job.record.folder.parent).get(job.record.job_id)
                try:
                    result = run_segment(fresh, job.config_path, job.config, nproc=job.workers,
                                         max_restarts=max_restarts, extra_env=env, nnodes=max(1, len(nodes)),
                                         node_names=nodes or None)
                except SegmentFailed as exc:
                    job.failures.append(exc)
                    if exc.kind == "user" or retries == 0:
                        raise
                    retries -= 1
                    if multi:
                        nodes = _provision(job, reprovision=True)
                    continue
                job.segments.append(result)
                if result.last_step is not None and result.last_step >= job.config.total_steps:
                    return job
                if multi and result.reason == "preempted":
                    nodes = _provision(job, release=True)
            raise AssertionError(f"job did not finish in {max_segments} segments")
        finally:
            job.wall_s = time.monotonic() - t0
            if multi:
                from trainforge.tasks.provision import release_gang

                release_gang(job.record.job_id)
            job.record.reload()


def _provision(job: ChaosJob, *, reprovision: bool = False, release: bool = False) -> list[str]:
    from trainforge.tasks.provision import provision_gang, release_gang

    t0 = time.monotonic()
    if reprovision:
        from trainforge.tasks.steps import reprovision as flow_reprovision

        flow_reprovision(JobStore(job.record.folder.parent).get(job.record.job_id), job.spec)
    else:
        if release:
            release_gang(job.record.job_id)
        provision_gang(job.record.job_id, job.spec, job.record.data["plan"]["layout"])
    if job.placements:
        job.regang_s.append(round(time.monotonic() - t0, 3))
    job.placements.append(placement(job))
    return job.placements[-1]


def events(job: ChaosJob, kind: str | None = None) -> list[dict[str, Any]]:
    evs, _ = read_events(job.record.events_path)
    return [e for e in evs if kind is None or e.get("type") == kind]


def measure(job: ChaosJob, scenario: str, fault_kind: str | None = None, detected_kind: str | None = None
            ) -> dict[str, Any]:
    """Detection latency (fault fired -> detected), MTTR (detected -> first step after the restore) and lost
    steps, from the records; printed as one line for the design doc."""
    detected = [e for e in events(job, "fault_detected") if detected_kind in (None, e["fault"])]
    recovered = [e for e in events(job, "recovered") if detected_kind in (None, e["fault"])]
    fired = fired_at(job.record.folder)
    fired_t = min((t for name, t in fired.items() if fault_kind is None or name.startswith(fault_kind)),
                  default=None)
    first = detected[0] if detected else None
    out = {
        "scenario": scenario,
        "detected": first["fault"] if first else None,
        "detection_s": round(first["detected_at"] - fired_t, 2) if first and fired_t else None,
        "mttr_s": recovered[0]["mttr_s"] if recovered else None,
        "lost_steps": recovered[0]["lost_steps"] if recovered else None,
        "tier": recovered[0]["tier"] if recovered else None,
        "segments": len(job.record.data.get("segments", [])),
        "wall_s": round(job.wall_s, 1),
    }
    print(f"CHAOS {scenario}: detected={out['detected']} detection={out['detection_s']}s mttr={out['mttr_s']}s "
          f"lost_steps={out['lost_steps']} tier={out['tier']} segments={out['segments']} wall={out['wall_s']}s")
    return out
