"""The Tiresias-style 2D-LAS baseline (infra/simulator/las.py): queues by attained service (GPUs x time run),
FIFO inside a queue, preemption of the more-served, promotion of the starved; no runtime estimates read.

Run: .venv/bin/python -m pytest tests/unit/scheduler/test_las.py -q
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from trainforge.infra.scheduler import ClusterState, JobRequest, NodeInfo, Preempt, SchedulerConfig
from trainforge.infra.simulator import SimConfig, Simulation, Trace, TraceJob, load_trace
from trainforge.infra.simulator.las import LasModel, LasSettings

TIRESIAS_60 = Path(__file__).resolve().parents[3].parent / "shared" / "traces" / "tiresias_60_jobs.csv"


def las(nodes: int = 1, **settings) -> LasModel:
    state = ClusterState([NodeInfo(f"n{i}", "h100", 8, "r0") for i in range(nodes)])
    return LasModel(state, {}, SchedulerConfig(policy="fifo", grace_s=120), settings=LasSettings(**settings))


def req(job_id: str, gpus: int = 8, runtime: float = 10.0) -> JobRequest:
    # max_runtime_s is deliberately wrong: LAS never reads it
    return JobRequest(job_id=job_id, team="t", num_gpus=gpus, max_runtime_s=runtime)


def kinds(decisions) -> list[tuple[str, str]]:
    return [(type(d).__name__, d.job_id) for d in decisions]


def test_a_new_job_preempts_one_past_the_threshold_and_the_served_job_comes_back_after():
    s = las()
    s.submit(req("long"), 0)
    assert kinds(s.schedule(0)) == [("Start", "long")]
    s.submit(req("new"), 1000)  # long has 8,000 GPU-s: queue 1; new has none: queue 0
    assert s.queue(s.jobs["long"], 1000) == 1 and s.queue(s.jobs["new"], 1000) == 0
    [p] = s.schedule(1000)
    assert isinstance(p, Preempt) and p.job_id == "long" and p.for_job == "new" and p.deadline == 1120
    assert math.isnan(p.at_checkpoint)  # checkpoint on notice
    s.stopped("long", 1030)
    assert s.served["long"] == 8 * 1030
    assert kinds(s.schedule(1030)) == [("Start", "new")]
    s.finish("new", 1500)
    assert kinds(s.schedule(1500)) == [("Start", "long")]


def test_inside_one_queue_it_is_first_come_first_served():
    s = las()
    s.submit(req("a"), 0)
    s.schedule(0)
    s.submit(req("b"), 100)  # a has 800 GPU-s, below the 3,600 threshold: both in queue 0, a came first
    assert s.schedule(100) == []
    assert s.jobs["a"].state.value == "running" and s.jobs["b"].state.value == "pending"


def test_the_pass_is_asked_for_when_a_running_job_crosses_a_threshold_while_others_wait():
    s = las()
    s.submit(req("a"), 0)
    s.schedule(0)
    assert s.next_wakeup(0) == math.inf  # nobody waits: no need to look
    s.submit(req("b"), 100)
    s.schedule(100)
    wake = s.next_wakeup(100)
    assert wake == 3600 / 8  # a crosses 3,600 GPU-s at t=450
    assert kinds(s.schedule(wake)) == [("Preempt", "a")]


def test_a_starved_job_is_promoted_back_to_the_first_queue():
    s = las(promote_knob=2.0)
    s.submit(req("a"), 0)
    s.schedule(0)
    s.submit(req("b"), 500)  # a: 4,000 GPU-s, queue 1
    s.schedule(500)
    s.stopped("a", 530)  # a ran 530 s
    s.schedule(530)
    assert s.served["a"] == 8 * 530 and s.queue(s.jobs["a"], 531) == 1
    assert s.queue(s.jobs["a"], 530 + 2 * 530 - 1) == 1
    assert s.queue(s.jobs["a"], 530 + 2 * 530) == 0  # waited twice its last run
    assert s.next_wakeup(531) == 530 + 450  # b crosses into queue 1 first (the promotion is due at 1,590)
    assert s.schedule(980) == []  # b is queue 1 now, a still too
    assert s.next_wakeup(980) == 1590
    assert kinds(s.schedule(1590)) == [("Preempt", "b")]  # promoted: a is ahead of b again
    s.stopped("b", 1620)
    assert kinds(s.schedule(1620)) == [("Start", "a")]
    assert s.queue(s.jobs["a"], 1621) == 0  # its service counts from zero: b cannot take it back at once
    assert s.schedule(1621) == []


def test_victims_come_from_the_back_of_the_order_and_only_as_many_as_needed():
    s = las(nodes=2)
    s.submit(req("old"), 0)
    s.submit(req("young"), 0)
    assert {d.job_id for d in s.schedule(0)} == {"old", "young"}
    s.finish("young", 100)
    s.submit(req("mid"), 100)
    s.schedule(100)  # mid takes young's node
    s.submit(req("new"), 2000)  # old 16,000 GPU-s, mid 15,200: both queue 1; mid came last: it goes
    decisions = s.schedule(2000)
    assert kinds(decisions) == [("Preempt", "mid")]


def test_short_jobs_finish_sooner_than_under_fifo_behind_a_long_one():
    """The reason 2D-LAS exists: with no estimates it still lets short jobs past a long one."""
    nodes = [NodeInfo("n0", "h100", 8, "r0")]
    jobs = [TraceJob(job_id="long", submit_s=0, team="t", priority="normal", gpu_type="h100", num_gpus=8,
                     duration_s=10 * 3600.0)]
    jobs += [TraceJob(job_id=f"s{i}", submit_s=600.0 + i, team="t", priority="normal", gpu_type="h100", num_gpus=8,
                      duration_s=300.0) for i in range(5)]
    jct = {}
    for policy in ("fifo", "las"):
        sim = Simulation(nodes, Trace(jobs, "hand-made"), SimConfig(policy=policy))
        report = sim.run()
        assert report["completed"] == 6 and sim.lost["preemption"] == 0
        jct[policy] = {j: r.end - r.submit for j, r in sim.runs.items()}
    assert max(jct["las"][f"s{i}"] for i in range(5)) < 6 * 300 + 200  # each short job waits for the others only
    assert min(jct["fifo"][f"s{i}"] for i in range(5)) > 9 * 3600
    # preempted once (by s0), checkpointing on notice: it loses nothing and waits for the five short jobs
    assert jct["las"]["long"] == pytest.approx(10 * 3600 + 5 * 300 + 30, abs=1e-6)


@pytest.mark.skipif(not TIRESIAS_60.exists(), reason="the shared traces are not checked out beside the project")
def test_the_tiresias_sample_replays_to_completion_with_no_work_lost():
    trace = load_trace(TIRESIAS_60)
    nodes = [NodeInfo(f"n{i}", "v100", 8, "r0") for i in range(4)]
    sim = Simulation(nodes, trace, SimConfig(policy="las"))
    report = sim.run()
    assert report["completed"] == len(trace.jobs)
    assert sim.lost["preemption"] == 0 and sim.sched.stats["kills"] == 0
    assert not sim.sched.jobs
    assert all(r.first_start >= r.submit and r.end > r.first_start for r in sim.runs.values())
