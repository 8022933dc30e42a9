"""Chaos drills: drive a real job through `run_segment` (real torchrun, gloo workers, real checkpoints) with faults
injected, its segments retried by the train-job flow's own driver and SegmentController (tasks/driver.py: one
retry policy, so the drills test production's), and measure detection latency, MTTR and lost work from the run's
own records (events.jsonl, fault markers). Used by `trainforge chaos`, tests/chaos/ and bench/chaos_mttr.py.

A job whose gang spans more than one node of its cluster is laid out as one torchrun agent per node on this host
(one shared rendezvous: how a multi-node job meets) and goes through the live scheduler like the flow: provisioned,
re-provisioned after a failed segment (a node lost whole is marked failed first; an elastic job that cannot get
its full size back continues smaller), released and re-requested after a preemption, re-provisioned at the new size
after a scheduler resize.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trainforge.contract.events import CheckpointSkipped, FaultDetected, Recovered, SegmentEnd
from trainforge.events import E, read_events, read_typed_events
from trainforge.registry.jobs import JobRecord, JobStore
from trainforge.tasks import prepare
from trainforge.tasks.driver import NoGang, SegmentDriver
from trainforge.tasks.segment import SegmentFailed, run_segment
from trainforge.trainer.faults import fired_at

_LOG = logging.getLogger("trainforge.chaos")

# Short detection windows so a drill takes seconds (the defaults are production's: trainer/health.py). The hang
# window is production's derivation, max(hang_floor_s 15 s, 10 x the median step), not a short fixed one: the
# first step of a (re)start includes the data loader's start-up and the first collectives' set-up, and on the
# shared 2-core host it measured 3.8 s (2.75 s of it waiting for the first batch) at load 10; seen ~1 s late
# through the beat -> sidecar -> channel -> reader path, that stalled a fixed 4 s window and a healthy gang was
# killed as hung (tests/chaos/test_scenarios.py, whichever scenario met the slow first step).
FAST_HEALTH = {"heartbeat_interval_s": 0.25, "heartbeat_timeout_s": 3.0, "straggler_patience": 4}


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
    scheduled: bool = False
    """Placed by the live scheduler (a gang of more than one node, or an elastic job)."""
    cluster: dict[str, Any] | None = None
    """The cluster the job is planned and scheduled on ($TRAINFORGE_CLUSTER while it runs); None = the default."""


# Multi-node chaos jobs are placed by the live scheduler on this cluster: 3 "nodes" of 2 CPU worker slots, all on
# this host (one torchrun agent per node); a job of 4 workers takes 2 of them and a lost one can be replaced.
CHAOS_CLUSTER = {"name": "chaos-nodes", "node_mtbf_hours": 10000, "node_groups": [
    {"name": "chaos", "gpu_type": "cpu", "nodes": 3, "gpus_per_node": 2, "nodes_per_rack": 3,
     "memory_per_node_gb": 16, "intra_node_link": "loopback", "inter_node_link": "loopback"}]}


@contextlib.contextmanager
def chaos_cluster(cluster: dict[str, Any] | None = CHAOS_CLUSTER) -> Iterator[None]:
    """$TRAINFORGE_CLUSTER -> `cluster` while planning / scheduling a multi-node job (restored after)."""
    if not cluster:
        yield
        return
    from trainforge.home import home

    path = home() / f"{cluster['name']}-cluster.yaml"
    path.write_text(yaml.safe_dump(cluster))
    before = os.environ.get("TRAINFORGE_CLUSTER")
    os.environ["TRAINFORGE_CLUSTER"] = str(path)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TRAINFORGE_CLUSTER", None)
        else:
            os.environ["TRAINFORGE_CLUSTER"] = before


def prepare_job(doc: dict[str, Any], source: str, base_dir: Path, job_id: str,
                cluster: dict[str, Any] | None = None) -> ChaosJob:
    """Validate, resolve the dataset, plan and write the worker config of `doc`, as the flow does before training
    (a bad spec raises `prepare.JobRejected` with the precise problems)."""
    with chaos_cluster(cluster):
        spec = prepare.validate_spec(doc, source, base_dir)
        dataset = prepare.resolve_dataset(spec, base_dir)
        plan = prepare.make_plan(spec)
        prepare.check_dataset_fits(spec, dataset, plan)
    record = JobStore().create(job_id, name=spec.name, team=spec.team, spec=doc, source=source)
    record.update(plan=plan, dataset=dataset)
    config = prepare.worker_config(spec, job_id, record.folder, base_dir, dataset, plan, "chaos")
    path = config.write(record.folder / "worker-config.json")
    res = spec.resources
    top = res.max_gpus or res.min_gpus
    return ChaosJob(record, path, config, spec=spec, workers=top, cluster=cluster,
                    scheduled=cluster is not None and (top > min(res.gpus_per_node, top) or res.elastic))


def unhealthy_nodes() -> set[str]:
    import sqlalchemy as sa

    from trainforge.infra.scheduler.live import NODES
    from trainforge.tasks.provision import live_scheduler

    with live_scheduler().engine.connect() as conn:
        return {r.name for r in conn.execute(sa.select(NODES)) if not r.healthy}


def run_job(job: ChaosJob, *, fault: str = "", max_retries: int = 2, max_restarts: int = 0,
            health: dict[str, Any] | None = None, max_segments: int = 8, fast: bool = True) -> ChaosJob:
    """Segments until the job finishes, through the flow's own driver and SegmentController (tasks/driver.py):
    the same retry / re-provision / give-up policy as production (raises the last SegmentFailed when the budget is
    spent, TooManySegments past `max_segments`). `fast`: the short detection windows of FAST_HEALTH (tests,
    bench); otherwise the policy's defaults, plus `health`."""
    policy = {**(FAST_HEALTH if fast else {}), **(health or {})}
    env = {"TRAINFORGE_FAULT": fault, "TRAINFORGE_HEALTH": json.dumps(policy), "OMP_NUM_THREADS": "1"}

    def run(driver: SegmentDriver) -> Any:
        alloc = driver.before_attempt()
        fresh = JobStore(job.record.folder.parent).get(job.record.job_id)
        if alloc is None:
            return run_segment(fresh, job.config_path, job.config, nproc=job.workers, max_restarts=max_restarts,
                               extra_env=env)
        nodes = alloc["nodes"]
        return run_segment(fresh, job.config_path, job.config, nproc=alloc["workers"], max_restarts=max_restarts,
                           extra_env=env, nnodes=max(1, len(nodes)), node_names=nodes or None,
                           layout=alloc["layout"], sizes=alloc["sizes"], scheduler_status=_status(job))

    t0 = time.monotonic()
    with chaos_cluster(job.cluster if job.scheduled else None):
        driver = SegmentDriver(job.record, total_steps=job.config.total_steps, max_retries=max_retries, run=run,
                               gang=_ChaosGang(job) if job.scheduled else NoGang(), log=_LOG, env=env,
                               max_segments=max_segments)
        try:
            driver.drive()
            return job
        finally:
            job.segments.extend(driver.results)
            job.failures.extend(f for f in driver.failures if isinstance(f, SegmentFailed))
            job.wall_s = time.monotonic() - t0
            if job.scheduled:
                from trainforge.tasks.provision import release_gang

                release_gang(job.record.job_id)
            job.record.reload()


