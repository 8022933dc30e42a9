"""Property tests of the scheduler policy over random clusters and queues: no partial gangs, no GPU double-booked,
quotas never exceeded, no job mixing GPU types, TP groups never spanning nodes — through submits, completions,
preemptions, failures and elastic resizes.

Run: pytest tests/unit/scheduler/test_properties.py
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.scheduler.conftest_helpers import check_invariants, make_nodes
from trainforge.infra.scheduler import (
    ClusterState,
    JobRequest,
    JobState,
    Preempt,
    Scheduler,
    SchedulerConfig,
    TeamPolicy,
    find_placement,
)
from trainforge.infra.scheduler.policy import CRITICAL, HIGH, PREEMPTIBLE
from trainforge.infra.simulator.kueue import KueueModel

TYPES = ["h100", "a100-80gb"]
TEAMS = ["a", "b", "c"]

group = st.tuples(st.sampled_from(TYPES), st.integers(1, 6), st.sampled_from([2, 4, 8]), st.integers(1, 3),
                  st.sampled_from(["shared", "shared", "a"]), st.booleans())


@st.composite
def job(draw, i: int) -> JobRequest:
    tp = draw(st.sampled_from([1, 1, 2, 4]))
    pp = draw(st.sampled_from([1, 1, 2]))
    dp = draw(st.integers(1, 6))
    n = tp * pp * dp
    elastic = draw(st.booleans()) and dp > 1
    return JobRequest(job_id=f"j{i}", team=draw(st.sampled_from(TEAMS)),
                      priority=draw(st.sampled_from(["critical", "high", "normal", "low", "preemptible"])),
                      gpu_type=draw(st.sampled_from(TYPES + ["any"])), num_gpus=n, tp=tp, pp=pp,
                      min_gpus=tp * pp if elastic else None, max_runtime_s=draw(st.sampled_from([60, 600, 6000])))


@st.composite
def scenario(draw):
    groups = draw(st.lists(group, min_size=1, max_size=3))
    nodes = make_nodes(groups)
    jobs = [draw(job(i)) for i in range(draw(st.integers(1, 25)))]
    ops = draw(st.lists(st.tuples(st.sampled_from(["finish", "stop", "fail", "restore", "tick"]),
                                  st.integers(0, 1000)), max_size=30))
    policy = draw(st.sampled_from(["ours", "ours", "fifo", "fifo-backfill", "kueue"]))
    quota = draw(st.sampled_from([{}, {"h100": 8}, {"*": 12}]))
    critical_quota = draw(st.sampled_from([None, 0, 8]))  # None: 10% of the cluster (often less than one job)
    return nodes, jobs, ops, policy, quota, critical_quota


def check_preemption_rule(d: Preempt, v, g, now: float) -> None:
    """The rule the decision names is one the policy has, and its conditions on priorities and teams hold (the
    shares it also depends on are the pass's, tested by the scenarios of test_starvation.py)."""
    same = v.req.team == g.req.team
    assert v.rank != CRITICAL or d.rule == "pool", (d, v.req, g.req)  # critical within quota: nobody else's
    assert g.rank != PREEMPTIBLE or same or d.rule == "pool", (d, v.req, g.req)  # preemptible work takes nothing
    if d.rule == "pool":
        assert g.req.team in v.borrowed_from, (d, v.req, g.req)
    elif d.rule == "own-team":
        assert same and v.rank < g.rank, (d, v.req, g.req)
    elif d.rule == "preemptible":
        assert v.rank == PREEMPTIBLE < g.rank and not same, (d, v.req, g.req)
    elif d.rule == "critical":
        assert g.rank == CRITICAL and not same, (d, v.req, g.req)
    elif d.rule == "fair-share":
        assert not same and v.rank < g.rank, (d, v.req, g.req)
    else:
        assert d.rule == "starving" and not same and g.reserved_since <= now, (d, v.req, g.req)


def check_critical_quota(s: Scheduler) -> None:
    """A team's jobs scheduled as critical never ask for more than its critical quota; the rest run as high."""
    for team in {j.req.team for j in s.jobs.values()}:
        asked = sum(j.req.num_gpus for j in s.jobs.values() if j.req.team == team and j.rank == CRITICAL)
        assert asked <= s.critical_quota(team), (team, asked)
    for j in s.jobs.values():
        assert j.rank == j.req.rank or (j.req.priority == "critical" and j.rank == HIGH), (j.req, j.rank)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario())
