"""Drive a small real job through `run_segment` (real torchrun, 2 gloo workers, real checkpoints) with faults
injected, retrying segments like the train-job flow does, and measure detection latency, MTTR and lost work from
the run's own records (events.jsonl, fault markers). Shared by tests/chaos/ and bench/chaos_mttr.py.
"""

from __future__ import annotations

import json
import time
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


def make_job(job_id: str, *, steps: int = 24, interval: int = 8, segment_max_steps: int | None = None) -> ChaosJob:
    ensure_demo_dataset()
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    doc["training"].update({"max_steps": steps, "global_batch_size": 8, "seq_len": 64})
    doc["checkpoint"]["interval_steps"] = interval
    if segment_max_steps:
        doc["fault_tolerance"]["segment_max_steps"] = segment_max_steps
    spec = prepare.validate_spec(doc, "chaos.yaml", EXAMPLES)
    dataset = prepare.resolve_dataset(spec, EXAMPLES)
    plan = prepare.make_plan(spec)
    record = JobStore().create(job_id, name=spec.name, team=spec.team, spec=doc, source="chaos.yaml")
    record.update(plan=plan, dataset=dataset)
    config = prepare.worker_config(spec, job_id, record.folder, EXAMPLES, dataset, plan, "chaos")
    path = record.folder / "worker-config.json"
    path.write_text(config.to_json())
    return ChaosJob(record, path, config)


def run_job(job: ChaosJob, *, fault: str = "", max_retries: int = 2, max_restarts: int = 0,
            health: dict[str, Any] | None = None, max_segments: int = 8) -> ChaosJob:
    """Segments until the job finishes, retrying infra / divergence failures like the flow (raises the last
    SegmentFailed when the budget is spent)."""
    env = {"TRAINFORGE_FAULT": fault, "TRAINFORGE_HEALTH": json.dumps({**FAST_HEALTH, **(health or {})})}
    retries = max_retries
    t0 = time.monotonic()
    try:
        for _ in range(max_segments):
            fresh = JobStore(job.record.folder.parent).get(job.record.job_id)
            try:
                result = run_segment(fresh, job.config_path, job.config, nproc=2, max_restarts=max_restarts,
                                     extra_env=env)
            except SegmentFailed as exc:
                job.failures.append(exc)
                if exc.kind == "user" or retries == 0:
                    raise
                retries -= 1
                continue
            job.segments.append(result)
            if result.last_step is not None and result.last_step >= job.config.total_steps:
                return job
        raise AssertionError(f"job did not finish in {max_segments} segments")
    finally:
        job.wall_s = time.monotonic() - t0
        job.record.reload()


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
