"""Elastic data-parallel resize on a real job: 4 workers laid out as 2 "nodes" of 2 (min_gpus 2, max_gpus 4) on the
3-node chaos cluster whose third node another job holds, so there is no spare:
- a whole node is lost -> the segment is retried, the live scheduler can only give one node -> the job continues
  on 2 workers (dp 4 -> 2, gradient accumulation 1 -> 2, global batch 8 kept), resuming from the newest committed
  checkpoint (saved by 4 ranks, resharded on load by 2);
- the other job ends -> the scheduler grows the running elastic job into the freed node -> the supervisor ends the
  segment at an emergency checkpoint -> the job continues on 4 workers again.
The loss at every step equals (to float rounding: reduction order differs between dp 4 and dp 2 x 2 micro-batches)
that of a fixed-size run on 2 workers from the start: same samples in the same order, same global batch, same
learning-rate schedule. A resize that changed the batch or the order would move the loss by orders of magnitude
more than the tolerance (measured: see docs/fault-tolerance.md).

Run: OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/chaos/test_elastic.py -s   (about 2-3 minutes on 2 cores)
"""

from __future__ import annotations

import json
import threading

import pytest

from tests.chaos.harness import CHAOS_CLUSTER, chaos_cluster, events, make_job, measure, run_job
from trainforge.home import home
from trainforge.infra.scheduler.live import GangRequest
from trainforge.tasks.provision import live_scheduler, release_gang

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

STEPS, INTERVAL, KILL_STEP = 48, 4, 20
LOSS_TOL = 1e-3  # measured 5e-5; consecutive steps' losses differ by 0.1-0.6 (another batch moves it that much)


def losses(job) -> dict[int, float]:
    """The loss of each step as finally trained (a step retrained after a rollback: its last value)."""
    return {int(e["step"]): float(e["loss"]) for e in events(job, "metrics")}


def release_when_shrunk(job_id: str, stop: threading.Event) -> None:
    """The blocking job ends once the job trains on 2 workers (its first step after the shrink)."""
    path = home() / "jobs" / job_id / "events.jsonl"
    while not stop.wait(0.2):
        evs = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
        shrunk = [e["time"] for e in evs if e["type"] == "resize" and e["to_workers"] == 2]
        if shrunk and any(e["type"] == "metrics" and e["time"] > shrunk[0] for e in evs):
            release_gang("blocker")
            return


# MTTR and lost steps under a 3 s heartbeat window: run alone (in CI, 2026-12-06, a loaded disk's fsync stalled the
# publisher past it, and the phantom node loss replaced the recovery being measured)
@pytest.mark.timing
def test_node_loss_shrinks_to_the_capacity_left_then_grows_back_with_the_same_loss_curve():
    reference = run_job(make_job("elastic-ref", steps=STEPS, interval=INTERVAL, micro_batch=2),
                        health={"hang_timeout_s": 60.0})
    job = make_job("chaos-elastic", steps=STEPS, interval=INTERVAL, workers=4, min_workers=2)
    assert job.record.data["plan"]["layout"]["dp"] == 2  # planned at min_gpus; dp follows the granted size
    with chaos_cluster(CHAOS_CLUSTER):
        live_scheduler().request(GangRequest(job_id="blocker", team="other", gpu_type="cpu", num_gpus=2,
                                             gpus_per_node=2), timeout_s=10)
    stop = threading.Event()
    watcher = threading.Thread(target=release_when_shrunk, args=(job.record.job_id, stop), daemon=True)
    watcher.start()
    try:
        # a generous hang timeout: 4 workers start on 2 loaded cores (a slow first step is not this test's fault)
        run_job(job, fault=f"node:rank=2:step={KILL_STEP}", max_retries=1, health={"hang_timeout_s": 60.0})
    finally:
        stop.set()
        watcher.join(timeout=5)
    m = measure(job, "elastic: node lost with no spare -> 2 workers -> grown back to 4", "node", "rank_lost")
    data = job.record.data
    resizes = [(r["from_workers"], r["to_workers"], r["from_dp"], r["to_dp"], r["accumulation"])
               for r in data["resizes"]]
    print(f"CHAOS elastic: placements {job.placements} resizes {resizes} segments "
          f"{[s['state'] for s in data['segments']]} wall={job.wall_s:.1f}s")
    assert resizes == [(4, 2, 4, 2, [1, 2]), (2, 4, 2, 4, [2, 1])]
    assert [s["state"] for s in data["segments"]] == ["failed", "resized", "completed"]
    starts = events(job, "segment_start")
    assert [e["world_size"] for e in starts] == [4, 2, 4]
    lost_node = job.placements[0][1]
    assert lost_node not in job.placements[1] and len(job.placements[1]) == 1
    assert len(job.placements[-1]) == 2 and lost_node not in job.placements[-1]
    # resumed from checkpoints written at the other world size (DCP reshards 4 -> 2 and 2 -> 4)
    resumed = [e["resumed_from"] for e in starts]
    # the newest the failed segment committed (a commit may land after the detection: see test_multinode.py)
    newest = max(e["step"] for e in events(job, "checkpoint") if e["src"]["attempt"] == 0)
    assert resumed[0] is None and resumed[1] == newest and resumed[2] > resumed[1]
    assert m["tier"] == "segment retry" and m["lost_steps"] == KILL_STEP - newest
    grow = [e for e in events(job, "recovered") if e["fault"] == "resize"]
    assert grow and grow[0]["tier"] == "resume after resize" and grow[0]["lost_steps"] == 0
    assert events(job, "segment_end")[-1]["step"] == STEPS
    # the same training as a fixed 2-worker run: every step's loss, before, between and after the resizes
    ours, ref = losses(job), losses(reference)
    assert sorted(ours) == sorted(ref) == list(range(1, STEPS + 1))
    worst = max(abs(ours[s] - ref[s]) for s in ours)
    print(f"CHAOS elastic: max |loss - fixed 2-worker loss| over {STEPS} steps = {worst:.2e}")
    assert worst < LOSS_TOL
