"""No gang starves: standing reservations for gangs of teams under their fair share, backfill only into holes that
end before the reservation, and past `patience_s` preemption of richer teams' jobs at their next checkpoint
boundary. A hand-made flood scenario (ours vs FIFO), direct policy scenarios, and a property test over random
traces whose runtime estimates are wrong both ways: every gang that fits the cluster starts within the bound of
docs/scheduler.md ("No gang starves").

Run: .venv/bin/python -m pytest tests/unit/scheduler/test_starvation.py -q
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainforge.infra.scheduler import (
    ClusterState,
    JobRequest,
    NodeInfo,
    Preempt,
    Scheduler,
    SchedulerConfig,
    Start,
    TeamPolicy,
)
from trainforge.infra.simulator import SimConfig, Simulation, Trace, TraceJob, scenarios
from trainforge.infra.simulator.scenarios import flood_nodes, flood_trace, gang_bound_s

H = 3600.0
GRACE = 120.0


def cluster(num_nodes: int, per_node: int = 8) -> list[NodeInfo]:
    return flood_nodes(num_nodes, per_node)


def gang_wait(policy: str, jobs: list[TraceJob], nodes: list[NodeInfo]) -> tuple[float, Simulation]:
    run, sim = scenarios.gang_wait(policy, jobs, nodes)
    return run.wait_s, sim


def test_full_cluster_gang_of_an_idle_team_waits_no_longer_than_under_fifo():
    """One team floods 4 x 8 GPUs with small jobs for two days; an idle team of equal weight submits one
    full-cluster gang an hour in. Before standing reservations `ours` made it wait 9.4 h (FIFO: 5.3 h): whenever
    the flood drained, an older flood job won the fair-share tie (both teams at share 0) and the EASY
    reservation was recomputed from scratch behind it."""
    gang = TraceJob(job_id="gang", submit_s=1 * H, team="gang", priority="normal", gpu_type="h100", num_gpus=32,
                    duration_s=4 * H)
    nodes = cluster(4)
    fifo, _ = gang_wait("fifo", flood_trace() + [gang], nodes)
    ours, sim = gang_wait("ours", flood_trace() + [gang], nodes)
    assert fifo > 2 * H  # the scenario contends: under FIFO the gang waits for the running flood to drain
    assert ours <= fifo
    # the bound (docs/scheduler.md): patience + the longest checkpoint interval + the grace period
    assert ours <= 3600 + 1800 + GRACE
    # victims stopped at checkpoint boundaries: no work lost, none killed after its grace period
    assert sim.lost["preemption"] == 0 and sim.sched.stats["kills"] == 0
    assert sim.sched.stats["preemptions"] > 0


def test_standing_reservation_keeps_the_gang_ahead_and_admits_only_holes_that_end_before_it():
    s = Scheduler(ClusterState(cluster(2)), {"a": TeamPolicy(), "b": TeamPolicy()},
                  SchedulerConfig(patience_s=10 * H))
    s.submit(JobRequest(job_id="a8", team="a", num_gpus=8, max_runtime_s=100), 0)
    s.submit(JobRequest(job_id="a4", team="a", num_gpus=4, max_runtime_s=1000), 0)
    assert {d.job_id for d in s.schedule(0)} == {"a8", "a4"}
    s.submit(JobRequest(job_id="gang", team="b", num_gpus=16, max_runtime_s=5000), 1)
    assert s.schedule(1) == []
    assert s.jobs["gang"].reserved_since == 1  # team b holds nothing: under its fair share
    s.submit(JobRequest(job_id="long", team="a", num_gpus=4, max_runtime_s=2000), 2)  # would delay the gang
    s.submit(JobRequest(job_id="short", team="a", num_gpus=4, max_runtime_s=500), 2)  # ends before 1000: a hole
    assert [d.job_id for d in s.schedule(2)] == ["short"]
    assert "delay the reservation of gang" in s.jobs["long"].reason
    # a8 ends early: a whole node is free, and `long` still may not take it
    s.finish("a8", 50)
    assert s.schedule(50) == []
    s.finish("a4", 60)
    s.finish("short", 70)
    started = s.schedule(70)
    assert [d.job_id for d in started] == ["gang"] and isinstance(started[0], Start)


def test_past_its_patience_a_reserved_gang_preempts_richer_teams_at_their_next_checkpoint():
    s = Scheduler(ClusterState(cluster(2)), {"a": TeamPolicy(), "b": TeamPolicy()},
                  SchedulerConfig(patience_s=600))
    clock = {"a0": 0.0, "a1": 900.0}
    s.checkpoint_clock = lambda job, now: clock[job.job_id]
    for i in range(2):
        s.submit(JobRequest(job_id=f"a{i}", team="a", num_gpus=8, max_runtime_s=10 * H, checkpoint_interval_s=1000),
                 0)
    s.schedule(0)
    s.submit(JobRequest(job_id="gang", team="b", num_gpus=16, max_runtime_s=H), 1000)
    decisions = s.schedule(1000)  # estimated wait 10 h > patience: preempt now, each at its next checkpoint
    preempts = {d.job_id: d for d in decisions if isinstance(d, Preempt)}
    assert set(preempts) == {"a0", "a1"}
    # a0's boundary is now (checkpointed at 0, every 1000 s): it checkpoints on notice; a1's is 900 s away
    assert math.isnan(preempts["a0"].at_checkpoint) and preempts["a0"].deadline == 1000 + s.config.grace_s
    assert preempts["a1"].at_checkpoint == 1900 and preempts["a1"].deadline == 1900 + s.config.grace_s
    # a same-team job of equal priority is never a victim, and neither is a team poorer than the gang's
    s2 = Scheduler(ClusterState(cluster(1)), {"a": TeamPolicy(), "b": TeamPolicy()}, SchedulerConfig(patience_s=0))
    s2.submit(JobRequest(job_id="b0", team="b", num_gpus=8, max_runtime_s=10 * H), 0)
    s2.schedule(0)
    s2.submit(JobRequest(job_id="gang", team="b", num_gpus=8, max_runtime_s=H), 1)
    assert not [d for d in s2.schedule(2) if isinstance(d, Preempt)]


def test_a_starving_gang_takes_over_a_richer_teams_preemption_plan_instead_of_waiting_behind_it():
    """Found by the property test (CI, seed unknown): a richer team's job had a plan on the nodes the gang needed
    (its low-priority victim checkpointing), so the gang could plan nothing until that job started there, and then
    preempted it a whole checkpoint interval later: 4,228 s against a bound of 3,720 s. The gang now waits on the
    victim already stopping and drops the other job's plan."""
    s = Scheduler(ClusterState(cluster(2, per_node=4)), {"a": TeamPolicy(), "g": TeamPolicy()},
                  SchedulerConfig(patience_s=0))
    s.submit(JobRequest(job_id="low", team="a", priority="low", num_gpus=4, max_runtime_s=10 * H), 0)
    s.submit(JobRequest(job_id="r", team="a", num_gpus=4, max_runtime_s=10 * H, checkpoint_interval_s=H), 0)
    assert {d.job_id for d in s.schedule(0)} == {"low", "r"}
    s.submit(JobRequest(job_id="a14", team="a", num_gpus=4, max_runtime_s=H), 1)
    assert [(type(d), d.job_id) for d in s.schedule(1)] == [(Preempt, "low")]  # a14 outranks low
    assert s.jobs["a14"].waiting_on == {"low"}
    s.submit(JobRequest(job_id="gang", team="g", num_gpus=8, max_runtime_s=H, checkpoint_interval_s=H), 2)
    decisions = s.schedule(2)
    assert [(type(d), d.job_id) for d in decisions] == [(Preempt, "r")]  # low is already stopping: no second notice
    assert decisions[0].at_checkpoint == H and decisions[0].for_job == "gang"
    assert s.jobs["gang"].waiting_on == {"low", "r"}
    assert s.jobs["a14"].planned is None and "taken over by starving gang gang" in s.jobs["a14"].reason
    s.stopped("low", 30)
    assert s.schedule(30) == []  # low's GPUs are the gang's now, not a14's
    s.stopped("r", H + 30)
    started, *rest = s.schedule(H + 30)
    assert isinstance(started, Start) and started.job_id == "gang"
    # now team a starves (patience 0): the gang trains to its first checkpoint before it yields (time-sharing)
    assert [(type(d), d.job_id, d.at_checkpoint) for d in rest] == [(Preempt, "gang", 2 * H + 30)]