def test_invariants_hold_through_random_events(sc):
    nodes, jobs, ops, policy, quota, critical_quota = sc
    teams = {"a": TeamPolicy(critical_quota=critical_quota), "b": TeamPolicy(weight=2.0, quota=quota)}
    if policy == "kueue":  # the simulator's model of Kueue's admission: its own preemption rules, same invariants
        s = KueueModel(ClusterState(nodes), teams, SchedulerConfig(policy="fifo"))
    else:
        s = Scheduler(ClusterState(nodes), teams, SchedulerConfig(policy=policy))
    now = 0.0
    for req in jobs:
        try:
            s.submit(req, now)
        except ValueError:
            continue  # bigger than the cluster / tp larger than its nodes: rejected up front
        for d in s.schedule(now):
            if isinstance(d, Preempt) and policy != "kueue":
                check_preemption_rule(d, s.jobs[d.job_id], s.jobs[d.for_job], now)
        check_invariants(s)
        if policy == "ours":
            check_critical_quota(s)
    for op, k in ops:
        now += 10
        ids = sorted(s.jobs)
        if op == "finish" and ids:
            s.finish(ids[k % len(ids)], now)
        elif op == "stop":
            for j in [j for j in s.jobs.values() if j.state is JobState.PREEMPTING][:1]:
                s.stopped(j.job_id, now)
        elif op == "fail":
            s.fail_node(s.state.nodes[k % len(s.state.nodes)].name, now)
        elif op == "restore":
            s.restore_node(s.state.nodes[k % len(s.state.nodes)].name)
        elif op == "tick":
            now += 1000
        for d in s.schedule(now):
            if isinstance(d, Preempt) and policy != "kueue":
                check_preemption_rule(d, s.jobs[d.job_id], s.jobs[d.for_job], now)
        check_invariants(s)
        if policy == "ours":
            check_critical_quota(s)


@settings(max_examples=200, deadline=None)
@given(st.lists(group, min_size=1, max_size=3), st.sampled_from([1, 2, 4, 8]), st.integers(1, 8),
       st.lists(st.tuples(st.integers(0, 100), st.integers(1, 8)), max_size=20))
def test_tp_never_spans_nodes_when_a_valid_placement_exists(groups, tp, dp, prefill):
    """Brute force: if some set of nodes has tp-aligned room for the gang, placement finds one with 0 spans."""
    state = ClusterState(make_nodes(groups))
    for i, (n, g) in enumerate(prefill):  # random fragmentation
        node = state.nodes[n % len(state.nodes)]
        take = min(g, node.free)
        if take:
            free = [b for b in range(node.num_gpus) if node.free_mask >> b & 1][:take]
            state.allocate(f"x{i}", [(node.idx, tuple(free))])
    num = tp * dp
    for t in TYPES:
        pl = find_placement(state, t, num, tp=tp, pools=state.pools)
        # a valid placement exists iff for some g (multiple of tp dividing num, <= node size) enough nodes have g free
        sizes = [nd.num_gpus for nd in state.nodes if nd.gpu_type == t]
        exists = any(num % g == 0 and g % tp == 0 and g <= max(sizes, default=0)
                     and sum(nd.free >= g for nd in state.nodes if nd.gpu_type == t) >= num // g
                     for g in range(1, num + 1)) if sizes else False
        if pl is not None:
            assert pl.quality.tp_groups_spanning_nodes == 0
            assert pl.num_gpus == num and {state.nodes[n].gpu_type for n, _ in pl.assignments} == {t}
        elif exists:
            # placement only tries the 3 largest per-node counts; those must all be infeasible
            cands = [g for g in range(min(num, max(sizes)), 0, -1) if num % g == 0 and g % tp == 0][:3]
            assert not any(sum(nd.free >= g for nd in state.nodes if nd.gpu_type == t) >= num // g for g in cands)
