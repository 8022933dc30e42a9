"""The simulator's `las` policy: a Tiresias-style discretized two-dimensional least-attained-service scheduler
(Gu et al., "Tiresias: A GPU Cluster Manager for Distributed Deep Learning", NSDI'19), the replays' baseline that
needs no runtime estimate: it orders jobs by what they have already received, not by what they will need.

What is modelled (the paper's Discretized 2D-LAS, on the same cluster state and bookkeeping as the other
policies: a subclass of the policy `Scheduler`, only the pass differs):
- Attained service = GPUs x time run, summed over all of a job's runs (the "2D": width and length).
- `thresholds_gpu_s` cut it into queues (Q0 below the first threshold, ...); a job moves down a queue as its
  service crosses a threshold. Order: queue first, then arrival (FIFO inside a queue, as the paper's
  discretization does to avoid the time-sharing of plain LAS).
- Waiting jobs take free GPUs in that order (one that does not fit is passed over). Preemptive across queues: a
  waiting job preempts running jobs of a later queue, from the back of the order first, only as many as its
  placement needs (checkpoint on notice, within the grace period). No preemption inside a queue: FIFO there is
  what keeps the discretized LAS from time-slicing.
- Starvation (the paper's PROMOTE knob): a waiting job that has waited `promote_knob` x its last run's length
  goes back to Q0, its service counted from zero again.
- Not modelled: the paper's placement profiles (skew-based consolidation); placement is trainforge's topology-
  aware `find_placement`, as for every policy. Elastic jobs run at their full size. Priority classes are not read
  (Tiresias has none).
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass

from trainforge.infra.scheduler.model import (
    Decision,
    Job,
    JobState,
    Placement,
    Preempt,
    SchedulerConfig,
    TeamPolicy,
)
from trainforge.infra.scheduler.placement import find_placement
from trainforge.infra.scheduler.policy import Scheduler
from trainforge.infra.scheduler.state import ClusterState


@dataclass(frozen=True, slots=True, kw_only=True)
class LasSettings:
    thresholds_gpu_s: tuple[float, ...] = (3600.0,)
    """Queue boundaries in GPU-seconds of attained service: two queues, split at one GPU-hour. The paper reports
    that two queues capture most of the gain; the threshold is ours, not tuned to any trace."""
    promote_knob: float = 8.0
    """A waiting job returns to Q0 after waiting this many times its last run's length (0 = never)."""


