"""The flood scenario of docs/scheduler.md ("No gang starves"), shared by its tests and bench/scheduler_flood.py.

One team keeps the cluster full for two days with 1-8 GPU jobs (0.5-4 h, a share of them `high`); an idle team of
equal weight submits one `normal` gang an hour in. The gang's wait, against the bound (`gang_bound_s`) and
against FIFO, is what a team that is not the biggest gets from the scheduler.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from trainforge.infra.scheduler.model import TeamPolicy
from trainforge.infra.scheduler.state import NodeInfo
from trainforge.infra.simulator.engine import SimConfig, Simulation
from trainforge.infra.simulator.traces import DEFAULT_CHECKPOINT_S, Trace, TraceJob

H = 3600.0


def flood_nodes(num_nodes: int, per_node: int = 8, gpu_type: str = "h100") -> list[NodeInfo]:
    """`num_nodes` nodes of `per_node` GPUs, four to a rack."""
    return [NodeInfo(f"n{i}", gpu_type, per_node, f"r{i // 4}") for i in range(num_nodes)]


def flood_trace(seed: int = 0, *, days: float = 2.0, every_s: float = 300.0, high_fraction: float = 0.0,
                checkpoint_interval_s: float = DEFAULT_CHECKPOINT_S, team: str = "flood") -> list[TraceJob]:
    """Team `team` submits 1-8 GPU jobs (0.5-4 h) every `every_s` on average for `days`; each is `high` with
    probability `high_fraction` (the same jobs, sizes and times for every fraction of one seed)."""
    rng = random.Random(seed)
    marks = random.Random(seed + 1_000_003)  # its own stream: the fraction changes priorities, nothing else
    jobs, t, i = [], 0.0, 0
    while t < days * 86400:
        high = marks.random() < high_fraction
        jobs.append(TraceJob(job_id=f"f{i}", submit_s=t, team=team, priority="high" if high else "normal",
                             gpu_type="h100", num_gpus=rng.choice([1, 2, 4, 8]), duration_s=rng.uniform(0.5, 4) * H,
                             checkpoint_interval_s=checkpoint_interval_s))
        t += rng.expovariate(1 / every_s)
        i += 1
    return jobs


@dataclass(frozen=True, slots=True)
class GangRun:
    wait_s: float
    preemptions: int
    lost_to_preemption_gpu_s: float
    kills: int


def gang_wait(policy: str, jobs: list[TraceJob], nodes: list[NodeInfo], *, patience_s: float = H,
              grace_s: float = 120.0) -> tuple[GangRun, Simulation]:
    """Run the trace (which holds job `gang` of team `gang`) under `policy`; the gang's wait from its submission."""
    teams = {"flood": TeamPolicy(weight=1.0), "gang": TeamPolicy(weight=1.0)}
    sim = Simulation(nodes, Trace(sorted(jobs, key=lambda j: j.submit_s), "flood"),
                     SimConfig(policy=policy, teams=teams, patience_s=patience_s, grace_s=grace_s))
    sim.run()
    r = sim.runs["gang"]
    stats = getattr(sim.sched, "stats", {})
    return GangRun(r.first_start - r.submit, stats.get("preemptions", 0), sim.lost["preemption"],
                   stats.get("kills", 0)), sim


def gang(num_gpus: int, *, submit_s: float = H, duration_s: float = 4 * H,
         checkpoint_interval_s: float = DEFAULT_CHECKPOINT_S) -> TraceJob:
    """The idle team's one `normal` gang."""
    return TraceJob(job_id="gang", submit_s=submit_s, team="gang", priority="normal", gpu_type="h100",
                    num_gpus=num_gpus, duration_s=duration_s, checkpoint_interval_s=checkpoint_interval_s)


def gang_bound_s(patience_s: float, longest_interval_s: float, grace_s: float) -> float:
    """docs/scheduler.md's bound on a reserved gang's wait: its patience, then the victims' next checkpoint
    boundary (at most their longest interval away), then their grace period."""
    return patience_s + longest_interval_s + grace_s
