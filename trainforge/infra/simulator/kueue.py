"""The simulator's `kueue` policy: Kueue's admission as trainforge renders it (`infra/k8s/kueue.py`), so that the
replays and the starvation scenario can be run against what a Kubernetes cluster would do. No Kueue controller
runs here: this models its documented quota and preemption rules, on the same cluster state and bookkeeping as
the other policies (a subclass of the policy `Scheduler`: only admission and preemption differ).

What is modelled:
- One ClusterQueue per team in one cohort; per GPU type (the flavor) a nominal quota in whole nodes, shared by
  fair-share weight with `kueue.apportion` (the renderer's own function), a borrowing limit of cap - nominal for
  a team with a hard quota, no lending limit. A team the cluster does not list gets a queue when it first
  submits (the admin re-renders; the quotas are re-apportioned).
- Quota check: a workload is admitted on a flavor when the cohort has the GPUs unused and the team stays within
  nominal + borrowing limit; then topology-aware placement (`find_placement`) must also find the nodes.
- Order (`queueingStrategy: BestEffortFIFO`, fair sharing on): workloads of the ClusterQueue with the lowest share
  after admission first, then priority, then creation; a workload that does not fit never blocks the next.
  Share = GPUs borrowed above nominal / the flavor's GPUs / weight (Kueue's dominant resource share).
- Preemption (`PREEMPTION`, the rendered `spec.preemption`): `withinClusterQueue: LowerPriority` (own lower-priority
  workloads); `reclaimWithinCohort: Any` (a workload that fits its queue's nominal quota evicts workloads of
  queues that borrow, whatever their priority); fair-sharing preemption `LessThanOrEqualToFinalShare` among
  borrowing queues; `borrowWithinCohort: Never`. Victims are evicted at once: checkpoint on notice within the
  grace period (the pods' SIGTERM), no wait for a checkpoint boundary.
- Not modelled: admission checks, partial admission, flavor fungibility beyond "first flavor that fits",
  `waitForPodsReady`, the exact order of Kueue's cycles inside one pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainforge.infra.k8s.kueue import PREEMPTION, apportion
from trainforge.infra.scheduler.model import (
    SHARED_POOL,
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
class KueueSettings:
    within_cluster_queue: str = PREEMPTION["withinClusterQueue"]
    reclaim_within_cohort: str = PREEMPTION["reclaimWithinCohort"]
    borrow_within_cohort: str = PREEMPTION["borrowWithinCohort"]["policy"]
    fair_sharing: bool = True
    """Kueue's Configuration `fairSharing.enable` (kueue.py asks the admin to enable it)."""


