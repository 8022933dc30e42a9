"""Scheduler policy scenarios: topology-aware placement, preemption (victim choice, grace, kill), EASY backfill,
weighted fair share, quotas, dedicated pools with lending and reclaim, elastic shrink/grow, failures and spot.

Run: pytest tests/unit/scheduler/test_scenarios.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.scheduler.conftest_helpers import check_invariants, make_nodes
from trainforge.infra.scheduler import (
    ClusterState,
    JobRequest,
    JobState,
    Kill,
    Preempt,
    Requeue,
    Resize,
    Scheduler,
    SchedulerConfig,
    Start,
    TeamPolicy,
    find_placement,
)
from trainforge.plan.cluster import load_cluster

FLEET = Path(__file__).resolve().parents[3] / "examples" / "clusters" / "fleet-10k.yaml"


def sched(groups, policy="ours", teams=None, **cfg) -> Scheduler:
    return Scheduler(ClusterState(make_nodes(groups)), teams, SchedulerConfig(policy=policy, **cfg))


def req(job_id, n, team="t", priority="normal", **kw) -> JobRequest:
    return JobRequest(job_id=job_id, team=team, priority=priority, gpu_type=kw.pop("gpu_type", "h100"), num_gpus=n,
                      **kw)


def starts(decisions):
    return {d.job_id: d.placement for d in decisions if isinstance(d, Start)}


def test_4096_gpu_gang_on_the_fleet_has_no_tp_group_spanning_nodes_and_pipelines_in_racks():
    state = ClusterState.from_spec(load_cluster(FLEET))
    pl = find_placement(state, "h100", 4096, tp=8, pp=4, pools=state.pools)
    assert pl is not None and pl.num_gpus == 4096
    q = pl.quality
    assert q.tp_groups_spanning_nodes == 0 and q.pp_groups_spanning_racks == 0
    assert q.num_nodes == 512 and q.num_racks == 16 and q.partial_nodes == 0


def test_small_jobs_pack_best_fit_and_keep_whole_nodes_free():
    s = sched([("h100", 4, 8, 2, "shared", False)])
    s.submit(req("a", 4), 0)
    s.submit(req("b", 2), 0)
    s.submit(req("c", 2), 0)
    placed = starts(s.schedule(0))
    assert {p.assignments[0][0] for p in placed.values()} == {0}  # all on node 0: nodes 1..3 stay whole
    s.submit(req("big", 24, tp=8), 1)
    assert starts(s.schedule(1))["big"].quality.tp_groups_spanning_nodes == 0


def test_multi_node_gang_prefers_one_rack_and_keeps_pipelines_inside_racks():
    s = sched([("h100", 8, 8, 4, "shared", False)])
    s.submit(req("x", 8), 0)  # takes node 0 of rack 0
    s.schedule(0)
    s.submit(req("g", 32, tp=8, pp=2), 1)  # 4 nodes: rack 1 is whole
    pl = starts(s.schedule(1))["g"]
    assert pl.quality.num_racks == 1 and {s.state.nodes[n].rack for n, _ in pl.assignments} == {1}
    s.submit(req("h", 24, tp=8, pp=3), 2)  # 3 nodes, only rack 0 has 3 free
    pl = starts(s.schedule(2))["h"]
    assert pl.quality.pp_groups_spanning_racks == 0 and pl.quality.num_racks == 1


def test_gpu_types_are_never_mixed_and_gangs_are_all_or_nothing():
    s = sched([("h100", 2, 8, 2, "shared", False), ("a100-80gb", 2, 8, 2, "shared", False)])
    s.submit(req("x", 4, gpu_type="h100"), 0)
    s.submit(req("a", 16, gpu_type="any"), 0)  # 28 free in total, but only 16 of one type (a100)
    s.submit(req("b", 16, gpu_type="h100"), 0)  # 12 h100 free: waits, holding nothing
    placed = starts(s.schedule(0))
    assert placed["a"].gpu_type == "a100-80gb" and "b" not in placed
    assert s.jobs["b"].placement is None and all("b" not in n.jobs for n in s.state.nodes)
    check_invariants(s)


def test_job_bigger_than_any_type_is_rejected_with_a_clear_message():
    s = sched([("h100", 2, 8, 2, "shared", False), ("a100-80gb", 2, 8, 2, "shared", False)])
    with pytest.raises(ValueError, match="at most 16"):
        s.submit(req("a", 24, gpu_type="any"), 0)
    with pytest.raises(ValueError, match="gpus_per_node"):
        req("b", 8, tp=4, gpus_per_node=2)


def test_preemption_picks_least_lost_work_and_waits_for_checkpoint_then_stop():
    s = sched([("h100", 2, 8, 2, "shared", False)], grace_s=60)
    for j, prio in (("pre", "preemptible"), ("low", "low")):
        s.submit(req(j, 8, priority=prio), 0)
    s.schedule(0)
    s.submit(req("crit", 8, priority="critical"), 10)
    d = s.schedule(10)
    pre = [x for x in d if isinstance(x, Preempt)]
    assert [p.job_id for p in pre] == ["pre"] and pre[0].deadline == 70  # preemptible class goes first
    assert s.jobs["pre"].state is JobState.PREEMPTING and s.jobs["crit"].state is JobState.PENDING
    s.submit(req("sneaky", 8, priority="normal"), 11)  # must not steal the earmarked GPUs
    assert not starts(s.schedule(11))
    s.stopped("pre", 30)  # checkpointed and stopped inside the grace period
    placed = starts(s.schedule(30))
    assert "crit" in placed and s.jobs["pre"].state is JobState.PENDING
    check_invariants(s)


def test_victims_are_killed_when_the_grace_period_ends():
    s = sched([("h100", 1, 8, 1, "shared", False)], grace_s=60)
    s.submit(req("low", 8, priority="low"), 0)
    s.schedule(0)
    s.submit(req("high", 8, priority="high"), 1)
    s.schedule(1)
    d = s.schedule(61)
    assert any(isinstance(x, Kill) and x.job_id == "low" for x in d) and "high" in starts(d)


def test_most_recently_checkpointed_victim_among_equals():
    s = sched([("h100", 2, 8, 2, "shared", False)])
    s.submit(req("old", 8, priority="low"), 0)
    s.submit(req("fresh", 8, priority="low"), 0)
    s.schedule(0)
    s.checkpointed("fresh", 100)
    s.submit(req("high", 8, priority="high"), 120)
    assert [x.job_id for x in s.schedule(120) if isinstance(x, Preempt)] == ["fresh"]


def test_same_priority_never_preempts_and_easy_backfill_protects_the_head():
    s = sched([("h100", 2, 8, 2, "shared", False)])
    s.submit(req("a", 8, max_runtime_s=1000), 0)
    s.schedule(0)
    s.submit(req("head", 16, max_runtime_s=1000), 1)
    s.submit(req("long", 8, max_runtime_s=5000), 2)  # would delay head (a ends at ~1000)
    s.submit(req("short", 8, max_runtime_s=500), 3)  # ends before the reservation: backfills
    d = s.schedule(3)
    assert set(starts(d)) == {"short"} and not any(isinstance(x, Preempt) for x in d)
    assert "backfill would delay" in s.jobs["long"].reason and "head" in s.jobs["head"].reason
    fifo = sched([("h100", 2, 8, 2, "shared", False)], policy="fifo")
    for r in (req("a", 8, max_runtime_s=1000), req("head", 16), req("short", 8, max_runtime_s=10)):
        fifo.submit(r, 0)
    assert set(starts(fifo.schedule(0))) == {"a"}  # strict FIFO: the head blocks the short job


def test_weighted_fair_share_orders_teams_by_dominant_share():
    s = sched([("h100", 1, 8, 1, "shared", False)], teams={"big": TeamPolicy(weight=4.0)})
    s.submit(req("b0", 4, team="big"), 0)
    s.schedule(0)
    s.submit(req("s1", 2, team="small"), 1)
    s.submit(req("b1", 2, team="big"), 0.5)  # submitted earlier, but big already holds 4/8 (share 0.5/4)
    s.submit(req("s2", 2, team="small"), 1)
    placed = list(starts(s.schedule(1)))
    assert placed[0] == "s1"


def test_quotas_are_hard_caps():
    s = sched([("h100", 2, 8, 2, "shared", False)], teams={"q": TeamPolicy(quota={"h100": 8})})
    s.submit(req("q1", 8, team="q"), 0)
    s.submit(req("q2", 4, team="q"), 0)
    s.submit(req("o", 4, team="other"), 0)
    s.schedule(0)
    assert s.jobs["q2"].state is JobState.PENDING and s.jobs["q2"].reason.startswith("quota")
    assert s.jobs["o"].state is JobState.RUNNING


def test_dedicated_pool_serves_owner_first_lends_and_reclaims():
    s = sched([("h100", 1, 8, 1, "shared", False), ("h100", 1, 8, 1, "owner", False)])
    s.submit(req("own", 8, team="owner"), 0)
    assert s.state.nodes[starts(s.schedule(0))["own"].assignments[0][0]].pool == "owner"
    s.finish("own", 1)
    s.submit(req("x1", 8, team="x"), 2)
    s.submit(req("x2", 8, team="x", priority="high"), 2)
    s.schedule(2)
    borrowers = [j for j in ("x1", "x2") if s.jobs[j].borrowed_from == {"owner"}]
    assert len(borrowers) == 1
    s.submit(req("back", 8, team="owner", priority="low"), 3)  # even a low-priority owner job reclaims
    d = s.schedule(3)
    assert [x.job_id for x in d if isinstance(x, Preempt)] == borrowers
    s.stopped(borrowers[0], 4)
    assert "back" in starts(s.schedule(4))


def test_elastic_jobs_grow_into_idle_capacity_and_shrink_before_anyone_is_preempted():
    s = sched([("h100", 4, 8, 4, "shared", False)])
    s.submit(req("el", 32, min_gpus=8, priority="low"), 0)
    s.submit(req("x", 16), 0)
    s.schedule(0)
    assert s.jobs["el"].gpus == 16
    s.finish("x", 10)
    d = s.schedule(10)
    assert any(isinstance(x, Resize) and x.job_id == "el" for x in d) and s.jobs["el"].gpus == 32
    s.submit(req("need", 16, priority="normal"), 20)
    d = s.schedule(20)
    assert "need" in starts(d) and not any(isinstance(x, Preempt) for x in d)
    assert s.jobs["el"].gpus == 16 and s.stats["shrinks"] == 1
    check_invariants(s)


def test_node_failure_replaces_lost_workers_or_requeues_at_head_of_class():
    s = sched([("h100", 3, 8, 3, "shared", False)])
    s.submit(req("g", 16, tp=8), 0)
    s.schedule(0)
    lost = s.jobs["g"].placement.assignments[0][0]
    d = s.fail_node(s.state.nodes[lost].name, 5)
    assert isinstance(d[0], Resize) and lost not in s.jobs["g"].placement.node_indices()
    s.submit(req("w1", 8), 6)
    s.submit(req("w2", 8), 7)
    s.schedule(7)
    victim_node = s.jobs["g"].placement.assignments[0][0]
    d = s.fail_node(s.state.nodes[victim_node].name, 8)
    assert isinstance(d[0], Requeue) and s.jobs["g"].state is JobState.PENDING
    pending_order = [j.job_id for j in s._ordered("h100")]
    assert pending_order[0] == "g"  # requeued jobs go first within their class
    check_invariants(s)


def test_spot_reclamation_requeues_and_marks_node_unavailable():
    s = sched([("h100", 1, 8, 1, "shared", True)])
    s.submit(req("s", 8), 0)
    s.schedule(0)
    d = s.fail_node("g0-0", 5, "spot reclamation")
    assert isinstance(d[0], Requeue) and "spot" in d[0].reason
    assert not s.schedule(6) and s.state.capacity["h100"] == 0
    s.restore_node("g0-0")
    assert "s" in starts(s.schedule(7))
