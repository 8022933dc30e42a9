"""The event sequence of a chaos drill, second by second, for docs/walkthroughs.md.

Runs the chaos suite's jobs (tests/chaos: the tiny model on gloo workers, the same faults and the same drill
machinery as `trainforge chaos`, trainforge/tasks/chaos.py) and prints every control-plane event of the job
(events.jsonl: segment starts and ends, checkpoints, detections, recoveries, resizes) plus the scheduler's
re-provisioning, with its time relative to the moment the fault fired (the fault's own marker file). Metrics are
summarised as the first step after each segment start.

    OMP_NUM_THREADS=1 .venv/bin/python bench/walkthrough_timeline.py node wave hang kill corrupt

Scenarios: `kill` (kill -9 of rank 1, in-segment restart), `node` (a whole "node" of 2 ranks of a 4-worker,
2-node gang lost), `hang` (rank 1 stops progressing: the rack-partition analogue), `wave` (SIGTERM to all 4 ranks),
`corrupt` (the newest committed checkpoint corrupted after training, then a resume). Timings are on whatever cores
the machine has; on 2 shared cores start-up (torch import, rendezvous) dominates every recovery.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SKIP = {"metrics", "checkpoint_staged", "heartbeat", "log", "rank_metrics", "metrics_meta", "system"}


def _fmt(e: dict) -> str:
    keep = {k: v for k, v in e.items() if k not in ("type", "time", "detected_at", "job_id") and v not in (None, [], {})}
    text = ", ".join(f"{k}={v}" for k, v in keep.items())
    return text[:220]


def timeline(job, fault_kind: str | None) -> None:
    from trainforge.tasks.chaos import events
    from trainforge.trainer.faults import fired_at

    evs = events(job)
    fired = fired_at(job.record.folder)
    t0 = min((t for n, t in fired.items() if fault_kind and n.startswith(fault_kind)), default=None)
    if t0 is None:  # corrupt: the damage is done between runs, so time from the resume's launch
        t0 = job.record.data["segments"][-1]["started_at"]
        print("  (t = 0 when the resume's segment was launched)")
    # The job record's view: segment boundaries (the supervisor's verdict) and the incidents' scope and host.
    rows = []
    for seg in job.record.data.get("segments", []):
        rows.append((seg["started_at"], f"segment {seg.get('attempt')} launched (record)"))
        if seg.get("ended_at"):
            rows.append((seg["ended_at"], f"segment {seg.get('attempt')} ended: {seg.get('state')} (record)"))
    for inc in job.record.data.get("incidents", []):
        if inc.get("detected_at"):
            rows.append((inc["detected_at"], f"incident {inc.get('kind')} rank {inc.get('rank')} scope "
                                             f"{inc.get('scope')} host {inc.get('host')} (record)"))
    for r in job.record.data.get("resizes", []):
        rows.append((r["time"], f"allocation resized {r['from_workers']} -> {r['to_workers']} workers (record)"))
    rows += [(e["time"], e) for e in evs]
    rows.sort(key=lambda r: r[0])
    first_metric_after_start = True
    for t, e in rows:
        if isinstance(e, str):
            print(f"  {t - t0:+8.2f} s  {e}")
            continue
        kind = e.get("type")
        if kind == "segment_start":
            first_metric_after_start = False
        if kind == "metrics":
            if not first_metric_after_start:
                first_metric_after_start = True
                print(f"  {e['time'] - t0:+8.2f} s  first step of the segment: step={e.get('step')}")
            continue
        if kind in SKIP:
            continue
        print(f"  {e['time'] - t0:+8.2f} s  {kind}: {_fmt(e)}")
    if job.regang_s:
        print(f"  scheduler release + request per re-provisioning: {job.regang_s} s; placements {job.placements}")
    segs = [(s.get("state"), s.get("resumed_from")) for s in job.record.data.get("segments", [])]
    print(f"  segments (state, resumed_from): {segs}; wall {job.wall_s:.1f} s")


def run(name: str) -> None:
    from tests.chaos.harness import make_job, measure, run_job
    from trainforge.tasks.chaos import corrupt_after_emergency_checkpoint

    print(f"== {name}")
    if name == "kill":
        job = run_job(make_job("tl-kill", steps=24, interval=8), fault="kill:rank=1:step=10", max_restarts=1)
        measure(job, "kill -9 rank 1", "kill", "rank_lost")
        timeline(job, "kill")
    elif name == "node":
        job = run_job(make_job("tl-node", steps=20, interval=4, workers=4), fault="node:rank=2:step=14",
                      max_retries=1)
        measure(job, "node lost", "node", "rank_lost")
        timeline(job, "node")
    elif name == "hang":
        job = run_job(make_job("tl-hang", steps=24, interval=8), fault="hang:rank=1:step=6")
        measure(job, "hang rank 1", "hang", "hang")
        timeline(job, "hang")
    elif name == "wave":
        wave = ",".join(f"sigterm:rank={r}:step=12" for r in range(4))
        job = run_job(make_job("tl-wave", steps=20, interval=8, workers=4), fault=wave)
        measure(job, "spot wave", "sigterm", "preemption")
        timeline(job, "sigterm")
    elif name == "corrupt":
        job = make_job("tl-corrupt")
        corrupt_after_emergency_checkpoint(job)
        job = run_job(job)
        timeline(job, None)
    else:
        raise SystemExit(f"unknown scenario {name!r}: kill, node, hang, wave, corrupt")


if __name__ == "__main__":
    names = sys.argv[1:] or ["node", "wave", "hang", "kill"]
    with tempfile.TemporaryDirectory(prefix="tf-timeline-") as home:
        os.environ["TRAINFORGE_HOME"] = home
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        print(f"load average at start: {os.getloadavg()[0]:.1f}; {time.strftime('%H:%M:%S UTC', time.gmtime())}")
        for n in names:
            run(n)
        print(f"load average at end: {os.getloadavg()[0]:.1f}")
