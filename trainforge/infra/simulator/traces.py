"""Trace loading for replay: the shared traces' uniform CSV schema, Alibaba's node list, and a generator for the
large-job tail the public traces lack.

Uniform schema: job_id, submit_time_s, submit_time_iso, duration_s, num_gpus, gpu_milli, user, team, gpu_type,
status, source_trace; optional columns priority, checkpoint_interval_s, tp, pp, min_gpus are used when present.
What the public traces do not record is filled in deterministically (a hash of the job id) and reported:
priority (5% high, 75% normal, 10% low, 10% preemptible), a 30-minute checkpoint interval, GPU type `any`
(the job still gets one type). Runtime estimates are the simulator's (`SimConfig.estimates`): learned from history
by default; the oracle (1.5x the real duration) only when asked for, for comparison.
"""

from __future__ import annotations

import csv
import hashlib
import math
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from trainforge.infra.scheduler.state import NodeInfo

DEFAULT_CHECKPOINT_S = 1800.0
ESTIMATE_FACTOR = 1.5


@dataclass(slots=True, kw_only=True)
class TraceJob:
    job_id: str
    submit_s: float
    team: str
    priority: str
    gpu_type: str
    num_gpus: int
    duration_s: float
    checkpoint_interval_s: float = DEFAULT_CHECKPOINT_S
    tp: int = 1
    pp: int = 1
    min_gpus: int | None = None
    generated: bool = False
    estimate_s: float | None = None
    """A fixed runtime estimate for this job (tests); None = SimConfig.estimates decides."""
    user: str = ""
    max_runtime_s: float | None = None
    """What the user gave as `max_runtime` (a limit); the public traces do not record one."""


@dataclass(slots=True)
class Trace:
    jobs: list[TraceJob]
    source: str
    notes: list[str] = field(default_factory=list)


def _unit(job_id: str) -> float:
    return int.from_bytes(hashlib.blake2b(job_id.encode(), digest_size=8).digest(), "big") / 2**64


def _priority_for(job_id: str) -> str:
    u = _unit(job_id)
    return "high" if u < 0.05 else "normal" if u < 0.80 else "low" if u < 0.90 else "preemptible"


def load_trace(path: str | Path, *, max_jobs: int | None = None) -> Trace:
    path = Path(path)
    jobs: list[TraceJob] = []
    skipped: Counter[str] = Counter()
    filled: Counter[str] = Counter()
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            try:
                gpus = int(float(row.get("num_gpus") or 0))
                duration = float(row.get("duration_s") or "nan")
                submit = float(row["submit_time_s"])
            except (KeyError, ValueError):
                skipped["unreadable"] += 1
                continue
            if gpus <= 0:
                skipped["cpu-only"] += 1
                continue
            if not math.isfinite(duration) or duration <= 0:
                skipped["never ran (no duration)"] += 1
                continue
            job_id = row.get("job_id") or f"row-{len(jobs)}"
            priority = row.get("priority") or ""
            if not priority:
                filled["priority"] += 1
                priority = _priority_for(job_id)
            gpu_type = (row.get("gpu_type") or "").strip()
            if not gpu_type:
                filled["gpu_type"] += 1
                gpu_type = "any"
            ckpt = row.get("checkpoint_interval_s")
            jobs.append(TraceJob(
                job_id=job_id, submit_s=submit, team=row.get("team") or row.get("user") or "default",
                priority=priority, gpu_type=gpu_type.lower() if gpu_type == "any" else gpu_type, num_gpus=gpus,
                duration_s=duration, checkpoint_interval_s=float(ckpt) if ckpt else DEFAULT_CHECKPOINT_S,
                tp=int(row.get("tp") or 1), pp=int(row.get("pp") or 1), user=row.get("user") or "",
                max_runtime_s=float(row["max_runtime_s"]) if row.get("max_runtime_s") else None,
                min_gpus=int(row["min_gpus"]) if row.get("min_gpus") else None))
            if max_jobs is not None and len(jobs) >= max_jobs:
                break
    jobs.sort(key=lambda j: j.submit_s)
    notes = [f"{len(jobs)} GPU jobs from {path.name}"]
    if skipped:
        notes.append("skipped: " + ", ".join(f"{n} {k}" for k, n in skipped.items()))
    if filled:
        notes.append("not in the trace, filled by job-id hash: " + ", ".join(
            f"{k} ({n} jobs{'; 5% high, 75% normal, 10% low, 10% preemptible' if k == 'priority' else ''}"
            f"{'; any type, one per job' if k == 'gpu_type' else ''})" for k, n in filled.items()))
    notes.append(f"checkpoint every {DEFAULT_CHECKPOINT_S:.0f}s unless the trace says")
    return Trace(jobs, path.name, notes)