class _ChaosGang:
    """The flow's provisioning through the live scheduler (tasks/provision.py, tasks/steps.py `reprovision`),
    each re-gang timed for the drill's measurements."""

    def __init__(self, job: ChaosJob):
        self.job = job
        self._released_at: float | None = None

    def provision(self, reason: str) -> dict[str, Any]:
        t0, self._released_at = self._released_at, None  # a release + re-request is timed from the release
        return _provision(self.job, reason, t0=t0)

    def release(self, outcome: str = "ended") -> None:
        from trainforge.tasks.provision import release_gang

        self._released_at = time.monotonic()
        release_gang(self.job.record.job_id, outcome)

    def reprovision(self, lost: tuple[str, ...]) -> dict[str, Any]:
        return _provision(self.job, "", lost=lost)


def _status(job: ChaosJob) -> Any:
    from trainforge.tasks.provision import live_scheduler

    return lambda: live_scheduler().status(job.record.job_id)


def _provision(job: ChaosJob, reason: str, *, lost: tuple[str, ...] | None = None,
               t0: float | None = None) -> dict[str, Any]:
    """The train-job flow's provisioning (tasks/provision.py; tasks/steps.py `reprovision` without the `lost`
    nodes after a failed segment), timed from `t0` (a release) or now."""
    from trainforge.tasks.provision import provision_gang, record_allocation

    t0 = time.monotonic() if t0 is None else t0
    record = JobStore(job.record.folder.parent).get(job.record.job_id)
    if lost is not None:
        from trainforge.tasks.steps import reprovision as flow_reprovision

        alloc = flow_reprovision(record, job.spec, lost)
    else:
        alloc = provision_gang(job.record.job_id, job.spec, record.data["plan"]["layout"])
        record_allocation(record, alloc, reason, job.spec)
    if job.placements:
        job.regang_s.append(round(time.monotonic() - t0, 3))
    job.placements.append(list(alloc["nodes"]))
    return alloc


