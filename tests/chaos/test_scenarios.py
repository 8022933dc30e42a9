"""Chaos scenarios against a real 2-worker job (tiny model, 24 steps, checkpoint every 8), each printing one
`CHAOS ...` line with detection latency, MTTR and lost steps (numbers for docs/fault-tolerance.md):
- a hung rank: the step-progress watchdog fires, every rank's stack is dumped, the report names the rank and line;
- NaN injected: divergence -> roll back to the last good checkpoint, the batch's samples skipped, the job finishes;
- a straggler is reported with evidence; a termination notice (SIGTERM) -> emergency checkpoint, lost < 1 interval;
- the newest checkpoint corrupted: it is skipped and the job resumes from the previous one;
- a fault on every attempt exhausts the retry budget: a clear report of what failed, what was tried, lost work.

Run: .venv/bin/python -m pytest tests/chaos -s   (about 3 minutes on 2 cores)
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.chaos.harness import FAST_HEALTH, events, make_job, measure, run_job
from trainforge.contract.health import HealthPolicy
from trainforge.home import home
from trainforge.tasks.chaos import corrupt_after_emergency_checkpoint
from trainforge.tasks.segment import SegmentFailed
from trainforge.tasks.supervisor import give_up_report
from trainforge.trainer.faults import fired_at

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def incidents(job, kind):
    return [e for e in events(job, "fault_detected") if e["fault"] == kind]


@pytest.mark.timing
def test_hang_fires_watchdog_dumps_stacks_and_names_rank_and_line():
    job = run_job(make_job("chaos-hang"), fault="hang:rank=1:step=6", max_retries=1)
    m = measure(job, "hang rank 1 (watchdog, segment retry)", "hang", "hang")
    [hang] = incidents(job, "hang")
    assert hang["rank"] == 1
    assert "faults.py" in hang["message"] and "rank 1 is stuck at" in hang["message"]
    report = job.record.folder / "artifacts/stacks/segment-0/hang-report.txt"
    assert report.is_file() and "faults.py" in report.read_text()
    dumps = sorted((job.record.folder / "artifacts/stacks/segment-0").glob("rank-*-restart-0.txt"))
    assert len(dumps) == 2 and all("File " in p.read_text() for p in dumps)
    # the window the policy derives (max(floor, factor x median step): at most from the slowest step before the
    # hang), plus the beat's way up (beat 0.25 s + flush 0.5 s + reader 0.6 s) and a loaded host's slack
    fired = min(t for name, t in fired_at(job.record.folder).items() if name.startswith("hang"))
    slowest = max(e["step_time_s"] for e in events(job, "metrics") if e["time"] < fired)
    assert m["detection_s"] < HealthPolicy.from_dict(FAST_HEALTH).hang_timeout(slowest) + 6
    assert "rank 1" in str(job.failures[0]) and "faults.py" in str(job.failures[0])
    assert events(job, "segment_end")[-1]["step"] == 24


# MTTR and lost steps under a 3 s heartbeat window: run alone (in CI, 2026-12-06, a loaded disk's fsync stalled the
# publisher past it, and the phantom node loss replaced the recovery being measured)
@pytest.mark.timing
def test_nan_rolls_back_skips_the_batch_and_finishes():
    job = run_job(make_job("chaos-nan"), fault="nan:rank=0:step=12", max_retries=2)
    m = measure(job, "NaN at step 13 (rollback + skip)", "nan")
    [div] = incidents(job, "divergence")
    assert "step 13" in div["message"] and "nan" in div["message"].lower()
    data = job.record.data
    assert len(data["skip_samples"]) == 8 and data["divergence"][0]["step"] == 12
    starts = [e["resumed_from"] for e in events(job, "segment_start")]
    assert starts == [None, 8]
    assert m["lost_steps"] == 5  # steps 9-13 (13 produced the NaN)
    after = [e for e in events(job, "metrics") if e["time"] > div["time"]]
    assert after and all(e["loss"] == e["loss"] for e in after)  # finite from the rollback on
    manifests = list((home() / "store").rglob("step-0000000024/manifest*"))
    assert manifests and sorted(data["skip_samples"]) == json.loads(manifests[0].read_text())["sampler"]["skip"]
    assert events(job, "segment_end")[-1]["step"] == 24


@pytest.mark.timing
def test_straggler_reported_and_sigterm_takes_emergency_checkpoint():
    job = run_job(make_job("chaos-spot"), fault="slow:rank=1:step=2:ms=300,sigterm:rank=1:step=13")
    m = measure(job, "SIGTERM preemption rank 1 (emergency checkpoint)", "sigterm", "preemption")
    [slow] = incidents(job, "straggler")[:1]
    assert slow["rank"] == 1 and "median of the other ranks" in slow["message"]
    ends = events(job, "segment_end")
    assert [e["reason"] for e in ends] == ["preempted", "finished"]
    assert ends[0]["step"] == 14  # checkpointed at the step boundary after the notice, not at the interval (16)
    assert [e["resumed_from"] for e in events(job, "segment_start")] == [None, 14]
    assert m["lost_steps"] == 0 < 8
    assert [s["state"] for s in job.record.data["segments"]] == ["preempted", "completed"]


def test_corrupt_newest_checkpoint_is_skipped_and_previous_used():
    # The newest checkpoint is an emergency one (step 14, off the interval): the resumed run never saves step 14
    # again (re-committing a quarantined step hangs the commit today: see docs/fault-tolerance.md, open issues).
    job = make_job("chaos-corrupt")
    assert corrupt_after_emergency_checkpoint(job) == (8, 14)
    t0 = time.time()
    job = run_job(job)
    corrupt = events(job, "checkpoint_corrupt")
    assert corrupt and corrupt[0]["step"] == 14
    assert [e["resumed_from"] for e in events(job, "segment_start")] == [None, 8]
    first = min(e["time"] for e in events(job, "metrics") if e["time"] > corrupt[0]["time"])
    print(f"CHAOS corrupt newest checkpoint: detected=checkpoint_corrupt detection={corrupt[0]['time'] - t0:.2f}s "
          f"(from segment launch) mttr={first - t0:.2f}s lost_steps=6 tier=segment resume segments=2")
    assert events(job, "segment_end")[-1]["step"] == 24


def test_retry_budget_exhausted_gives_a_clear_report():
    job = make_job("chaos-budget")
    with pytest.raises(SegmentFailed) as info:
        run_job(job, fault="kill:rank=1:step=3:always=1", max_retries=1)
    assert info.value.kind == "infra" and "rank 1" in str(info.value)
    report = give_up_report(job.record, info.value)
    print("CHAOS budget exhausted report:\n" + report)
    assert "2 segment attempt(s)" in report
    assert report.count("rank_lost (rank 1)") == 2
    assert "work lost if resumed" in report and "--resume chaos-budget" in report
    assert Path(job.record.folder / "failure-report.txt").is_file()