def load_node_list(path: str | Path, nodes_per_rack: int = 32) -> list[NodeInfo]:
    """Alibaba's `openb_node_list_gpu_node.csv` (sn, cpu_milli, memory_mib, gpu, model) as nodes; racks hold
    `nodes_per_rack` nodes of one model, in file order."""
    out: list[NodeInfo] = []
    per_model: Counter[str] = Counter()
    with Path(path).open(newline="") as f:
        for row in csv.DictReader(f):
            gpus = int(row["gpu"])
            if gpus <= 0:
                continue
            model = row["model"]
            rack = f"{model}-r{per_model[model] // nodes_per_rack}"
            per_model[model] += 1
            out.append(NodeInfo(row["sn"], model, gpus, rack))
    return out


def generate_tail(*, num_jobs: int, span_s: float, gpu_types: list[str], max_gang: int, seed: int = 0,
                  teams: int = 4) -> list[TraceJob]:
    """Large gangs (256..max_gang GPUs, tp=8, pp 1-4) of frontier teams, Poisson arrivals over `span_s`, durations
    log-normal around 8 h (1 h .. 3 days), mostly high priority, 10% elastic (min = half)."""
    rng = random.Random(seed)
    sizes = [s for s in (256, 512, 1024, 2048, 4096, 8192) if s <= max_gang] or [max_gang]
    weights = [1 / (i + 1) for i in range(len(sizes))]
    out = []
    t = 0.0
    for i in range(num_jobs):
        t += rng.expovariate(num_jobs / span_s)
        n = rng.choices(sizes, weights)[0]
        pp = rng.choice([1, 2, 4])
        elastic = rng.random() < 0.1
        out.append(TraceJob(
            job_id=f"tail-{i}", submit_s=t % span_s, team=f"frontier-{i % teams}",
            priority=rng.choices(["critical", "high", "normal"], [0.1, 0.6, 0.3])[0],
            gpu_type=rng.choice(gpu_types), num_gpus=n,
            duration_s=min(3 * 86400, max(3600, rng.lognormvariate(math.log(8 * 3600), 0.8))),
            checkpoint_interval_s=1800.0, tp=8, pp=pp, min_gpus=n // 2 if elastic else None, generated=True))
    return out


def mix(trace: Trace, tail: list[TraceJob]) -> Trace:
    if not tail:
        return trace
    jobs = sorted(trace.jobs + tail, key=lambda j: j.submit_s)
    gpu_h = sum(j.num_gpus * j.duration_s for j in tail) / 3600
    total = sum(j.num_gpus * j.duration_s for j in jobs) / 3600
    sizes = Counter(j.num_gpus for j in tail)
    note = (f"GENERATED large-job tail mixed in: {len(tail)} jobs ({gpu_h:,.0f} GPU-h, {100 * gpu_h / total:.0f}% of "
            f"all GPU-hours), sizes " + ", ".join(f"{n}x{s}" for s, n in sorted(sizes.items())))
    return Trace(jobs, trace.source + " + generated tail", trace.notes + [note])