def events(job: ChaosJob, kind: str | None = None) -> list[dict[str, Any]]:
    evs, _ = read_events(job.record.events_path)
    return [e for e in evs if kind is None or e.get("type") == kind]


def typed_events(job: ChaosJob, cls: type[E]) -> list[E]:
    """The job's events of one class, typed (`events` gives the raw objects, for the tests' field checks)."""
    evs, _, _ = read_typed_events(job.record.events_path, only=(cls,))
    return [e for e in evs if isinstance(e, cls)]


def measure(job: ChaosJob, scenario: str, fault_kind: str | None = None, detected_kind: str | None = None,
            quiet: bool = False) -> dict[str, Any]:
    """Detection latency (fault fired -> detected), MTTR (detected -> first step after the restore) and lost
    steps, from the records; printed as one `CHAOS` line for the design doc unless `quiet`."""
    detected = [e for e in typed_events(job, FaultDetected) if detected_kind in (None, e.fault)]
    recovered = [e for e in typed_events(job, Recovered) if detected_kind in (None, e.fault)]
    fired = fired_at(job.record.folder)
    fired_t = min((t for name, t in fired.items() if fault_kind is None or name.startswith(fault_kind)),
                  default=None)
    first = detected[0] if detected else None
    out = {
        "scenario": scenario,
        "detected": first.fault if first else None,
        "detection_s": round(first.detected_at - fired_t, 2) if first and fired_t else None,
        "mttr_s": recovered[0].mttr_s if recovered else None,
        "lost_steps": recovered[0].lost_steps if recovered else None,
        "tier": recovered[0].tier if recovered else None,
        "segments": len(job.record.data.get("segments", [])),
        "wall_s": round(job.wall_s, 1),
        "resizes": job.record.data.get("resizes", []),
    }
    if not quiet:
        print(f"CHAOS {scenario}: detected={out['detected']} detection={out['detection_s']}s mttr={out['mttr_s']}s "
              f"lost_steps={out['lost_steps']} tier={out['tier']} segments={out['segments']} wall={out['wall_s']}s")
    return out


# ---------------------------------------------------------------------------------------- named scenarios


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    fault: str
    """$TRAINFORGE_FAULT for the workers (trainer/faults.py)."""
    marker: str
    """The fault kind whose marker time starts the detection clock."""
    detected: str
    """The supervisor's incident kind that detects it."""
    max_restarts: int = 0
    health: dict[str, Any] = field(default_factory=dict)


