"""The live path learns as the simulator does, and decides the same: a simulation in the live view
(`SimConfig(live_view=True)`: commits reported as events, runtimes measured as GPU-seconds held) is replayed event
by event into the live scheduler on PostgreSQL, on the simulation's clock, and after every instant the two hold the
same jobs in the same states, on the same GPUs, with the same runtime estimates, preemption deadlines and
checkpoint boundaries. Halfway through, the live scheduler is replaced by a fresh one on the same database (a
restart of the control plane): what it learned (runtimes, checkpoint intervals) is read back from there.

The scenario: a team floods 32 GPUs with 1-8 GPU jobs of three users (some with a `max_runtime` limit); a second
team's 32-GPU gang arrives an hour in, holds a standing reservation, waits past its patience and preempts the
flood's jobs at their next checkpoint boundary, an interval the scheduler learned from their commits.

Run: pytest tests/integration/test_live_scheduler_learns.py
"""

from __future__ import annotations

import math
import random
from itertools import groupby
from typing import Any

import pytest

from trainforge.infra.scheduler.live import GangRequest, LiveScheduler
from trainforge.infra.scheduler.model import JobState, SchedulerConfig
from trainforge.infra.scheduler.policy import Scheduler
from trainforge.infra.scheduler.state import nodes_from_spec
from trainforge.infra.simulator.engine import SimConfig, Simulation
from trainforge.infra.simulator.traces import Trace, TraceJob
from trainforge.plan.cluster import ClusterSpec, NodeGroup

pytestmark = pytest.mark.slow

H = 3600.0
GRACE_S, PATIENCE_S = 120.0, 3600.0
# The live scheduler's cluster and the simulation's nodes, made from it: 4 nodes of 8 GPUs in one rack.
CLUSTER = ClusterSpec(name="learns", node_groups=[
    NodeGroup(name="n", gpu_type="h100", nodes=4, gpus_per_node=8, nodes_per_rack=4)])
NODES = nodes_from_spec(CLUSTER)


def scenario(seed: int = 0) -> list[TraceJob]:
    rng = random.Random(seed)
    jobs, t, i = [], 0.0, 0
    while t < 10 * H:
        user = f"u{rng.randrange(3)}"
        jobs.append(TraceJob(
            job_id=f"f{i}", submit_s=t, team="flood", user=user, priority="normal", gpu_type="h100",
            num_gpus=rng.choice([1, 2, 4, 8]), duration_s=rng.uniform(0.5, 2.5) * H,
            checkpoint_interval_s=rng.choice([900.0, 1200.0, 1800.0]),
            max_runtime_s=3 * H if user == "u2" else None))
        t += rng.expovariate(1 / 900)
        i += 1
    jobs.append(TraceJob(job_id="gang", submit_s=1 * H + 17.0, team="small", user="g", priority="normal",
                         gpu_type="h100", num_gpus=32, duration_s=1.5 * H, checkpoint_interval_s=1200.0))
    return sorted(jobs, key=lambda j: j.submit_s)


def snapshot(sched: Scheduler) -> dict[str, tuple[Any, ...]]:
    """What the policy decided, job by job: state, GPUs (node names), the estimate it schedules by, the priority it
    runs at, a victim's deadline and checkpoint boundary, the learned checkpoint interval, why a job waits."""
    names = [n.name for n in sched.state.nodes]

    def r(x: float) -> float | None:
        return None if math.isnan(x) else round(x, 6)

    out = {}
    for job in sched.jobs.values():
        pl = job.placement
        out[job.job_id] = (job.state.value, tuple((names[n], g) for n, g in pl.assignments) if pl else None,
                           round(job.req.max_runtime_s, 6), job.rank,
                           r(job.preempt_deadline) if job.state is JobState.PREEMPTING else None,
                           r(job.preempt_at) if job.state is JobState.PREEMPTING else None,
                           r(job.checkpoint_every), job.reason if job.state is JobState.PENDING else "")
    return out


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def simulate(jobs: list[TraceJob]) -> tuple[Simulation, list[tuple[float, str, Any]]]:
    sim = Simulation(NODES, Trace(jobs, "test"), SimConfig(policy="ours", grace_s=GRACE_S, patience_s=PATIENCE_S,
                                                          live_view=True))
    journal: list[tuple[float, str, Any]] = []
    sim.journal = journal
    schedule = sim.sched.schedule

    def schedule_and_record(now: float):  # after the simulator's one pass per instant: what it decided
        decisions = schedule(now)
        journal.append((now, "state", snapshot(sim.sched)))
        return decisions

    sim.sched.schedule = schedule_and_record  # type: ignore[method-assign]
    sim.run()
    return sim, journal