class KueueModel(Scheduler):
    def __init__(self, state: ClusterState, teams: dict[str, TeamPolicy] | None = None,
                 config: SchedulerConfig | None = None, *, settings: KueueSettings | None = None):
        super().__init__(state, teams, config)
        self.settings = settings or KueueSettings()
        self._known: tuple[str, ...] = ()
        self._flavor_gpus: dict[str, int] = {}
        self._caps: dict[str, dict[str, int | None]] = {}
        self.nominal: dict[str, dict[str, int]] = {}
        """team -> GPU type -> nominal quota (GPUs)."""

    # -- quotas -------------------------------------------------------------------------------------------
    def _refresh_quotas(self) -> None:
        teams = tuple(sorted(set(self.teams) | set(self._team_jobs)))
        if teams == self._known:
            return
        self._known = teams
        self.nominal = {t: {} for t in teams}
        self._caps: dict[str, dict[str, int | None]] = {t: {} for t in teams}
        self._flavor_gpus = {t: sum(n.num_gpus for n in self.state.nodes if n.gpu_type == t and n.pool == SHARED_POOL)
                             for t in self.state.gpu_types}
        for gpu_type in self.state.gpu_types:
            nodes = [n for n in self.state.nodes if n.gpu_type == gpu_type and n.pool == SHARED_POOL]
            if not nodes:
                continue
            per_node = max(n.num_gpus for n in nodes)
            node_caps = {t: self._cap_nodes(t, gpu_type, per_node) for t in teams}
            share = apportion(len(nodes), {t: self.team(t).weight for t in teams}, node_caps)
            for t in teams:
                self.nominal[t][gpu_type] = share[t] * per_node
                self._caps[t][gpu_type] = None if node_caps[t] is None else node_caps[t] * per_node

    def _cap_nodes(self, team: str, gpu_type: str, per_node: int) -> int | None:
        """As the renderer caps a flavor (`kueue._team_cap_nodes`): the type's cap, and the `*` cap split over
        the flavors by their GPUs, in whole nodes."""
        quota = self.team(team).quota
        total = sum(self._flavor_gpus.values())
        caps = [quota[gpu_type]] if gpu_type in quota else []
        if "*" in quota and total:
            caps.append(quota["*"] * self._flavor_gpus[gpu_type] / total)
        return None if not caps else int(min(caps) // per_node)

    def _cap(self, team: str, gpu_type: str) -> int | None:
        return self._caps.get(team, {}).get(gpu_type)

    def _capacity(self, gpu_type: str) -> int:
        return self._flavor_gpus.get(gpu_type, 0)

    def _usage(self) -> dict[str, dict[str, int]]:
        return {t: dict(held) for t, held in self._alloc.items()}

    def _fits_quota(self, team: str, gpu_type: str, gpus: int, usage: dict[str, dict[str, int]]) -> bool:
        used = usage.get(team, {}).get(gpu_type, 0)
        cohort = sum(u.get(gpu_type, 0) for u in usage.values())
        if cohort + gpus > self._capacity(gpu_type):
            return False
        nominal = self.nominal.get(team, {}).get(gpu_type, 0)
        cap = self._cap(team, gpu_type)
        return used + gpus <= nominal or cap is None or used + gpus <= cap

    def cq_share(self, team: str, usage: dict[str, dict[str, int]], extra: tuple[str, int] | None = None) -> float:
        """Kueue's dominant resource share: the largest fraction of a flavor borrowed above nominal, by weight."""
        best = 0.0
        for gpu_type, cap in self._flavor_gpus.items():
            used = usage.get(team, {}).get(gpu_type, 0) + (extra[1] if extra and extra[0] == gpu_type else 0)
            borrowed = used - self.nominal.get(team, {}).get(gpu_type, 0)
            if cap and borrowed > 0:
                best = max(best, borrowed / cap)
        weight = self.team(team).weight
        return best / weight if weight > 0 else math.inf

    # -- the pass -----------------------------------------------------------------------------------------
    def schedule(self, now: float) -> list[Decision]:
        self._refresh_quotas()
        return super().schedule(now)

    def _pass(self, cls: str, now: float, decisions: list[Decision]) -> None:
        types = tuple(t for t in self.class_types(cls) if self._capacity(t))
        if not types:
            return
        usage = self._usage()
        pending = [self.jobs[e[3]] for teams in self._pending[cls].values() for lst in teams.values() for e in lst]
        pending = [j for j in pending if j.planned is None]
        if self.settings.fair_sharing:
            pending.sort(key=lambda j: (self.cq_share(j.req.team, usage, (types[0], j.req.num_gpus)), -j.req.rank,
                                        j.submit_time, j.seq))
        else:
            pending.sort(key=lambda j: (-j.req.rank, j.submit_time, j.seq))
        for job in pending:
            if self._admit(job, types, now, decisions, usage):
                usage = self._usage()
            else:
                self._preempt_for(job, types, now, decisions, usage)

    def _pools(self, team: str) -> list[str]:
        return [p for p in self.state.pools if p in (SHARED_POOL, team)]

    def _admit(self, job: Job, types: tuple[str, ...], now: float, decisions: list[Decision],
               usage: dict[str, dict[str, int]]) -> bool:
        req = job.req
        blocked = self._blocked(req.job_id)
        for t in types:  # flavors in order: the first whose quota and topology both fit
            if not self._fits_quota(req.team, t, req.num_gpus, usage):
                continue
            pl = find_placement(self.state, t, req.num_gpus, tp=req.tp, pp=req.pp, gpus_per_node=req.gpus_per_node,
                                pools=self._pools(req.team), blocked=blocked)
            if pl is not None:
                self._place(job, pl, now, decisions)
                return True
        job.reason = f"kueue: no {'/'.join(types)} quota or topology for {req.num_gpus} GPUs in {req.team}'s queue"
        return False

    def _candidates(self, job: Job, gpu_type: str, usage: dict[str, dict[str, int]]) -> list[Job]:
        """Workloads Kueue may evict for `job` on this flavor, in its order: the most borrowing queue first,
        then lower priority, then the most recently admitted."""
        req, s = job.req, self.settings
        used = usage.get(req.team, {}).get(gpu_type, 0)
        within_nominal = used + req.num_gpus <= self.nominal.get(req.team, {}).get(gpu_type, 0)
        out = []
        for j in (self.jobs[i] for i in self._running_on[gpu_type]):
            if j.state is not JobState.RUNNING:
                continue
            other = j.req.team
            if other == req.team:
                if s.within_cluster_queue == "LowerPriority" and j.req.rank < req.rank:
                    out.append(j)
                continue
            borrowing = usage.get(other, {}).get(gpu_type, 0) > self.nominal.get(other, {}).get(gpu_type, 0)
            if not borrowing:
                continue  # a queue within its nominal quota is never a cohort victim
            if within_nominal and (s.reclaim_within_cohort == "Any" or
                                   s.reclaim_within_cohort == "LowerPriority" and j.req.rank < req.rank):
                out.append(j)
            elif not within_nominal and s.fair_sharing:
                out.append(j)  # checked against the fair-share strategy as it is taken
            elif not within_nominal and s.borrow_within_cohort == "LowerPriority" and j.req.rank < req.rank:
                out.append(j)
        out.sort(key=lambda j: (-self.cq_share(j.req.team, usage), j.req.rank, -j.start_time))
        return out

    def _preempt_for(self, job: Job, types: tuple[str, ...], now: float, decisions: list[Decision],
                     usage: dict[str, dict[str, int]]) -> None:
        req = job.req
        if now < job.room_retry_at:
            return
        for t in types:
            left = {team: dict(u) for team, u in usage.items()}
            chosen: list[Job] = []
            plan: Placement | None = None
            for v in self._candidates(job, t, usage):
                if v.req.team != req.team and not self._fair_share_allows(job, v, t, left):
                    continue
                left[v.req.team][t] -= v.gpus
                chosen.append(v)
                if not self._fits_quota(req.team, t, req.num_gpus, left):
                    continue
                for c in chosen:
                    self.state.release(c.job_id, c.placement.node_indices())
                plan = find_placement(self.state, t, req.num_gpus, tp=req.tp, pp=req.pp,
                                      gpus_per_node=req.gpus_per_node, pools=self._pools(req.team),
                                      blocked=self._blocked(req.job_id))
                for c in chosen:
                    self.state.allocate(c.job_id, c.placement.assignments)
                if plan is not None:
                    break
            if plan is None:
                continue
            deadline = now + self.config.grace_s
            for v in chosen:
                self._signal(v, deadline)
                self._victim_of.setdefault(v.job_id, set()).add(req.job_id)
                decisions.append(Preempt(v.job_id, deadline, req.job_id, f"kueue: evicted for {req.job_id}"))
            job.planned = plan
            job.waiting_on = frozenset(v.job_id for v in chosen)
            for n in plan.node_indices():
                self._earmarked[n] = req.job_id
            return
        job.room_retry_at = now + self.config.room_retry_s

    def _fair_share_allows(self, job: Job, victim: Job, gpu_type: str, usage: dict[str, dict[str, int]]) -> bool:
        """Reclaiming nominal quota needs no fair-share test; borrowing does (LessThanOrEqualToFinalShare: the
        preemptor's queue with the workload shares no more than the victim's queue without the victim)."""
        req = job.req
        used = usage.get(req.team, {}).get(gpu_type, 0)
        if used + req.num_gpus <= self.nominal.get(req.team, {}).get(gpu_type, 0):
            return True
        if not self.settings.fair_sharing:
            return self.settings.borrow_within_cohort == "LowerPriority" and victim.req.rank < req.rank
        after = {t: dict(u) for t, u in usage.items()}
        after[victim.req.team][gpu_type] -= victim.gpus
        return self.cq_share(req.team, usage, (gpu_type, req.num_gpus)) <= self.cq_share(victim.req.team, after)
