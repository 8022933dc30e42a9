"""The scheduling policy: a state plus events in, decisions out. No I/O, no clock: callers pass `now`.

Events: `submit`, `finish` (done, failed or cancelled), `stopped` (a preemption victim checkpointed and stopped),
`checkpointed`, `fail_node` / `restore_node` (failures, spot reclamation), then `schedule(now)` runs one pass and
returns the decisions (Start, Preempt, Kill, Resize, Requeue). The live scheduler and the simulator both drive it.

One pass, per GPU class (a job's acceptable GPU types), in policy order:
- `ours`: priority within a team, fair share between teams. `critical` jobs within their team's critical quota
  first (the one priority that crosses teams; beyond the quota a `critical` job runs as `high`), then gangs
  holding a standing reservation, then the teams by weighted dominant share (DRF over the GPUs of each type,
  recomputed as jobs start; requeued-after-failure work first), each team's jobs in its own priority order, then
  submit time. Team quotas are hard caps. The first job that cannot start is the head: it shrinks elastic jobs and
  preempts (`_taking_rule`) its own team's lower-priority jobs, `preemptible` jobs, borrowers of its team's pool, and,
  when its team is under its fair share, lower-priority jobs of teams holding a larger share (past `patience_s`,
  any of their jobs, at its next checkpoint boundary); least lost work first, with checkpoint-then-stop grace. A
  job of a team at or above its share never takes an under-share team's GPUs (critical within quota, pool owners
  and `preemptible` aside). The head gets an EASY reservation and later jobs backfill only if they do not delay
  it. Idle capacity nobody waits for is grown into by elastic jobs.
- `fifo`: submit order, the head blocks its class. `fifo-backfill`: submit order plus EASY backfill.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Collection, Iterable, Iterator

from trainforge.infra.scheduler.model import (
    ANY_GPU,
    SHARED_POOL,
    Boost,
    Decision,
    Job,
    JobRequest,
    JobState,
    Kill,
    Placement,
    Preempt,
    PreemptRule,
    Requeue,
    Resize,
    SchedulerConfig,
    Start,
    TeamPolicy,
    priority_name,
)
from trainforge.infra.scheduler.placement import compute_quality, find_placement, per_node_candidates
from trainforge.infra.scheduler.state import ClusterState
from trainforge.spec import Priority

_DEFAULT_TEAM = TeamPolicy()
DEMOTED = "critical beyond its team's quota, scheduled as high"
CRITICAL = Priority.CRITICAL.rank
HIGH = Priority.HIGH.rank
PREEMPTIBLE = Priority.PREEMPTIBLE.rank


class _Reservation:
    __slots__ = ("head", "shadow", "extra")

    def __init__(self, head: str, shadow: float, extra: int):
        self.head, self.shadow, self.extra = head, shadow, extra

    def admits(self, now: float, gpus: int, runtime_s: float) -> int | None:
        """None if the job would delay the head; else the GPUs it takes from the spare (`extra`) capacity."""
        if now + runtime_s <= self.shadow:
            return 0
        if gpus <= self.extra:
            self.extra -= gpus
            return gpus
        return None


class Scheduler:
    def __init__(self, state: ClusterState, teams: dict[str, TeamPolicy] | None = None,
                 config: SchedulerConfig | None = None):
        self.state = state
        self.teams = dict(teams or {})
        self.config = config or SchedulerConfig()
        self.ours = self.config.policy == "ours"
        self.backfill = self.config.policy != "fifo"
        self.jobs: dict[str, Job] = {}
        self._seq = 0
        # class -> rank -> team -> sorted [(boost, submit, seq, job_id)]
        self._pending: dict[str, dict[int, dict[str, list[tuple[int, float, int, str]]]]] = {}
        self._pending_count: dict[str, int] = {}
        self._running_ends: dict[str, list[tuple[float, int, str]]] = {t: [] for t in state.gpu_types}
        self._alloc: dict[str, dict[str, int]] = {}  # team -> type -> GPUs held
        self._earmarked: dict[int, str] = {}  # node idx -> job whose preemption plan includes it
        # Insertion-ordered (dicts, not sets): victims and kills are visited in the same order in every process
        # (a set of strings iterates by hash, which PYTHONHASHSEED changes per run, and ties then broke
        # differently: the same events gave different decisions).
        self._preempting: dict[str, None] = {}
        self._victim_of: dict[str, set[str]] = {}  # victim -> preemptors waiting on it
        self._elastic: set[str] = set()
        self._running_on: dict[str, dict[str, None]] = {t: {} for t in state.gpu_types}
        self._epoch = 0  # bumped whenever GPUs are taken or given back
        # Per-pass memos, valid while `_epoch` stands (cleared at every pass: node health may change in between):
        # the head's reservation was computed twice a pass (by `_starving` and for backfill), and the teams'
        # shares once per job the fair-share order yields.
        self._share_memo: tuple[int, dict[str, float]] = (-1, {})
        self._reserve_memo: dict[tuple[str, tuple[str, ...], float, int], tuple[float, int]] = {}
        self._by_type: dict[str, list] | None = None  # nodes per GPU type (the node list never changes)
        self._earmarked_free: dict[str, int] = dict.fromkeys(state.gpu_types, 0)
        self._reserved: set[str] = set()  # pending gangs holding a standing reservation (Job.reserved_since)
        self._team_jobs: dict[str, int] = {}  # team -> jobs known (pending or running): the active teams
        # The active teams' total weight, recomputed (by the same sum, in the same order) only when a count changed:
        # every pass asks it for every pending gang.
        self._active_weight: tuple[int, float] = (-1, 0.0)
        self._team_jobs_version = 0
        self._demoted: dict[str, None] = {}  # critical jobs beyond their team's critical quota, scheduled as high
        self.checkpoint_clock: Callable[[Job, float], float] | None = None
        """Optional: when a job last checkpointed (the simulator computes it instead of sending events)."""
        self.stats = {"preemptions": 0, "kills": 0, "shrinks": 0, "grows": 0, "requeues": 0, "replacements": 0}

    # -- helpers ------------------------------------------------------------------------------------------
    def class_types(self, gpu_type: str) -> tuple[str, ...]:
        if gpu_type == ANY_GPU:
            return tuple(t for t in self.state.gpu_types if t != "cpu") or tuple(self.state.gpu_types)
        return tuple(t for t in sorted(set(gpu_type.split("|"))) if t in self.state.capacity)

    def team(self, name: str) -> TeamPolicy:
        return self.teams.get(name, _DEFAULT_TEAM)

    def share(self, team: str) -> float:
        epoch, memo = self._share_memo
        if epoch != self._epoch:
            memo = {}
            self._share_memo = (self._epoch, memo)
        value = memo.get(team)
        if value is None:
            value = memo[team] = self._share(team)
        return value

    def _share(self, team: str, change: tuple[str, int] | None = None) -> float:
        """The team's weighted dominant share; with `change` = (GPU type, GPUs), as if it held that many more."""
        held = self._alloc.get(team) or {}
        if change is not None:
            held = {**held, change[0]: held.get(change[0], 0) + change[1]}
        if not held:
            return 0.0
        cap = self.state.capacity
        return max((g / cap[t] for t, g in held.items() if cap.get(t)), default=0.0) / self.team(team).weight

    def under_fair_share(self, team: str) -> bool:
        """The team's weighted dominant share is below its fair share: its weight over the weights of the
        active teams (those with a job pending or running)."""
        version, total = self._active_weight
        if version != self._team_jobs_version:
            total = sum(self.team(t).weight for t, n in self._team_jobs.items() if n)
            self._active_weight = (self._team_jobs_version, total)
        return total > 0 and self.share(team) * total < 1.0 - 1e-12

    def _count_team(self, team: str, delta: int) -> None:
        self._team_jobs[team] = self._team_jobs.get(team, 0) + delta
        self._team_jobs_version += 1

    def held(self, team: str, gpu_type: str | None = None) -> int:
        held = self._alloc.get(team, {})
        return sum(held.values()) if gpu_type is None else held.get(gpu_type, 0)

    def _tiers(self, team: str) -> list[list[str]]:
        pools = self.state.pools
        if not self.ours:
            return [pools]
        own = [p for p in (team, SHARED_POOL) if p in pools]
        tiers = [[team], own] if team in pools and len(own) > 1 else [own]
        if self.config.lending and len(own) < len(pools):
            tiers.append(own + [p for p in pools if p not in own])
        return tiers

    def _quota_types(self, job: Job, types: Iterable[str], gpus: int) -> list[str]:
        quota = self.team(job.req.team).quota
        if not quota:
            return list(types)
        total = self.held(job.req.team) + gpus
        if total > quota.get("*", math.inf):
            return []
        return [t for t in types if self.held(job.req.team, t) + gpus <= quota.get(t, math.inf)]

    def critical_quota(self, team: str) -> int:
        """GPUs the team's critical jobs may ask for at once (the cluster description's, else a share of it)."""
        own = self.team(team).critical_quota
        if own is not None:
            return own
        return math.floor(self.config.critical_share * sum(self.state.installed.values()) + 1e-9)

    def _within_critical_quota(self, req: JobRequest) -> bool:
        asked = sum(j.req.num_gpus for j in self.jobs.values() if j.rank == CRITICAL and j.req.team == req.team)
        return asked + req.num_gpus <= self.critical_quota(req.team)

    def _taking_rule(self, job: Job, v: Job, starving: bool, *, shrink: bool = False) -> PreemptRule | None:
        """The rule that lets `job` (a blocked head) preempt `v`, shrink it (`shrink`: same priority allowed) or
        take over its preemption plan; None if none does. Priority orders a team's own work; between teams, fair
        share decides."""
        team, other = job.req.team, v.req.team
        if team in v.borrowed_from:  # a dedicated pool's owner reclaims it
            return "pool"
        lower = v.rank <= job.rank if shrink else v.rank < job.rank
        if team == other:
            return "own-team" if lower else None
        if v.rank == CRITICAL:  # within its team's critical quota: no other team's to take
            return None
        if v.rank == PREEMPTIBLE:  # free to take, whichever team runs it, by anything but preemptible work
            return "preemptible" if job.rank > PREEMPTIBLE else None
        if job.rank == PREEMPTIBLE:
            return None
        if job.rank == CRITICAL:
            return "critical"
        if not self.under_fair_share(team) or self.share(other) <= self.share(team) + 1e-12:
            return None  # at or above its share, a team takes no other team's GPUs; under it, only a richer team's
        if starving:
            return "starving"
        # At once, only what leaves the victim's team no poorer than the requester's would be (Kueue's
        # LessThanOrEqualToFinalShare): a 1-GPU job of a poorer team does not stop a whole-cluster gang just
        # started, only to be stopped in turn. Per victim here; `_make_room` adds up what one team loses.
        return "fair-share" if lower and self._final_share_ok(job, v, 0) else None

    def _final_share_ok(self, job: Job, v: Job, taken: int) -> bool:
        """The requester's team with the job started is no richer than `v`'s team without `v` and the `taken`
        GPUs of it already chosen as victims (both on the GPU type `v` runs on)."""
        t = v.placement.gpu_type
        return (self._share(job.req.team, (t, job.req.floor_gpus))
                <= self._share(v.req.team, (t, -(v.gpus + taken))) + 1e-12)

    def _blocked(self, job_id: str) -> Collection[int]:
        """Nodes earmarked for other jobs' preemption plans (a job's own plan is taken before it places anew)."""
        return self._earmarked.keys() if self._earmarked else frozenset()

    # -- events -------------------------------------------------------------------------------------------
    def submit(self, req: JobRequest, now: float) -> Job:
        if req.job_id in self.jobs:
            raise ValueError(f"job {req.job_id!r} is already known to the scheduler ({self.jobs[req.job_id].state})")
        types = self.class_types(req.gpu_type)
        if not types:
            raise ValueError(f"job {req.job_id}: no {req.gpu_type!r} GPUs in this cluster "
                             f"(it has {', '.join(self.state.gpu_types)})")
        cap = max(self.state.installed[t] for t in types)
        if req.floor_gpus > cap:
            raise ValueError(f"job {req.job_id}: needs {req.floor_gpus} {req.gpu_type} GPUs but the cluster has at "
                             f"most {cap} of one type; a job's GPUs must all be one type")
        if req.tp > max(self.state.max_gpus_per_node[t] for t in types):
            raise ValueError(f"job {req.job_id}: tp ({req.tp}) exceeds GPUs per node; a TP group must fit a node")
        self._seq += 1
        job = Job(req, now, self._seq)
        if req.rank == CRITICAL and self.ours and not self._within_critical_quota(req):
            job.rank = HIGH
            job.reason = self._demoted_reason(job, "queued")
            self._demoted[req.job_id] = None
        self.jobs[req.job_id] = job
        self._count_team(req.team, 1)
        if req.elastic:
            self._elastic.add(req.job_id)
        self._enqueue(job)
        return job

    def adopt(self, job: Job) -> None:
        """Restore a persisted job as it was (the live scheduler rebuilds the policy in every transaction).
        Adopt in `seq` order; a preempting job before the jobs waiting on it."""
        self.jobs[job.job_id] = job
        if job.rank != job.req.rank:
            self._demoted[job.job_id] = None
        self._seq = max(self._seq, job.seq)
        self._count_team(job.req.team, 1)
        if job.req.elastic:
            self._elastic.add(job.job_id)
        if job.state is JobState.PENDING:
            self._enqueue(job)
            if not math.isnan(job.reserved_since):
                self._reserved.add(job.job_id)
            if job.planned is not None:
                for n in job.planned.node_indices():
                    self._earmarked[n] = job.job_id
                for v in job.waiting_on:
                    self._victim_of.setdefault(v, set()).add(job.job_id)
            return
        pl, job.placement = job.placement, None
        self.state.allocate(job.job_id, pl.assignments)
        self._set_placement(job, pl)
        if job.state is JobState.PREEMPTING:
            self._preempting[job.job_id] = None

    def finish(self, job_id: str, now: float) -> None:
        """The job ended (completed, failed or cancelled): forget it and free its GPUs."""
        job = self.jobs.pop(job_id, None)
        if job is None:
            return
        self._elastic.discard(job_id)
        self._reserved.discard(job_id)
        self._demoted.pop(job_id, None)
        self._count_team(job.req.team, -1)
        if job.state is JobState.PENDING:
            self._dequeue(job)
            self._drop_plan(job)
        else:
            self._unplace(job)
            self._victim_done(job_id)

    def stopped(self, job_id: str, now: float) -> None:
        """A preempted job checkpointed and stopped inside its grace period: requeue it."""
        job = self.jobs.get(job_id)
        if job is None or job.state is not JobState.PREEMPTING:
            return
        self._unplace(job)
        self._victim_done(job_id)
        job.state = JobState.PENDING
        job.last_checkpoint = now
        job.preempt_at = math.nan
        self._enqueue(job)

    def checkpointed(self, job_id: str, now: float) -> None:
        """The job committed a checkpoint: victims are picked by the work since their last one, and the gaps
        between a run's commits are its checkpoint interval (a starving gang preempts at the next boundary)."""
        job = self.jobs.get(job_id)
        if job is None:
            return
        if job.state is not JobState.PENDING and job.last_commit >= job.start_time and now > job.last_commit:
            job.checkpoint_every = now - job.last_commit
        job.last_checkpoint = job.last_commit = now

    def fail_node(self, name: str, now: float, reason: str = "node failure") -> list[Decision]:
        """A node failed or its spot capacity was reclaimed: mark it unhealthy; each running job on it gets a
        replacement for the lost workers where possible, else is requeued at the head of its class."""
        self._share_memo = (-1, {})  # capacity changes with health, and the epoch does not see it
        idx = self.state.by_name[name]
        node = self.state.nodes[idx]
        decisions: list[Decision] = []
        for job_id in list(node.jobs):
            job = self.jobs[job_id]
            if job.state is JobState.PREEMPTING:
                self._unplace(job)
                self._victim_done(job_id)
                job.state = JobState.PENDING
                self._enqueue(job)
                decisions.append(Kill(job_id))
                continue
            self.state.set_healthy(idx, False)
            replaced = self._replace_lost(job, {idx})
            if replaced is not None:
                self.stats["replacements"] += 1
                decisions.append(Resize(job_id, replaced, job.gpus, f"{reason} on {name}: lost workers replaced",
                                        "lost_workers"))
                self._move(job, replaced)
                continue
            self._unplace(job)
            job.state = JobState.PENDING
            job.boost = Boost.REQUEUED
            job.num_requeues += 1
            self.stats["requeues"] += 1
            self._enqueue(job)
            decisions.append(Requeue(job_id, f"{reason} on {name}; requeued at the head of its class"))
        self.state.set_healthy(idx, False)
        for n, j in list(self._earmarked.items()):
            if n == idx:
                self._drop_plan(self.jobs[j])
        return decisions

    def restore_node(self, name: str) -> None:
        self._share_memo = (-1, {})
        self.state.set_healthy(self.state.by_name[name], True)

    # -- the pass -----------------------------------------------------------------------------------------
    def schedule(self, now: float) -> list[Decision]:
        self._share_memo = (-1, {})
        self._reserve_memo.clear()
        decisions: list[Decision] = []
        for job_id in [j for j in self._preempting if self.jobs[j].preempt_deadline <= now]:
            self.stats["kills"] += 1
            self.stopped(job_id, now)
            decisions.append(Kill(job_id))
        for job_id in [j for j in self._reserved if not self._keeps_reservation(self.jobs[j])]:
            self._reserved.discard(job_id)
            self.jobs[job_id].reserved_since = math.nan
        for job_id in sorted(set(self._earmarked.values()), key=lambda j: self.jobs[j].seq):
            job = self.jobs[job_id]  # preemption plans whose victims have all stopped start first
            if not job.waiting_on:
                self._try_start(job, self.class_types(job.req.gpu_type), now, decisions, None)
        classes = [c for c, n in self._pending_count.items() if n]
        if self.ours:  # critical work within quota first, then reserved gangs, then the poorest team waiting
            reserved = {self.jobs[j].req.gpu_type for j in self._reserved}
            classes.sort(key=lambda c: (not any(self._pending[c].get(CRITICAL, {}).values()), c not in reserved,
                                        min(self.share(t) for teams in self._pending[c].values()
                                            for t, lst in teams.items() if lst), c))
        else:
            classes.sort(key=lambda c: -max(r for r, teams in self._pending[c].items() if any(teams.values())))
        for cls in classes:
            self._pass(cls, now, decisions)
        if self.ours and self._elastic:
            self._grow(now, decisions)
        for job_id in self._demoted:
            job = self.jobs[job_id]
            if job.state is JobState.PENDING and not job.reason.startswith(DEMOTED):
                job.reason = self._demoted_reason(job, job.reason)
        return decisions

    def _demoted_reason(self, job: Job, why: str) -> str:
        return f"{DEMOTED} (team {job.req.team}'s critical quota: {self.critical_quota(job.req.team)} GPUs): {why}"

    def _pass(self, cls: str, now: float, decisions: list[Decision]) -> None:
        types = self.class_types(cls)
        pools = self.state.pools
        nodes = self.state.nodes
        self._earmarked_free = dict.fromkeys(self.state.gpu_types, 0)
        for n in self._earmarked:  # free GPUs kept for preemption plans: not free for anyone else
            if nodes[n].healthy:
                self._earmarked_free[nodes[n].gpu_type] += nodes[n].free
        free = sum(self.state.free_in(t, pools) - self._earmarked_free[t] for t in types)
        head: Job | None = None
        reservation: _Reservation | None = None
        scanned = 0
        for job in self._ordered(cls):
            req = job.req
            if head is not None:
                scanned += 1
                if scanned > self.config.backfill_depth or free == 0:
                    break
                if req.floor_gpus > free:
                    job.reason = f"waiting behind {head.job_id} ({free} {cls} GPUs free, needs {req.floor_gpus})"
                    continue
                if reservation is None:
                    reservation = self._reserve(head, types, now)
            elif req.floor_gpus > free and job.planned is None and not self.ours:
                job.reason = f"waiting for {req.floor_gpus} {cls} GPUs ({free} free)"
                head = job
                if not self.backfill:
                    return
                continue
            started = self._try_start(job, types, now, decisions, reservation)
            if started:
                free = sum(self.state.free_in(t, pools) - self._earmarked_free[t] for t in types)
                continue
            if job.reason.startswith("quota") or head is not None:
                continue
            head = job
            if self.ours:
                self._make_room(job, types, now, decisions, self._starving(job, types, now))
            if not self.backfill:
                return
            if job.planned is None:
                job.reason = f"head of {cls} queue: needs {req.floor_gpus} GPUs, {free} free; GPUs reserved for it"

    def _starving(self, head: Job, types: tuple[str, ...], now: float) -> bool:
        """Give the head a standing reservation when its team is under its fair share (it is then ordered ahead of
        every job of its class but critical ones until it starts); True once its start would come later than
        `patience_s` after that."""
        if math.isnan(head.reserved_since):
            if head.rank == PREEMPTIBLE or not self.under_fair_share(head.req.team):
                return False  # preemptible work is anyone's to take: it holds no reservation and takes nothing
            head.reserved_since = now
            self._reserved.add(head.job_id)
        deadline = head.reserved_since + self.config.patience_s
        return now >= deadline or self._reserve(head, types, now).shadow > deadline

    def _keeps_reservation(self, job: Job) -> bool:
        """A standing reservation lasts while its team is under its fair share and no poorer team waits in the
        same class, at any priority but `preemptible` (which gets none) and critical (which goes first anyway): that
        team's gang then becomes the head and gets the reservation."""
        team = job.req.team
        if not self.under_fair_share(team):
            return False
        mine = self.share(team)
        return not any(lst and self.share(t) < mine - 1e-12
                       for rank, teams in self._pending.get(job.req.gpu_type, {}).items()
                       if rank not in (PREEMPTIBLE, CRITICAL) for t, lst in teams.items())

    def next_wakeup(self, now: float) -> float:
        """When the policy next needs a pass though no event comes: a reserved gang's patience runs out, or a
        preemption victim's deadline passes. The simulator schedules a pass then; the live scheduler polls."""
        times = [self.jobs[j].reserved_since + self.config.patience_s for j in self._reserved
                 if self.jobs[j].planned is None]
        times += [self.jobs[j].preempt_deadline for j in self._preempting]
        return min((t for t in times if t > now), default=math.inf)

    def queue_order(self, cls: str) -> list[Job]:
        """The pending jobs of GPU class `cls` in the order the next pass considers them (the queue's positions)."""
        if not self._pending_count.get(cls):
            return []
        self._share_memo = (-1, {})
        return [j for j in self._ordered(cls) if j.state is JobState.PENDING]

    def _ordered(self, cls: str) -> Iterator[Job]:
        by_rank = self._pending[cls]
        jobs = self.jobs
        if not self.ours:
            lists = [list(lst) for teams in by_rank.values() for lst in teams.values() if lst]
            for entry in heapq.merge(*lists):
                yield jobs[entry[3]]
            return
        # 1. Critical jobs within their team's critical quota, across teams by fair share.
        critical = by_rank.get(CRITICAL, {})
        yield from self._by_share({t: list(lst) for t, lst in critical.items() if lst}, set())
        # 2. Standing reservations, the poorest team's first (then the oldest): a gang that got one is never
        # overtaken by a job of its class that the fair-share order puts ahead of it when GPUs free up, whatever
        # that job's priority (a richer team's `high` flood included).
        first = sorted((j for j in (jobs[i] for i in self._reserved)
                        if j.req.gpu_type == cls and j.rank != CRITICAL and j.state is JobState.PENDING),
                       key=lambda j: (self.share(j.req.team), j.reserved_since, j.seq)) if self._reserved else []
        yield from first
        # 3. The teams by fair share; each team's own jobs in its priority order.
        own: dict[str, list[tuple[int, float, int, str]]] = {}
        for rank in sorted(by_rank, reverse=True):
            if rank != CRITICAL:
                for t, lst in by_rank[rank].items():
                    if lst:
                        own.setdefault(t, []).extend(lst)
        yield from self._by_share(own, {j.job_id for j in first})

    def _by_share(self, queues: dict[str, list[tuple[int, float, int, str]]], skip: set[str]) -> Iterator[Job]:
        """Merge the teams' queues (each in its own order): next the team whose head was requeued after a failure,
        then the team of the lowest weighted dominant share (recomputed as jobs start), then submit time."""
        jobs = self.jobs
        heap = [(lst[0][0], self.share(t), lst[0][1], lst[0][2], t, 0) for t, lst in queues.items()]
        heapq.heapify(heap)
        while heap:
            _, _, _, _, team, pos = heapq.heappop(heap)
            lst = queues[team]
            if lst[pos][3] not in skip:
                yield jobs[lst[pos][3]]
            pos += 1
            if pos < len(lst):
                b, sub, seq, _ = lst[pos]
                heapq.heappush(heap, (b, self.share(team), sub, seq, team, pos))

    def _sizes(self, job: Job, free: int) -> list[int]:
        req = job.req
        if not req.elastic:
            return [req.num_gpus]
        step = req.tp * req.pp
        top = min(req.num_gpus, free // step * step)
        sizes = [s for s in (req.num_gpus, top, (top + req.floor_gpus) // 2 // step * step, req.floor_gpus)
                 if req.floor_gpus <= s <= req.num_gpus]
        return sorted(set(sizes), reverse=True)

    def _try_start(self, job: Job, types: tuple[str, ...], now: float, decisions: list[Decision],
                   reservation: _Reservation | None) -> bool:
        req = job.req
        if job.planned is not None:
            if job.waiting_on:
                job.reason = f"preempting {len(job.waiting_on)} job(s); they checkpoint then stop"
                return False
            planned = job.planned
            ok = all(self.state.nodes[n].healthy and self.state.nodes[n].free_mask >> g & 1
                     for n, gpus in planned.assignments for g in gpus)
            self._drop_plan(job)
            if ok and self._quota_types(job, (planned.gpu_type,), planned.num_gpus):
                self._place(job, planned, now, decisions)
                return True
        pools = self.state.pools
        free = sum(self.state.free_in(t, pools) for t in types)
        blocked = self._blocked(req.job_id)
        why = ""
        for size in self._sizes(job, free):
            allowed = self._quota_types(job, types, size)
            if not allowed:
                why = f"quota: team {req.team} would exceed its GPU quota with {size} more"
                continue
            taken = 0
            if reservation is not None:
                admitted = reservation.admits(now, size, req.max_runtime_s)
                if admitted is None:
                    why = f"backfill would delay the reservation of {reservation.head}"
                    continue
                taken = admitted
            for tier in self._tiers(req.team):
                order = sorted(allowed, key=lambda t, tier=tier: self.state.free_in(t, tier))
                for t in order:
                    if self.state.free_in(t, tier) - self._earmarked_free[t] < size:
                        continue
                    pl = find_placement(self.state, t, size, tp=req.tp, pp=req.pp, gpus_per_node=req.gpus_per_node,
                                        pools=tier, blocked=blocked)
                    if pl is not None:
                        self._place(job, pl, now, decisions)
                        return True
            if reservation is not None:
                reservation.extra += taken
            why = why or (f"no placement for {req.floor_gpus} {req.gpu_type} GPUs "
                          f"(gpus_per_node={req.gpus_per_node or 'auto'}, tp={req.tp})")
        job.reason = why
        return False

    def _reserve(self, head: Job, types: tuple[str, ...], now: float) -> _Reservation:
        key = (head.job_id, types, now, self._epoch)
        memo = self._reserve_memo.get(key)
        if memo is None:
            r = self._compute_reservation(head, types, now)
            memo = self._reserve_memo[key] = (r.shadow, r.extra)
        return _Reservation(head.job_id, *memo)  # a fresh one: backfill spends its `extra`

    def _compute_reservation(self, head: Job, types: tuple[str, ...], now: float) -> _Reservation:
        """The head's shadow time: the earliest time, by the running jobs' estimated ends, that enough GPUs are
        free and (for a multi-node gang) enough whole nodes; `extra` = GPUs free then beyond its need."""
        need = head.req.floor_gpus
        avail = sum(self.state.free_in(t, self.state.pools) for t in types)
        if avail >= need:
            return _Reservation(head.job_id, now, avail - need)
        ends = heapq.merge(*(self._running_ends[t] for t in types))
        shadow = math.inf
        for end, _, job_id in ends:
            avail += self.jobs[job_id].gpus
            if avail >= need:
                shadow = max(end, now)
                break
        if math.isinf(shadow):
            return _Reservation(head.job_id, math.inf, 0)
        whole = self._nodes_free_at(head, types, now)
        if whole > shadow:  # GPUs enough, but scattered: wait for whole nodes, counting what else ends by then
            shadow = whole
            for end, _, job_id in ends:
                if end > shadow:
                    break
                avail += self.jobs[job_id].gpus
        return _Reservation(head.job_id, shadow, avail - need)

    def _nodes_free_at(self, head: Job, types: tuple[str, ...], now: float) -> float:
        """When enough whole nodes are free for a gang larger than a node (per node: the latest estimated end of
        the jobs on it); -inf for a gang that fits one node (the GPU count decides)."""
        need = head.req.floor_gpus
        best = math.inf
        for t in types:
            per_node = self.state.max_gpus_per_node[t]
            if need <= per_node:
                return -math.inf
            k = -(-need // per_node)
            jobs = self.jobs
            times = []
            for node in self._nodes_of(t):  # the hot loop of a gang's reservation at fleet size: no temporaries
                if not node.healthy:
                    continue
                end = now
                for j in node.jobs:
                    e = jobs[j].est_end
                    if e > end:
                        end = e
                times.append(end)
            if len(times) >= k:
                best = min(best, heapq.nsmallest(k, times)[-1] if k < len(times) // 8 else sorted(times)[k - 1])
        return best

    def _nodes_of(self, gpu_type: str) -> list:
        by_type = self._by_type
        if by_type is None:
            by_type = self._by_type = {}
            for node in self.state.nodes:
                by_type.setdefault(node.gpu_type, []).append(node)
        return by_type.get(gpu_type, [])

    # -- room for a blocked head: shrink elastic jobs, then preempt ------------------------------------------
    def _make_room(self, job: Job, types: tuple[str, ...], now: float, decisions: list[Decision],
                   starving: bool = False) -> None:
        """Shrink elastic jobs, then preempt what `_taking_rule` allows; a starving reserved gang (`_starving`) may
        also take any job of a team holding a larger share than its own, each at its next checkpoint boundary."""
        if job.planned is not None or (now < job.room_retry_at and not starving):
            return
        req = job.req
        types = tuple(self._quota_types(job, types, req.floor_gpus))
        if not types:
            return
        pools = self.state.pools
        shrinkable = [self.jobs[j] for j in sorted(self._elastic)
                      if self.jobs[j].state is JobState.RUNNING and self.jobs[j].gpus > self.jobs[j].req.floor_gpus
                      and self.jobs[j].placement.gpu_type in types
                      and self._taking_rule(job, self.jobs[j], starving, shrink=True)]
        rules: dict[str, PreemptRule] = {}
        for t in types:
            for v in (self.jobs[j] for j in self._running_on[t]):
                if v.state is JobState.RUNNING and (rule := self._taking_rule(job, v, starving)):
                    rules[v.job_id] = rule
        victims = [self.jobs[j] for j in rules]
        # A starving gang may also take over the preemption plans of jobs it could preempt (lower priority, or a
        # richer team's): their victims are already stopping, each by its own boundary plus the grace period, so
        # waiting on them keeps the bound; leaving those nodes to a richer team's plan would not (its victims
        # stop, the plan's job starts there, and the gang preempts it only from then on, one interval later).
        stealable: set[str] = set()
        stopping: list[Job] = []
        if starving:
            stealable = {p for p in set(self._earmarked.values())
                         if p != req.job_id and self._taking_rule(job, self.jobs[p], starving)}
            stopping = sorted((self.jobs[j] for t in types for j in self._running_on[t]
                               if self.jobs[j].state is JobState.PREEMPTING), key=lambda v: v.preempt_deadline)
        if not shrinkable and not victims and not stopping:
            job.room_retry_at = now + self.config.room_retry_s
            return
        victims = stopping + self._victim_order(req, victims, types, now)[: self.config.max_victims]

        def fits() -> Placement | None:
            if sum(self.state.free_in(t, pools) for t in types) < req.floor_gpus:
                return None
            if not any(self.state.nodes_with_free(t, pools, g) >= req.floor_gpus // g for t in types
                       for g in per_node_candidates(req.floor_gpus, req.tp, self.state.max_gpus_per_node[t],
                                                    req.gpus_per_node)):
                return None
            blocked = ({n for n, p in self._earmarked.items() if p not in stealable} if stealable
                       else self._blocked(req.job_id))
            for tier in self._tiers(req.team):
                for t in types:
                    pl = find_placement(self.state, t, req.floor_gpus, tp=req.tp, pp=req.pp,
                                        gpus_per_node=req.gpus_per_node, pools=tier, blocked=blocked)
                    if pl is not None:
                        return pl
            return None

        shrunk: list[tuple[Job, Placement, list[tuple[int, tuple[int, ...]]]]] = []
        plan = None
        for e in sorted(shrinkable, key=lambda e: e.rank):
            new = self._shrunk(e)
            if new is None:
                continue
            keep = {n for n, _ in new.assignments}
            removed = [(n, g) for n, g in e.placement.assignments if n not in keep]
            self.state.release(e.job_id, [n for n, _ in removed])
            shrunk.append((e, new, removed))
            plan = fits()
            if plan is not None:
                break
        chosen: list[Job] = []
        released: list[Job] = []
        if plan is None:
            taken: dict[str, int] = {}  # GPUs of each team chosen so far under the final-share guard
            for v in victims:
                if rules.get(v.job_id) == "fair-share":
                    if not self._final_share_ok(job, v, taken.get(v.req.team, 0)):
                        continue
                    taken[v.req.team] = taken.get(v.req.team, 0) + v.gpus
                for k, (e, _, removed) in enumerate(shrunk):
                    if e is v:  # shrinking was not enough: preempt it whole instead
                        self.state.allocate(e.job_id, removed)
                        del shrunk[k]
                        break
                self.state.release(v.job_id, v.placement.node_indices())
                chosen.append(v)
                released.append(v)
                plan = fits()
                if plan is not None:
                    break
            if plan is not None:  # victims holding none of the planned GPUs were not needed
                planned = {(n, g) for n, gpus in plan.assignments for g in gpus}
                chosen = [v for v in chosen if any((n, g) in planned for n, gpus in v.placement.assignments
                                                   for g in gpus)]
        for v in released:  # victims keep their GPUs through the grace period; the others keep running
            self.state.allocate(v.job_id, v.placement.assignments)
        if plan is None:
            for e, _, removed in shrunk:
                self.state.allocate(e.job_id, removed)
            job.room_retry_at = now + self.config.room_retry_s
            return
        for e, new, _ in shrunk:
            self.stats["shrinks"] += 1
            decisions.append(Resize(e.job_id, new, e.gpus, f"shrunk to make room for {req.job_id}", "shrunk"))
            self._set_placement(e, new)
        for n in plan.node_indices():  # the plans taken over: their jobs wait again, as if never planned
            holder = self._earmarked.get(n)
            if holder is not None and holder != req.job_id:
                self._drop_plan(self.jobs[holder])
                self.jobs[holder].reason = f"its preemption plan was taken over by starving gang {req.job_id}"
        if not chosen:
            self._place(job, plan, now, decisions)
            return
        for v in chosen:
            self._victim_of.setdefault(v.job_id, set()).add(req.job_id)
            if v.state is JobState.PREEMPTING:
                continue  # already stopping, by its own deadline
            rule = rules[v.job_id]
            why = {"pool": f"reclaiming team {req.team}'s dedicated pool",
                   "own-team": f"{priority_name(job.rank)} job {req.job_id} of its own team needs its GPUs",
                   "preemptible": f"{priority_name(job.rank)} job {req.job_id} needs its GPUs",
                   "critical": f"critical job {req.job_id} (within team {req.team}'s critical quota) needs its GPUs",
                   "fair-share": f"{priority_name(job.rank)} job {req.job_id} of team {req.team} (under its fair "
                                 f"share) needs its GPUs; team {v.req.team} holds a larger share",
                   "starving": f"job {req.job_id} of team {req.team} (under its fair share) waited past its bound",
                   }[rule]
            at = self._next_checkpoint(v, now) if starving else now
            deadline = at + self.config.grace_s
            self._signal(v, deadline)
            v.preempt_at = at if at > now else math.nan
            decisions.append(Preempt(v.job_id, deadline, req.job_id, why, v.preempt_at, rule))
        job.planned = plan
        job.waiting_on = frozenset(v.job_id for v in chosen)
        job.reason = f"preempting {len(chosen)} job(s); they checkpoint then stop"
        for n in plan.node_indices():
            self._earmarked[n] = req.job_id

    def _next_checkpoint(self, v: Job, now: float) -> float:
        """The victim's next periodic checkpoint boundary after its last one, so that every start makes at least
        one checkpoint of progress (two starving gangs cannot preempt each other in a loop that trains nothing).
        The interval: learned from its commits, else declared, else `SchedulerConfig.checkpoint_interval_s`."""
        every = v.checkpoint_interval_s
        if every is None:
            every = self.config.checkpoint_interval_s
        last = self.checkpoint_clock(v, now) if self.checkpoint_clock else v.last_checkpoint
        if not every or math.isnan(last):
            return now
        return last + max(1, math.ceil((now - last) / every - 1e-9)) * every

    def _victim_order(self, req: JobRequest, victims: list[Job], types: tuple[str, ...], now: float) -> list[Job]:
        """Least lost work first, node by node: jobs borrowing the requester's pool, then lower priority classes
        (preemptible first), then the least work since their last checkpoint; nodes whose every job is a cheap
        victim come first, so whole nodes (what gangs need) are freed with the fewest preemptions."""
        owner_pool = req.team in self.state.pools
        clock = self.checkpoint_clock

        def key(v: Job) -> tuple[int, int, float]:
            lost = v.gpus * (now - (clock(v, now) if clock else v.last_checkpoint))
            return (0 if owner_pool and req.team in v.borrowed_from else 1, v.rank, lost)

        keys = {v.job_id: key(v) for v in victims}
        nodes = []
        for t in types:
            for node in self.state.nodes:
                if node.gpu_type != t or not node.healthy or not node.jobs:
                    continue
                if all(j in keys for j in node.jobs):
                    worst = max(keys[j] for j in node.jobs)
                    nodes.append(((worst[0], worst[1]), sum(keys[j][2] for j in node.jobs), node.idx))
        nodes.sort()
        out: list[Job] = []
        seen: set[str] = set()
        for _, _, idx in nodes:
            for j in sorted(self.state.nodes[idx].jobs, key=keys.__getitem__):
                if j not in seen:
                    seen.add(j)
                    out.append(self.jobs[j])
        out += sorted((v for v in victims if v.job_id not in seen), key=lambda v: keys[v.job_id])
        return out

    def _shrunk(self, e: Job) -> Placement | None:
        pl = e.placement
        g = len(pl.assignments[0][1])
        step = math.lcm(g, e.req.tp * e.req.pp) // g  # nodes per resize step
        keep = len(pl.assignments)
        while keep - step >= 1 and (keep - step) * g >= e.req.floor_gpus:
            keep -= step
        if keep == len(pl.assignments):
            return None
        kept = pl.assignments[:keep]
        return Placement(pl.gpu_type, kept, compute_quality(self.state, kept, e.req.tp, e.req.pp))

    def _signal(self, v: Job, deadline: float) -> None:
        self._remove_end(v)
        v.state = JobState.PREEMPTING
        v.preempt_deadline = deadline
        v.num_preemptions += 1
        self.stats["preemptions"] += 1
        self._preempting[v.job_id] = None
        self._add_end(v)

    def _victim_done(self, victim: str) -> None:
        self._preempting.pop(victim, None)
        for p in self._victim_of.pop(victim, ()):
            pj = self.jobs.get(p)
            if pj is not None:
                pj.waiting_on = pj.waiting_on - {victim}

    def _drop_plan(self, job: Job) -> None:
        if job.planned is not None:
            for n in job.planned.node_indices():
                if self._earmarked.get(n) == job.job_id:
                    del self._earmarked[n]
        job.planned = None
        job.waiting_on = frozenset()

    # -- elastic growth and failed-node replacement -------------------------------------------------------
    def _grow(self, now: float, decisions: list[Decision]) -> None:
        waiting = {t for c, n in self._pending_count.items() if n for t in self.class_types(c)}
        for job_id in sorted(self._elastic):
            e = self.jobs[job_id]
            if e.state is not JobState.RUNNING or e.gpus >= e.req.num_gpus or e.placement.gpu_type in waiting:
                continue
            t = e.placement.gpu_type
            g = len(e.placement.assignments[0][1])
            step = math.lcm(g, e.req.tp * e.req.pp)
            extra = min(e.req.num_gpus - e.gpus, self.state.free_in(t, self.state.pools)) // step * step
            while extra > 0 and not self._quota_types(e, (t,), extra):
                extra -= step
            if extra <= 0:
                continue
            own = set(e.placement.node_indices())
            blocked = own | set(self._earmarked)
            add = None
            for tier in self._tiers(e.req.team):
                add = find_placement(self.state, t, extra, tp=e.req.tp, pp=e.req.pp, gpus_per_node=g, pools=tier,
                                     blocked=blocked)
                if add is not None:
                    break
            if add is None:
                continue
            assignments = e.placement.assignments + add.assignments
            new = Placement(t, assignments, compute_quality(self.state, assignments, e.req.tp, e.req.pp))
            old = e.gpus
            self.state.allocate(job_id, add.assignments)
            self._set_placement(e, new)
            self.stats["grows"] += 1
            decisions.append(Resize(job_id, new, old, "grown into idle capacity", "grown"))

    def _replace_lost(self, job: Job, lost: set[int]) -> Placement | None:
        pl = job.placement
        lost_pos = [p for p, (n, _) in enumerate(pl.assignments) if n in lost]
        g = len(pl.assignments[lost_pos[0]][1])
        blocked = set(pl.node_indices()) | set(self._earmarked)
        for tier in self._tiers(job.req.team):
            add = find_placement(self.state, pl.gpu_type, g * len(lost_pos), tp=job.req.tp, pp=1, gpus_per_node=g,
                                 pools=tier, blocked=blocked)
            if add is not None:
                new = list(pl.assignments)
                for p, a in zip(lost_pos, add.assignments, strict=True):
                    new[p] = a
                return Placement(pl.gpu_type, tuple(new), compute_quality(self.state, new, job.req.tp, job.req.pp))
        return None

    def _move(self, job: Job, new: Placement) -> None:
        old = set(job.placement.node_indices())
        keep = set(new.node_indices())
        self.state.release(job.job_id, old - keep)
        self.state.allocate(job.job_id, [(n, g) for n, g in new.assignments if n not in old])
        self._set_placement(job, new)

    # -- bookkeeping --------------------------------------------------------------------------------------
    def _place(self, job: Job, pl: Placement, now: float, decisions: list[Decision]) -> None:
        self._dequeue(job)
        self.state.allocate(job.job_id, pl.assignments)
        job.state = JobState.RUNNING
        job.start_time = now
        if math.isnan(job.last_checkpoint):
            job.last_checkpoint = now
        job.boost = Boost.NORMAL
        job.reason = "running"
        self._reserved.discard(job.job_id)
        job.reserved_since = math.nan
        job.placement = None
        self._set_placement(job, pl)
        decisions.append(Start(job.job_id, pl))

    def _set_placement(self, job: Job, pl: Placement) -> None:
        """Swap the job's placement in the accounting (GPUs held per team, borrowed pools, running ends)."""
        team = self._alloc.setdefault(job.req.team, {})
        if job.placement is not None:
            self._remove_end(job)
            team[job.placement.gpu_type] -= job.placement.num_gpus
        job.placement = pl
        team[pl.gpu_type] = team.get(pl.gpu_type, 0) + pl.num_gpus
        nodes = self.state.nodes
        job.borrowed_from = frozenset(nodes[n].pool for n in pl.node_indices()
                                      if nodes[n].pool not in (SHARED_POOL, job.req.team))
        self._add_end(job)

    def _unplace(self, job: Job) -> None:
        pl = job.placement
        if pl is None:
            return
        self._remove_end(job)
        self.state.release(job.job_id, pl.node_indices())
        self._alloc[job.req.team][pl.gpu_type] -= pl.num_gpus
        job.placement = None
        job.borrowed_from = frozenset()
        self._preempting.pop(job.job_id, None)

    def _add_end(self, job: Job) -> None:
        self._epoch += 1
        self._running_on[job.placement.gpu_type][job.job_id] = None
        bisect.insort(self._running_ends[job.placement.gpu_type], (job.est_end, job.seq, job.job_id))

    def _remove_end(self, job: Job) -> None:
        self._epoch += 1
        self._running_on[job.placement.gpu_type].pop(job.job_id, None)
        lst = self._running_ends[job.placement.gpu_type]
        i = bisect.bisect_left(lst, (job.est_end, job.seq, job.job_id))
        if i < len(lst) and lst[i][2] == job.job_id:
            del lst[i]

    def _enqueue(self, job: Job) -> None:
        req = job.req
        cls = req.gpu_type
        lst = self._pending.setdefault(cls, {}).setdefault(job.rank, {}).setdefault(req.team, [])
        bisect.insort(lst, (int(job.boost), job.submit_time, job.seq, req.job_id))
        self._pending_count[cls] = self._pending_count.get(cls, 0) + 1

    def _dequeue(self, job: Job) -> None:
        req = job.req
        lst = self._pending.get(req.gpu_type, {}).get(job.rank, {}).get(req.team)
        if not lst:
            return
        key = (int(job.boost), job.submit_time, job.seq, req.job_id)
        i = bisect.bisect_left(lst, key)
        if i < len(lst) and lst[i] == key:
            del lst[i]
            self._pending_count[req.gpu_type] -= 1

    # -- views --------------------------------------------------------------------------------------------
    def pending(self) -> list[Job]:
        return [j for j in self.jobs.values() if j.state is JobState.PENDING]

    def running(self) -> list[Job]:
        return [j for j in self.jobs.values() if j.state is not JobState.PENDING]