SCENARIOS = {
    "kill": "kill -9 of one rank (process loss): in-segment restart by torchrun",
    "stop": "SIGSTOP of one rank (frozen host): heartbeat timeout, SIGKILL, restart",
    "hang": "one rank stops making progress: watchdog, every rank's stack dumped, segment retry",
    "nan": "NaN in one rank's weights (divergence): rollback to the last checkpoint, batch skipped",
    "sigterm": "termination notice to one rank (spot): emergency checkpoint, resume",
    "straggler": "one rank sleeps 300 ms per step: reported with evidence",
    "storeout": "object store down during a checkpoint upload: that checkpoint never commits",
    "node": "a whole node lost (its agent and workers SIGKILLed): re-provisioned through the scheduler",
    "wave": "spot wave: termination notice to a quarter of the ranks at once",
}


class ScenarioError(ValueError):
    """A scenario name that does not exist, or one the job's shape cannot run (the message says how to fix it)."""


def corrupt_after_emergency_checkpoint(job: ChaosJob, notice_step: int = 13) -> tuple[int, int]:
    """A first segment ends at an emergency checkpoint (a termination notice at `notice_step`), then one chunk
    only that checkpoint references gets "bit rot" and the node-local copy is deleted (a fresh node), so the next
    resume must read the store, find the damage and fall back. Returns (previous step, damaged step)."""
    import shutil

    from trainforge.home import home
    from trainforge.registry.dedup import chunk_key

    run_segment(job.record, job.config_path, job.config, nproc=2, max_restarts=0,
                extra_env={"TRAINFORGE_FAULT": f"sigterm:rank=1:step={notice_step}"})
    store = home() / "store"
    steps = sorted({int(p.parent.name.removeprefix("step-")) for p in store.rglob("manifest*")})
    previous, damaged = steps[-2], steps[-1]
    manifests = {s: json.loads(next(store.rglob(f"step-{s:010d}/manifest*")).read_text()) for s in (previous, damaged)}
    old = {sha for f in manifests[previous]["files"] for sha, _ in f.get("chunks", ())}
    entry = next(f for f in manifests[damaged]["files"] if any(sha not in old for sha, _ in f.get("chunks", ())))
    sha = next(sha for sha, _ in entry["chunks"] if sha not in old)
    path = store / chunk_key(job.config.storage_prefix, sha, entry.get("codec"))
    path.write_bytes(b"bit rot" + path.read_bytes()[7:])
    shutil.rmtree(job.config.staging_dir)  # a fresh node: no verified local copy to fall back on
    return previous, damaged