# -- the bound, on random traces ----------------------------------------------------------------------------
@st.composite
def traces(draw):
    per_node = draw(st.sampled_from([4, 8]))
    num_nodes = draw(st.integers(1, 4))
    intervals = []
    jobs = []
    # The richer team marks a share of its work high (at least a quarter in most examples; `critical` beyond its
    # critical quota of 0 runs as high too): between teams, fair share decides whatever the priorities.
    high = draw(st.sampled_from([0.25, 0.5, 1.0, 0.0]))
    for i in range(draw(st.integers(1, 30))):
        every = draw(st.sampled_from([600.0, 1800.0, 3600.0]))
        top = draw(st.sampled_from(["high", "critical"])) if draw(st.floats(0, 1)) < high else None
        intervals.append(every)
        duration = draw(st.floats(0.1, 8.0)) * H
        jobs.append(TraceJob(
            job_id=f"a{i}", submit_s=draw(st.floats(0, 12 * H)), team="a",
            priority=top or draw(st.sampled_from(["normal", "normal", "low", "preemptible"])), gpu_type="h100",
            num_gpus=draw(st.sampled_from([1, 2, per_node, per_node * max(1, num_nodes // 2)])),
            duration_s=duration, checkpoint_interval_s=every,
            # estimates wrong both ways: a quarter of the real runtime to three times it
            estimate_s=duration * draw(st.floats(0.25, 3.0))))
    size = per_node * draw(st.integers(1, num_nodes))
    gang = TraceJob(job_id="gang", submit_s=draw(st.floats(0, 12 * H)), team="g",
                    priority=draw(st.sampled_from(["normal", "high", "low"])),
                    gpu_type="h100", num_gpus=size, duration_s=draw(st.floats(0.1, 8.0)) * H,
                    checkpoint_interval_s=1800.0, estimate_s=draw(st.floats(0.1, 20.0)) * H)
    patience = draw(st.sampled_from([0.0, 600.0, 3600.0, 4 * 3600.0]))
    return cluster(num_nodes, per_node), jobs + [gang], patience, max(intervals, default=0.0)


@settings(max_examples=120, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(traces())
def test_every_gang_of_an_idle_team_starts_within_the_bound(case):
    nodes, jobs, patience, longest_interval = case
    teams = {"a": TeamPolicy(critical_quota=0), "g": TeamPolicy()}
    sim = Simulation(nodes, Trace(sorted(jobs, key=lambda j: j.submit_s), "random"),
                     SimConfig(policy="ours", teams=teams, patience_s=patience, grace_s=GRACE))
    report = sim.run()
    assert report["completed"] == len(jobs)
    r = sim.runs["gang"]
    bound = gang_bound_s(patience, longest_interval, GRACE)
    assert r.first_start - r.submit <= bound + 1e-6, (r.first_start - r.submit, bound)
    assert sim.lost["preemption"] == 0


# -- the flood with priorities: 64 GPUs, a share of the flood high ------------------------------------------
@pytest.mark.parametrize("high_fraction", [0.05, 0.25, 0.5])
def test_a_high_priority_share_of_the_flood_never_delays_the_idle_teams_gang_past_the_bound(high_fraction):
    """The docs' flood on 8 x 8 GPUs, seeds 0-4, with 5%, 25% and 50% of the flood `high`: the idle team's
    64-GPU normal gang starts within the bound every time (before priority within a team, 25% high made it wait
    ~50 h: the flood's high jobs went ahead of it across teams), and no victim loses work or is killed. The flood's
    own high jobs still preempt its own normal ones."""
    nodes = flood_nodes(8)
    bound = gang_bound_s(H, 1800.0, GRACE)
    for seed in range(5):
        jobs = flood_trace(seed, high_fraction=high_fraction) + [scenarios.gang(64)]
        assert sum(j.priority == "high" for j in jobs) >= high_fraction / 2 * len(jobs)
        run, sim = scenarios.gang_wait("ours", jobs, nodes)
        assert run.wait_s <= bound, (seed, run)
        assert run.lost_to_preemption_gpu_s == 0 and run.kills == 0, (seed, run)
        # The flood's high jobs preempted the flood's own jobs; the gang only as a poorer team may (fair share,
        # never for being high): the gang, once running, holds the whole cluster.
        for victim, by, rule in sim.preemptions:
            if by == "gang":
                assert rule == "starving", (victim, by, rule)
            elif victim == "gang":
                assert rule in ("starving", "fair-share"), (victim, by, rule)
            else:
                assert rule == "own-team", (victim, by, rule)
        if high_fraction >= 0.25:
            assert any(rule == "own-team" for *_, rule in sim.preemptions)


# -- the same flood under Kueue's admission (simulator/kueue.py models the rendered ClusterQueues) -------------
def test_kueue_gives_the_bound_to_a_gang_within_its_nominal_quota_and_none_beyond():
    """Two equal teams: each ClusterQueue's nominal quota is 2 of the 4 nodes. A gang within its team's nominal
    quota reclaims it from the borrowing flood (`reclaimWithinCohort: Any`) within the grace period; a gang
    larger than its nominal quota waits until the flood's whole backlog has drained: Kueue never evicts a
    queue that is within its own nominal quota for another queue, and has no reservation across queues
    (docs/scheduler.md, "On Kubernetes")."""
    nodes = cluster(4)
    waits = {}
    for size in (16, 32):
        gang = TraceJob(job_id="gang", submit_s=1 * H, team="gang", priority="normal", gpu_type="h100",
                        num_gpus=size, duration_s=4 * H)
        for policy in ("fifo", "ours", "kueue"):
            waits[(size, policy)], sim = gang_wait(policy, flood_trace(every_s=900) + [gang], nodes)
            if policy == "kueue":
                assert sim.sched.nominal == {"flood": {"h100": 16}, "gang": {"h100": 16}}
    assert waits[(16, "kueue")] <= GRACE
    assert waits[(16, "ours")] <= 3600 + 1800 + GRACE
    assert waits[(32, "ours")] <= waits[(32, "fifo")]
    assert waits[(32, "kueue")] > 10 * waits[(32, "fifo")]  # starved: the limitation the docs state


def test_a_teams_priorities_order_its_own_queue_and_fair_share_orders_the_teams():
    """The queue's order (`queue_order`, the positions `trainforge queue` and the flow show): team a holds the
    cluster; its `high` job waits behind team b's `normal` one (b is under its share), ahead of a's own normal job;
    a critical job within a's quota goes first of all, one beyond it runs as high."""
    s = Scheduler(ClusterState(cluster(2)), {"a": TeamPolicy(critical_quota=8), "b": TeamPolicy()},
                  SchedulerConfig(patience_s=10 * H))
    for i in range(2):
        s.submit(JobRequest(job_id=f"run{i}", team="a", gpu_type="h100", num_gpus=8), 0.0)
    s.schedule(0.0)
    s.submit(JobRequest(job_id="a-normal", team="a", gpu_type="h100", num_gpus=8), 1.0)
    s.submit(JobRequest(job_id="a-high", team="a", priority="high", gpu_type="h100", num_gpus=8), 2.0)
    s.submit(JobRequest(job_id="b-normal", team="b", gpu_type="h100", num_gpus=8), 3.0)
    s.submit(JobRequest(job_id="a-crit", team="a", priority="critical", gpu_type="h100", num_gpus=8), 4.0)
    over = s.submit(JobRequest(job_id="a-crit2", team="a", priority="critical", gpu_type="h100", num_gpus=8), 5.0)
    assert over.rank == s.jobs["a-high"].rank and "scheduled as high (team a's critical quota: 8 GPUs)" in over.reason
    s.schedule(6.0)
    assert s.jobs["a-crit2"].reason.startswith("critical beyond its team's quota, scheduled as high")
    assert [j.job_id for j in s.queue_order("h100")] == ["a-crit", "b-normal", "a-high", "a-crit2", "a-normal"]


def test_a_fair_share_preemption_stops_where_the_victims_team_would_become_the_poorer():
    """Team b holds 8 GPUs in eight 1-GPU jobs; team a (nothing held) asks for 6 with a `high` job. Taking 6 would
    leave b with 2 against a's 6: no preemption at once (the guard adds up what b loses), and the job waits."""
    s = Scheduler(ClusterState(cluster(1)), {"a": TeamPolicy(), "b": TeamPolicy()},
                  SchedulerConfig(patience_s=100 * H))
    for i in range(8):
        s.submit(JobRequest(job_id=f"b{i}", team="b", gpu_type="h100", num_gpus=1), 0.0)
    s.schedule(0.0)
    s.submit(JobRequest(job_id="a-high", team="a", priority="high", gpu_type="h100", num_gpus=6), 1.0)
    assert not [d for d in s.schedule(1.0) if isinstance(d, Preempt)]
    # a 4-GPU one may: a would hold 4, b 4
    s.submit(JobRequest(job_id="a-four", team="a", priority="high", gpu_type="h100", num_gpus=4), 2.0)
    s.finish("a-high", 2.0)
    taken = [d for d in s.schedule(2.0) if isinstance(d, Preempt)]
    assert len(taken) == 4 and {d.rule for d in taken} == {"fair-share"}


def test_a_poorer_teams_preemptible_job_leaves_a_standing_reservation_in_place():
    s = Scheduler(ClusterState(cluster(3)), {}, SchedulerConfig(patience_s=100 * H))
    for i in range(2):
        s.submit(JobRequest(job_id=f"f{i}", team="f", gpu_type="h100", num_gpus=8), 0.0)
    s.submit(JobRequest(job_id="g-small", team="g", gpu_type="h100", num_gpus=4), 0.0)
    s.schedule(0.0)
    s.submit(JobRequest(job_id="g-gang", team="g", gpu_type="h100", num_gpus=16), 10.0)
    s.schedule(10.0)
    assert s.jobs["g-gang"].reserved_since == 10.0
    s.submit(JobRequest(job_id="p", team="p", priority="preemptible", gpu_type="h100", num_gpus=8), 20.0)
    s.schedule(20.0)
    assert s.jobs["g-gang"].reserved_since == 10.0  # the patience clock goes on (it restarted: the bound slipped)
    assert math.isnan(s.jobs["p"].reserved_since)  # preemptible work holds none
