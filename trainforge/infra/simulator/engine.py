"""Discrete-event cluster simulator driving the same policy code as the live scheduler.

Jobs carry work in GPU-seconds (duration x GPUs), done at a rate of the GPUs they hold, so elastic resizing
stretches or shortens them. Jobs checkpoint every `checkpoint_interval_s` of a segment: a node failure or spot
reclamation loses the work since the last checkpoint; a preemption victim checkpoints on notice
(`checkpoint_write_s`) and stops inside its grace period, losing nothing, unless the write does not fit the grace.
Allocated GPU-seconds are booked per team, GPU type and market (spot nodes vs on-demand) for the report's cost.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainforge.infra.scheduler.estimates import RuntimeHistory
from trainforge.infra.scheduler.model import POLICIES as SCHEDULER_POLICIES
from trainforge.infra.scheduler.model import (
    Decision,
    Job,
    JobRequest,
    JobState,
    Kill,
    Placement,
    Preempt,
    Requeue,
    Resize,
    SchedulerConfig,
    Start,
    TeamPolicy,
)
from trainforge.infra.scheduler.policy import Scheduler
from trainforge.infra.scheduler.state import ClusterState, NodeInfo
from trainforge.infra.simulator.kueue import KueueModel
from trainforge.infra.simulator.las import LasModel
from trainforge.infra.simulator.report import summarize
from trainforge.infra.simulator.traces import ESTIMATE_FACTOR, Trace, TraceJob

# What `SimConfig.policy` may name: the scheduler policies (infra/scheduler/policy.py), Kueue's admission and the
# Tiresias-style 2D-LAS baseline (simulator only: neither is trainforge's scheduler).
POLICIES = (*SCHEDULER_POLICIES, "kueue", "las")

# event kinds, in processing order at equal times (_TICK: a pass the policy asked for, `next_wakeup`)
# (_CKPT: a job's periodic commit, reported to the policy as the flow does, with SimConfig.live_view)
_FINISH, _STOP, _FAIL, _REPAIR, _SPOT, _SPOT_BACK, _SUBMIT, _CKPT, _TICK = range(9)


@dataclass(frozen=True, slots=True, kw_only=True)
class SimConfig:
    policy: str = "ours"
    """A scheduler policy (`ours`, `fifo`, `fifo-backfill`), `kueue` (Kueue's admission, simulator/kueue.py) or
    `las` (Tiresias' discretized 2D-LAS, simulator/las.py: preemptive, no runtime estimates)."""
    grace_s: float = 120.0
    patience_s: float = 3600.0
    """SchedulerConfig.patience_s: how long a reserved gang waits before it preempts (docs/scheduler.md)."""
    checkpoint_write_s: float = 30.0
    node_mtbf_hours: float | None = None
    """None = no random node failures."""
    repair_s: float = 4 * 3600.0
    spot_every_s: float | None = None
    """A spot reclamation wave every this many seconds (None = none)."""
    spot_fraction: float = 0.5
    spot_duration_s: float = 3600.0
    speedup: float = 1.0
    """Divide submit times by this (compress arrivals to raise the load)."""
    seed: int = 0
    teams: dict[str, TeamPolicy] = field(default_factory=dict)
    estimates: str = "history"
    """Runtime estimates for backfill and reservations: `history` (the user's `max_runtime` where the trace has
    one, else the runtimes of similar jobs that ended, `RuntimeHistory`) or `oracle` (ESTIMATE_FACTOR x the real
    duration: no real scheduler knows it; kept for comparison)."""

    live_view: bool = False
    """What the live scheduler sees (tests/integration/test_live_scheduler_learns.py replays it there): jobs
    declare no checkpoint interval, each commit is reported to the policy as it happens (`Scheduler.checkpointed`,
    as the flow reports them) and the policy learns each job's interval from them; a completed job's runtime is
    learned as the GPU-seconds it held over its requested size (a preempted job's includes its checkpoint writes).
    Off: the policy reads each job's trace interval and computes its last commit (no event per commit), and the
    runtime learned is the trace's duration."""

    def __post_init__(self) -> None:
        if self.estimates not in ESTIMATES:
            raise ValueError(f"unknown estimates {self.estimates!r}; use one of {', '.join(ESTIMATES)}")


ESTIMATES = ("history", "oracle")


@dataclass(slots=True, eq=False)
class _Run:
    tj: TraceJob
    submit: float
    work_left: float
    held: int = 0
    rate: int = 0
    mark: float = 0.0
    seg_start: float = 0.0
    version: int = 0
    first_start: float = math.nan
    signal: float = math.nan
    end: float = math.nan
    alloc: dict[tuple[str, str], int] = field(default_factory=dict)
    """GPUs held now per (GPU type, market), booked into Simulation.gpu_seconds when the allocation changes."""
    alloc_since: float = 0.0
    held_gpu_s: float = 0.0
    """GPU-seconds it has held, over all its runs."""

    def last_checkpoint(self, now: float) -> float:
        i = self.tj.checkpoint_interval_s
        return self.seg_start + math.floor((now - self.seg_start) / i) * i if i > 0 else self.seg_start

    def settle(self, now: float) -> None:
        self.work_left -= (now - self.mark) * self.rate
        self.mark = now


class Simulation:
    def __init__(self, nodes: list[NodeInfo], trace: Trace, config: SimConfig, cluster_name: str = "cluster"):
        self.config = config
        how = ("ORACLE: the real duration x " + str(ESTIMATE_FACTOR) if config.estimates == "oracle" else
               "the trace's max_runtime where given, else learned from the runtimes of ended jobs "
               "(same user, team and size first)")
        self.trace = Trace(trace.jobs, trace.source, trace.notes + [f"runtime estimates for backfill: {how}"])
        self.cluster_name = cluster_name
        self.state = ClusterState(nodes)
        if config.policy == "kueue":  # Kueue's admission (simulator only: on a cluster Kueue's controller does it)
            self.sched: Scheduler = KueueModel(self.state, config.teams,
                                               SchedulerConfig(policy="fifo", grace_s=config.grace_s))
        elif config.policy == "las":  # a baseline from the literature, not a scheduler trainforge runs
            self.sched = LasModel(self.state, config.teams, SchedulerConfig(policy="fifo", grace_s=config.grace_s))
        else:
            self.sched = Scheduler(self.state, config.teams, SchedulerConfig(
                policy=config.policy, grace_s=config.grace_s, patience_s=config.patience_s))
        if not config.live_view:
            self.sched.checkpoint_clock = self._ckpt_clock
        self.rng = random.Random(config.seed)
        self.history = RuntimeHistory()
        self.runs: dict[str, _Run] = {}
        self.events: list[tuple[float, int, int, Any]] = []
        self._n = 0
        self.busy = 0
        self.busy_integral = 0.0
        self.arrival_integral: float | None = None
        self.now = 0.0
        self.latencies: list[float] = []
        self.lost = {"failure": 0.0, "preemption": 0.0}
        self.preemptions: list[tuple[str, str, str | None]] = []
        """(victim, the job it stopped for, the policy's rule) of every preemption, in order."""
        self.gpu_seconds: dict[tuple[str, str, str], float] = defaultdict(float)
        """Allocated GPU-seconds per (team, GPU type, market): what the cluster would bill; sums to busy_integral."""
        self.counts = {"node_failures": 0, "spot_reclaims": 0, "rejected": 0}
        self.rejected: list[str] = []
        self.journal: list[tuple[float, str, Any]] | None = None
        """Set to a list to keep every event the policy was told, in order: (time, kind, what), kind one of
        submit (the TraceJob), finish, stop, checkpoint (a job id), fail, restore (a node name) and pass (a pass
        no event asked for: the live scheduler's requesters poll). A live scheduler told the same replays it."""

    def _ckpt_clock(self, job: Job, now: float) -> float:
        return self.runs[job.job_id].last_checkpoint(now)

    def _push(self, t: float, kind: int, payload: Any) -> None:
        self._n += 1
        heapq.heappush(self.events, (t, kind, self._n, payload))

    # -- run ----------------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        wall = time.perf_counter()
        cfg = self.config
        for tj in self.trace.jobs:
            self._push(tj.submit_s / cfg.speedup, _SUBMIT, tj)
        self.last_submit = max((tj.submit_s / cfg.speedup for tj in self.trace.jobs), default=0.0)
        self.t0 = min((tj.submit_s / cfg.speedup for tj in self.trace.jobs), default=0.0)
        self.now = self.t0
        if cfg.node_mtbf_hours:
            self._push(self.t0 + self._next_failure(), _FAIL, None)
        if cfg.spot_every_s and any(n.spot for n in self.state.nodes):
            self._push(self.t0 + cfg.spot_every_s, _SPOT, None)
        handlers: dict[int, Callable[[Any], None]] = {
            _FINISH: self._on_finish, _STOP: self._on_stop, _FAIL: self._on_fail, _REPAIR: self._on_repair,
            _SPOT: self._on_spot, _SPOT_BACK: self._on_spot_back, _SUBMIT: self._on_submit,
            _CKPT: self._on_checkpoint, _TICK: lambda _: self._note("pass", None)}
        ticks: set[float] = set()
        events = self.events
        while events:
            t = events[0][0]
            if self.arrival_integral is None and t >= self.last_submit:
                self.arrival_integral = self.busy_integral + self.busy * (self.last_submit - self.now)
            self.busy_integral += self.busy * (t - self.now)
            self.now = t
            while events and events[0][0] == t:
                _, kind, _, payload = heapq.heappop(events)
                handlers[kind](payload)
            if not self._active():
                continue
            t1 = time.perf_counter()
            decisions = self.sched.schedule(t)
            self.latencies.append(time.perf_counter() - t1)
            self._apply(decisions)
            wake = self.sched.next_wakeup(t)
            if math.isfinite(wake) and wake not in ticks:
                ticks.add(wake)
                self._push(wake, _TICK, None)
        return summarize(self, time.perf_counter() - wall)

    def _note(self, kind: str, what: Any) -> None:
        if self.journal is not None:
            self.journal.append((self.now, kind, what))

    def _active(self) -> bool:
        return bool(self.sched.jobs)

    def _next_failure(self) -> float:
        healthy = sum(n.healthy for n in self.state.nodes) or 1
        return self.rng.expovariate(healthy / (self.config.node_mtbf_hours * 3600))

    # -- events -------------------------------------------------------------------------------------------
    def _on_submit(self, tj: TraceJob) -> None:
        if tj.estimate_s is not None:
            estimate = tj.estimate_s
        elif self.config.estimates == "oracle":
            estimate = tj.duration_s * ESTIMATE_FACTOR
        else:
            estimate = self.history.estimate(team=tj.team, user=tj.user, num_gpus=tj.num_gpus,
                                             max_runtime_s=tj.max_runtime_s)
        declared = None if self.config.live_view else tj.checkpoint_interval_s
        req = JobRequest(job_id=tj.job_id, team=tj.team, priority=tj.priority, gpu_type=tj.gpu_type,
                         num_gpus=tj.num_gpus, min_gpus=tj.min_gpus, tp=tj.tp, pp=tj.pp,
                         max_runtime_s=estimate, checkpoint_interval_s=declared, user=tj.user)
        self._note("submit", tj)
        try:
            self.sched.submit(req, self.now)
        except ValueError as exc:
            self.counts["rejected"] += 1
            self.rejected.append(str(exc))
            return
        self.runs[tj.job_id] = _Run(tj, self.now, tj.duration_s * tj.num_gpus)

    def _on_finish(self, payload: tuple[str, int]) -> None:
        job_id, version = payload
        r = self.runs[job_id]
        job = self.sched.jobs.get(job_id)
        # A victim told to stop at its next checkpoint boundary keeps running and may finish before it.
        if r.version != version or job is None or job.state is JobState.PENDING:
            return
        r.settle(self.now)
        self.busy -= r.held
        self._book(r, None)
        r.held = r.rate = 0
        r.end = self.now
        self._note("finish", job_id)
        self.sched.finish(job_id, self.now)
        tj = r.tj  # the platform learns the job's runtime (its work at full size) as it ends
        runtime = r.held_gpu_s / tj.num_gpus if self.config.live_view else tj.duration_s
        self.history.observe(team=tj.team, user=tj.user, num_gpus=tj.num_gpus, runtime_s=runtime)

    def _on_stop(self, payload: tuple[str, int]) -> None:
        job_id, version = payload
        r = self.runs[job_id]
        job = self.sched.jobs.get(job_id)
        if r.version != version or job is None or job.state is not JobState.PREEMPTING:
            return
        if r.rate:  # it trained on until its checkpoint boundary
            r.settle(r.signal)
            r.rate = 0
        self.busy -= r.held
        self._book(r, None)
        r.held = 0
        self._note("stop", job_id)
        self.sched.stopped(job_id, self.now)

    def _on_fail(self, _: Any) -> None:
        healthy = [n for n in self.state.nodes if n.healthy]
        if healthy:
            node = self.rng.choice(healthy)
            self.counts["node_failures"] += 1
            self._fail(node.name, "node failure")
            self._push(self.now + self.config.repair_s, _REPAIR, node.name)
        if self._active() or self.now < self.last_submit:
            self._push(self.now + self._next_failure(), _FAIL, None)

    def _fail(self, name: str, reason: str) -> None:
        self._note("fail", name)
        t1 = time.perf_counter()
        decisions = self.sched.fail_node(name, self.now, reason)
        self.latencies.append(time.perf_counter() - t1)
        self._apply(decisions)

    def _on_repair(self, name: str) -> None:
        self._note("restore", name)
        self.sched.restore_node(name)

    def _on_spot(self, _: Any) -> None:
        spot = [n for n in self.state.nodes if n.spot and n.healthy]
        k = int(len(spot) * self.config.spot_fraction)
        names = [n.name for n in self.rng.sample(spot, k)]
        for name in names:
            self.counts["spot_reclaims"] += 1
            self._fail(name, "spot reclamation")
        self._push(self.now + self.config.spot_duration_s, _SPOT_BACK, names)
        if self._active() or self.now < self.last_submit:
            self._push(self.now + self.config.spot_every_s, _SPOT, None)

    def _on_spot_back(self, names: list[str]) -> None:
        for name in names:
            self._note("restore", name)
            self.sched.restore_node(name)

    def _on_checkpoint(self, payload: tuple[str, int]) -> None:
        job_id, version = payload
        r = self.runs[job_id]
        job = self.sched.jobs.get(job_id)
        if r.version != version or job is None or job.state is not JobState.RUNNING:
            return  # the run it belonged to ended (stopped, resized, failed, preempted)
        self._note("checkpoint", job_id)
        self.sched.checkpointed(job_id, self.now)
        self._push(self.now + r.tj.checkpoint_interval_s, _CKPT, payload)

    def _commits(self, r: _Run) -> None:
        """With SimConfig.live_view: the run that starts now commits every interval until it changes."""
        if self.config.live_view and r.tj.checkpoint_interval_s > 0:
            self._push(self.now + r.tj.checkpoint_interval_s, _CKPT, (r.tj.job_id, r.version))

    # -- decisions ----------------------------------------------------------------------------------------
    def _apply(self, decisions: list[Decision]) -> None:
        now = self.now
        for d in decisions:
            r = self.runs[d.job_id]
            if isinstance(d, Start):
                g = d.placement.num_gpus
                self.busy += g
                self._book(r, d.placement)
                r.held = r.rate = g
                r.mark = r.seg_start = now
                r.version += 1
                if math.isnan(r.first_start):
                    r.first_start = now
                self._push(now + max(r.work_left, 0.0) / g, _FINISH, (d.job_id, r.version))
                self._commits(r)
            elif isinstance(d, Preempt):
                self.preemptions.append((d.job_id, d.for_job, d.rule))
                r.settle(now)
                r.version += 1
                write = self.config.checkpoint_write_s
                at = d.at_checkpoint
                if at > now:  # train on to the next checkpoint boundary, stop once that checkpoint is written
                    r.signal = at
                    done_at = now + max(r.work_left, 0.0) / r.rate
                    if done_at <= at:
                        self._push(done_at, _FINISH, (d.job_id, r.version))
                    elif write <= d.deadline - at:
                        self._push(at + write, _STOP, (d.job_id, r.version))
                    continue
                r.signal = now
                r.rate = 0  # checkpointing: no more progress, nothing lost if the write fits the grace period
                if write <= d.deadline - now:
                    self._push(now + write, _STOP, (d.job_id, r.version))
            elif isinstance(d, Kill):  # the grace period ended before the checkpoint was written
                if r.rate:
                    r.settle(min(now, r.signal))
                    r.rate = 0
                lost = (r.signal - r.last_checkpoint(r.signal)) * r.held
                r.work_left += lost
                self.lost["preemption"] += lost
                self.busy -= r.held
                self._book(r, None)
                r.held = 0
                r.version += 1
            elif isinstance(d, Resize):
                r.settle(now)
                if d.cause == "lost_workers":  # a failure or a spot reclaim: the work since the checkpoint is lost
                    self._lose(r, now, "failure")
                g = d.placement.num_gpus
                self.busy += g - r.held
                self._book(r, d.placement)
                r.held = r.rate = g
                r.seg_start = now
                r.version += 1
                self._push(now + max(r.work_left, 0.0) / g, _FINISH, (d.job_id, r.version))
                self._commits(r)
            elif isinstance(d, Requeue):
                r.settle(now)
                self._lose(r, now, "failure")
                self.busy -= r.held
                self._book(r, None)
                r.held = r.rate = 0
                r.version += 1

    def _book(self, r: _Run, placement: Placement | None) -> None:
        """Close `r`'s current allocation (its GPU-seconds to team, type and market) and open `placement`'s."""
        if r.alloc:
            dt = self.now - r.alloc_since
            for (gpu_type, market), gpus in r.alloc.items():
                self.gpu_seconds[(r.tj.team, gpu_type, market)] += gpus * dt
                r.held_gpu_s += gpus * dt
        r.alloc = {}
        r.alloc_since = self.now
        if placement is not None:
            nodes = self.state.nodes
            for idx, gpus in placement.assignments:
                key = (nodes[idx].gpu_type, "spot" if nodes[idx].spot else "on_demand")
                r.alloc[key] = r.alloc.get(key, 0) + len(gpus)

    def _lose(self, r: _Run, now: float, cause: str) -> None:
        lost = (now - r.last_checkpoint(now)) * r.rate if r.rate else 0.0
        r.work_left += lost
        self.lost[cause] += lost