def fault_step(total: int, interval: int) -> int:
    """A 0-based step after the first checkpoint and before the last step, so recovery has something to resume
    from and something left to train."""
    step = interval + max(1, interval // 2)
    return step if step < total - 1 else max(1, total // 2)


def scenario(name: str, job: ChaosJob, step: int | None = None) -> Scenario:
    if name not in SCENARIOS:
        raise ScenarioError(f"unknown scenario {name!r}; choose one of: {', '.join(SCENARIOS)}")
    spec, total, interval = job.spec, job.config.total_steps, job.config.checkpoint_interval
    world = job.workers
    per_node = min(spec.resources.gpus_per_node, world)
    k = fault_step(total, interval) if step is None else step
    if not 0 <= k < total:
        raise ScenarioError(f"--step {k} is outside the job's {total} steps (0-based): use 0..{total - 1}")
    victim = 1 if world > 1 else 0
    needs_peers = ("kill", "stop", "hang", "straggler")
    if name in needs_peers and world < 2:
        raise ScenarioError(f"scenario {name!r} needs at least 2 workers (the spec has {world}): "
                            "set resources.min_gpus >= 2")
    if name in ("node", "wave") and world // per_node < 2:
        raise ScenarioError(f"scenario {name!r} needs a gang of at least 2 nodes (the spec has {world} workers, "
                            f"{per_node} per node): raise resources.min_gpus / max_gpus above gpus_per_node")
    desc = SCENARIOS[name]
    if name == "kill":
        return Scenario(name, desc, f"kill:rank={victim}:step={k}", "kill", "rank_lost", max_restarts=1)
    if name == "stop":
        return Scenario(name, desc, f"stop:rank={victim}:step={k}", "stop", "rank_lost", max_restarts=1)
    if name == "hang":
        return Scenario(name, desc, f"hang:rank={victim}:step={k}", "hang", "hang")
    if name == "nan":
        return Scenario(name, desc, f"nan:rank=0:step={k}", "nan", "divergence")
    if name == "sigterm":
        return Scenario(name, desc, f"sigterm:rank={victim}:step={k}", "sigterm", "preemption")
    if name == "straggler":
        return Scenario(name, desc, f"slow:rank={victim}:step={max(1, k // 2)}:ms=300", "slow", "straggler")
    if name == "storeout":  # every rank's store: the outage covers the next upload, ends `interval` steps later
        until = min(total - 1, k + interval)
        return Scenario(name, desc, ",".join(f"storeout:rank={r}:step={k}:until={until}" for r in range(world)),
                        "storeout", "checkpoint_skipped")
    if name == "node":
        return Scenario(name, desc, f"node:rank={world - per_node}:step={k}", "node", "rank_lost")
    wave = max(1, world // 4)
    return Scenario(name, desc, ",".join(f"sigterm:rank={r}:step={k}" for r in range(world - wave, world)),
                    "sigterm", "preemption")


def emulation_cluster(spec: Any) -> dict[str, Any] | None:
    """A gang of more than one node (or an elastic one) runs as one torchrun agent per node on this host, placed
    by the live scheduler on a cluster of its node shape with one spare node (so a lost node can be replaced)."""
    res = spec.resources
    top = res.max_gpus or res.min_gpus
    per_node = min(res.gpus_per_node, top)
    if top <= per_node and not res.elastic:
        return None
    nodes = -(-top // per_node) + 1
    return {"name": "chaos-emulation", "node_mtbf_hours": 10000, "node_groups": [
        {"name": "chaos", "gpu_type": res.gpu_type.value, "nodes": nodes, "gpus_per_node": per_node,
         "nodes_per_rack": nodes, "memory_per_node_gb": 16, "intra_node_link": "loopback",
         "inter_node_link": "loopback"}]}


def drill(doc: dict[str, Any], source: str, base_dir: Path, name: str, *, job_id: str,
          step: int | None = None) -> dict[str, Any]:
    """`trainforge chaos`: run the spec's job with scenario `name` and measure it from the records. Returns the
    measurement plus the job's outcome (`completed`, or `failed` with the error)."""
    if name not in SCENARIOS:  # before any work: a typo costs nothing
        raise ScenarioError(f"unknown scenario {name!r}; choose one of: {', '.join(SCENARIOS)}")
    from trainforge.spec import JobSpec

    try:  # the node shape only; the full validation (precise problems, JobRejected) runs in prepare_job
        shape = JobSpec.model_validate(doc)
    except Exception:
        shape = None
    job = prepare_job(doc, source, base_dir, job_id, cluster=emulation_cluster(shape) if shape else None)
    sc = scenario(name, job, step)
    error = None
    try:
        # the policy's own detection windows (a drill measures what production would see), not the tests' short
        # ones: on a loaded machine a 4 s hang window fires on a slow first step
        run_job(job, fault=sc.fault, max_retries=job.spec.fault_tolerance.max_segment_retries,
                max_restarts=max(sc.max_restarts, job.spec.fault_tolerance.max_restarts), health=sc.health,
                fast=False)
    except (SegmentFailed, AssertionError) as exc:
        error = str(exc)
    out = measure(job, f"{name}: {sc.description}", sc.marker, sc.detected, quiet=True)
    if name == "storeout":  # not a detection of the supervisor: the skipped checkpoint is the record
        skipped = typed_events(job, CheckpointSkipped)
        out["detected"] = "checkpoint_skipped" if skipped else None
    ends = typed_events(job, SegmentEnd)
    out.update(job_id=job.record.job_id, fault=sc.fault, state="failed" if error else "completed", error=error,
               final_step=ends[-1].step if ends else None, total_steps=job.config.total_steps,
               workers=job.workers, folder=str(job.record.folder))
    return out