def live_scheduler(url: str, clock: Clock) -> LiveScheduler:
    return LiveScheduler(CLUSTER, url, config=SchedulerConfig(grace_s=GRACE_S, patience_s=PATIENCE_S),
                         clock=clock, stale_after_s=math.inf)


def replay(url: str, journal: list[tuple[float, str, Any]]) -> int:
    """Tell the live scheduler each instant's events (each of which runs a pass, as the simulator runs one per
    instant), compare with the simulation's state at that instant; returns how many instants were compared."""
    clock = Clock()
    live = live_scheduler(url, clock)
    instants = [(t, list(group)) for t, group in groupby(journal, key=lambda e: e[0])]
    compared = 0
    for k, (t, events) in enumerate(instants):
        if k == len(instants) // 2:
            live = live_scheduler(url, clock)  # a restart of the control plane: all it knows is in the database
        clock.now = t
        expected = None
        for _, kind, what in events:
            if kind == "submit":
                tj: TraceJob = what
                live.submit(GangRequest(job_id=tj.job_id, team=tj.team, user=tj.user, priority=tj.priority,
                                        gpu_type=tj.gpu_type, num_gpus=tj.num_gpus, min_gpus=tj.min_gpus,
                                        tp=tj.tp, pp=tj.pp, max_runtime_s=tj.max_runtime_s))
            elif kind == "finish":
                live.release(what, "completed")
            elif kind == "stop":
                live.release(what, "stopped")
            elif kind == "checkpoint":
                live.checkpointed(what)
            elif kind == "state":
                expected = what
            else:
                assert kind == "pass", kind
        if expected is None:
            continue
        if not any(kind in ("submit", "finish", "stop") for _, kind, _ in events):
            live.schedule()  # no event of this instant ran a pass (a requester's poll would)
        got = snapshot(live.policy())
        assert got == expected, (f"at t={t:.3f} (instant {k} of {len(instants)}): live and simulated decisions "
                                 f"differ:\n" + "\n".join(f"  {j}: live {got.get(j)} sim {expected.get(j)}"
                                                          for j in sorted(got.keys() | expected.keys())
                                                          if got.get(j) != expected.get(j)))
        compared += 1
    return compared


def test_the_live_scheduler_on_postgresql_decides_as_the_simulator_and_learns_across_a_restart(postgres_url):
    jobs = scenario()
    sim, journal = simulate(jobs)
    # The scenario does what it is for: the gang starved and preempted at learned checkpoint boundaries, and
    # runtime estimates came from what was learned (neither a limit nor the default).
    boundary = [(v, f, rule) for v, f, rule in sim.preemptions if f == "gang" and rule == "starving"]
    assert boundary, f"the gang preempted nothing as a starving gang: {sim.preemptions}"
    states = [what for _, kind, what in journal if kind == "state"]
    assert any(s[0] == "preempting" and s[5] is not None and s[6] is not None
               for snap in states for s in snap.values()), "no victim was told a learned checkpoint boundary"
    limits = {tj.max_runtime_s for tj in jobs if tj.max_runtime_s}
    estimates = {snap[j.job_id][2] for snap in states for j in jobs if j.job_id in snap}
    assert estimates - limits - {round(4 * H, 6)}, "no estimate was learned from completed jobs"
    assert sum(kind == "checkpoint" for _, kind, _ in journal) >= 50
    compared = replay(postgres_url, journal)
    assert compared >= 100, compared