class LasModel(Scheduler):
    def __init__(self, state: ClusterState, teams: dict[str, TeamPolicy] | None = None,
                 config: SchedulerConfig | None = None, *, settings: LasSettings | None = None):
        super().__init__(state, teams, config)
        self.settings = settings or LasSettings()
        self.served: dict[str, float] = {}
        """job id -> GPU-seconds of its ended runs."""
        self._last_run: dict[str, float] = {}
        self._queued_since: dict[str, float] = {}
        # Both orders are kept sorted as jobs move, never rebuilt in a pass: (queue, submit time, seq, job id).
        # A waiting job's service does not change; a running job's queue changes at known times (`_crossings`).
        self._order: dict[str, list[tuple[int, float, int, str]]] = {}
        """class -> pending jobs."""
        self._key_of: dict[str, tuple[int, float, int, str]] = {}
        self._running_order: dict[str, list[tuple[int, float, int, str]]] = {}
        """class -> running jobs (not those already stopping)."""
        self._rkey: dict[str, tuple[int, float, int, str]] = {}
        self._crossings: list[tuple[float, str, int]] = []
        """(time, job id, queue): when a running job's service crosses into that queue."""
        self._promotions: list[tuple[float, str]] = []
        self._clock = 0.0

    # -- attained service ---------------------------------------------------------------------------------
    def attained(self, job: Job, now: float) -> float:
        running = job.placement is not None and not math.isnan(job.start_time)
        return self.served.get(job.job_id, 0.0) + (job.gpus * (now - job.start_time) if running else 0.0)

    def queue(self, job: Job, now: float) -> int:
        if job.placement is None and self.settings.promote_knob > 0:
            last = self._last_run.get(job.job_id, 0.0)
            waited = now - self._queued_since.get(job.job_id, job.submit_time)
            if last > 0 and waited >= self.settings.promote_knob * last:
                return 0
        return bisect.bisect_right(self.settings.thresholds_gpu_s, self.attained(job, now))

    # -- keeping the orders -------------------------------------------------------------------------------
    @staticmethod
    def _remove(lst: list | None, key: tuple | None) -> None:
        if key is None or not lst:
            return
        i = bisect.bisect_left(lst, key)
        if i < len(lst) and lst[i] == key:
            del lst[i]

    def _enqueue(self, job: Job) -> None:
        super()._enqueue(job)
        q = bisect.bisect_right(self.settings.thresholds_gpu_s, self.served.get(job.job_id, 0.0))
        self._insert(job, q)
        last = self._last_run.get(job.job_id, 0.0)
        if q and last > 0 and self.settings.promote_knob > 0:
            heapq.heappush(self._promotions, (self._clock + self.settings.promote_knob * last, job.job_id))

    def _insert(self, job: Job, q: int) -> None:
        key = (q, job.submit_time, job.seq, job.job_id)
        self._key_of[job.job_id] = key
        bisect.insort(self._order.setdefault(job.req.gpu_type, []), key)

    def _dequeue(self, job: Job) -> None:
        super()._dequeue(job)
        self._remove(self._order.get(job.req.gpu_type), self._key_of.pop(job.job_id, None))

    def _place(self, job: Job, pl: Placement, now: float, decisions: list[Decision]) -> None:
        super()._place(job, pl, now, decisions)
        served = self.served.get(job.job_id, 0.0)
        th = self.settings.thresholds_gpu_s
        q = bisect.bisect_right(th, served)
        key = (q, job.submit_time, job.seq, job.job_id)
        self._rkey[job.job_id] = key
        bisect.insort(self._running_order.setdefault(job.req.gpu_type, []), key)
        if q < len(th) and job.gpus:
            heapq.heappush(self._crossings, (now + (th[q] - served) / job.gpus, job.job_id, q + 1))

    def _signal(self, v: Job, deadline: float) -> None:
        self._remove(self._running_order.get(v.req.gpu_type), self._rkey.pop(v.job_id, None))
        super()._signal(v, deadline)

    def _unplace(self, job: Job) -> None:
        if job.placement is not None and not math.isnan(job.start_time):
            ran = max(0.0, self._clock - job.start_time)
            self.served[job.job_id] = self.served.get(job.job_id, 0.0) + job.gpus * ran
            self._last_run[job.job_id] = ran
            self._queued_since[job.job_id] = self._clock
        self._remove(self._running_order.get(job.req.gpu_type), self._rkey.pop(job.job_id, None))
        super()._unplace(job)

    def _advance(self, now: float) -> None:
        """Move the running jobs whose service crossed a threshold by now; re-queue the starved waiting jobs."""
        th = self.settings.thresholds_gpu_s
        while self._crossings and self._crossings[0][0] <= now:
            t, job_id, q = heapq.heappop(self._crossings)
            key = self._rkey.get(job_id)
            if key is None or key[0] != q - 1:
                continue  # it stopped since (a new run pushes its own crossing)
            job = self.jobs[job_id]
            lst = self._running_order[job.req.gpu_type]
            self._remove(lst, key)
            self._rkey[job_id] = new = (q, *key[1:])
            bisect.insort(lst, new)
            if q < len(th) and job.gpus:
                heapq.heappush(self._crossings, (t + (th[q] - th[q - 1]) / job.gpus, job_id, q + 1))
        while self._promotions and self._promotions[0][0] <= now:
            _, job_id = heapq.heappop(self._promotions)
            job = self.jobs.get(job_id)
            key = self._key_of.get(job_id)
            if job is None or job.state is not JobState.PENDING or key is None or key[0] == 0:
                continue
            self._remove(self._order[job.req.gpu_type], self._key_of.pop(job_id))
            self.served[job_id] = 0.0  # it starts over in Q0: else, running, it is Q1 again at once and two
            self._insert(job, 0)  # promoted jobs preempt each other back and forth

    def finish(self, job_id: str, now: float) -> None:
        self._clock = now
        super().finish(job_id, now)
        self.served.pop(job_id, None)
        self._last_run.pop(job_id, None)
        self._queued_since.pop(job_id, None)

    def stopped(self, job_id: str, now: float) -> None:
        self._clock = now
        super().stopped(job_id, now)

    def fail_node(self, name: str, now: float, reason: str = "node failure") -> list[Decision]:
        self._clock = now
        return super().fail_node(name, now, reason)

    # -- the pass -----------------------------------------------------------------------------------------
    def schedule(self, now: float) -> list[Decision]:
        self._clock = now
        self._advance(now)
        return super().schedule(now)

    def _pass(self, cls: str, now: float, decisions: list[Decision]) -> None:
        order = self._order.get(cls)
        if not order:
            return
        types = self.class_types(cls)
        jobs, nodes, earmarked = self.jobs, self.state.nodes, self._earmarked
        free = sum(n.free for n in nodes if n.healthy and n.gpu_type in types and n.idx not in earmarked)
        # 1. Waiting jobs in (queue, arrival) order take the free GPUs; one that does not fit is passed over (at
        # most `backfill_depth` of them, so that the pass stays bounded however long the queue).
        skipped = i = 0
        while i < len(order) and free > 0 and skipped <= self.config.backfill_depth:
            job = jobs[order[i][3]]
            if job.planned is None and job.req.num_gpus <= free and self._start(job, types, now, decisions):
                free -= job.req.num_gpus  # it left `order`: the next one is at i now
                continue
            skipped += job.planned is None
            i += 1
        # 2. A waiting job (of the first `backfill_depth`) preempts running jobs of a later queue (more served),
        # from the back of the order. Inside one queue there is no preemption: FIFO there is what keeps the
        # discretized LAS from time-slicing.
        running = self._running_order.get(cls)
        if not running or not order or order[0][0] >= running[-1][0]:
            return
        failed = math.inf  # the smallest job no eviction could place: larger ones are not tried this pass
        evictable: list[Job] = []  # from the back of the order; built once a pass, victims dropped as taken
        built_for = running[-1][0]
        for key in list(order[:self.config.backfill_depth]):
            if key[0] >= running[-1][0]:
                break
            job = jobs[key[3]]
            if job.planned is not None or job.req.num_gpus >= failed:
                continue
            if not evictable or built_for != key[0]:
                built_for = key[0]
                evictable = []
                for rk in reversed(running):
                    if rk[0] <= key[0]:
                        break
                    evictable.append(jobs[rk[3]])
            left = self._evict_for(job, types, now, decisions, evictable)
            if left is None:
                failed = job.req.num_gpus
            else:
                evictable = left
            if not evictable:
                break

    def _placement(self, job: Job, types: tuple[str, ...]) -> Placement | None:
        req = job.req
        blocked = self._blocked(req.job_id)
        for t in types:
            if self.state.free_in(t, self.state.pools) < req.num_gpus:
                continue
            pl = find_placement(self.state, t, req.num_gpus, tp=req.tp, pp=req.pp, gpus_per_node=req.gpus_per_node,
                                pools=self.state.pools, blocked=blocked)
            if pl is not None:
                return pl
        return None

    def _start(self, job: Job, types: tuple[str, ...], now: float, decisions: list[Decision]) -> bool:
        pl = self._placement(job, types)
        if pl is None:
            return False
        self._place(job, pl, now, decisions)
        return True

    def _evict_for(self, job: Job, types: tuple[str, ...], now: float, decisions: list[Decision],
                   evictable: list[Job]) -> list[Job] | None:
        """Preempt `evictable` (in its order) until `job` can be placed; the victims not
        holding any of the planned GPUs are not needed and keep running. Returns the jobs still evictable, or None
        when no eviction places it."""
        earmarked = self._earmarked
        nodes = self.state.nodes
        # GPUs on nodes no other plan holds: only those can place the job, so placement is tried only once enough
        # of them are free (a node-by-node search per victim would make the pass quadratic in the running jobs)
        usable = sum(n.free for n in nodes if n.healthy and n.gpu_type in types and n.idx not in earmarked)
        taken: list[Job] = []
        plan = None
        for v in evictable:
            gain = sum(len(g) for n, g in v.placement.assignments if n not in earmarked)
            if not gain:
                continue
            self.state.release(v.job_id, v.placement.node_indices())
            taken.append(v)
            usable += gain
            if usable >= job.req.num_gpus:
                plan = self._placement(job, types)
                if plan is not None:
                    break
        for v in taken:
            self.state.allocate(v.job_id, v.placement.assignments)
        if plan is None:
            job.reason = f"las: queue {self.queue(job, now)}, waiting for {job.req.num_gpus} GPUs"
            return None
        planned = {(n, g) for n, gpus in plan.assignments for g in gpus}
        victims = [v for v in taken if any((n, g) in planned for n, gpus in v.placement.assignments for g in gpus)]
        if not victims:
            self._place(job, plan, now, decisions)
            return evictable
        deadline = now + self.config.grace_s
        for v in victims:
            self._signal(v, deadline)
            self._victim_of.setdefault(v.job_id, set()).add(job.job_id)
            decisions.append(Preempt(v.job_id, deadline, job.job_id,
                                     f"las: {job.job_id} has less attained service (queue {self.queue(job, now)})"))
        job.planned = plan
        job.waiting_on = frozenset(v.job_id for v in victims)
        job.reason = f"las: preempting {len(victims)} more-served job(s)"
        for n in plan.node_indices():
            self._earmarked[n] = job.job_id
        return evictable[evictable.index(taken[-1]) + 1:] + [v for v in taken if v not in victims]

    def next_wakeup(self, now: float) -> float:
        """Besides the base policy's times, while jobs wait: when a running job's service next crosses a queue
        threshold (its place in the order drops), and when a waiting job's promotion comes due (both may be stale:
        a pass then finds nothing to do)."""
        best = super().next_wakeup(now)
        if not any(self._pending_count.values()):
            return best
        for heap in (self._crossings, self._promotions):
            if heap and heap[0][0] > now:
                best = min(best, heap[0][0])
        return best
