"""Value types of the scheduler policy: job requests, running jobs, placements, team policies and decisions.

Plain dataclasses (the hot path); the live scheduler's API types (`GangRequest`, `Allocation`) are in live.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import Literal

from trainforge.spec import Priority

SHARED_POOL = "shared"
ANY_GPU = "any"


class JobState(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    PREEMPTING = "preempting"
    """Told to checkpoint and stop; its GPUs stay held until it stops or its grace period ends."""


class Boost(IntEnum):
    """Requeued after a failure goes first: within its team's priority class, and its team first when the teams'
    queues are merged by fair share."""

    REQUEUED = 0
    NORMAL = 1


_RANKS = {p.value: p.rank for p in Priority}


def priority_rank(priority: str) -> int:
    try:
        return _RANKS[priority]
    except KeyError:
        names = ", ".join(p.value for p in Priority)
        raise ValueError(f"unknown priority {priority!r}; use one of {names}") from None


def priority_name(rank: int) -> str:
    return next(name for name, r in _RANKS.items() if r == rank)


@dataclass(frozen=True, slots=True, kw_only=True)
class JobRequest:
    """What the policy needs to know about a gang. `num_gpus` is the (maximum) size; `min_gpus` < `num_gpus`
    makes the job elastic."""

    job_id: str
    team: str
    priority: str = "normal"
    gpu_type: str = ANY_GPU
    """One type, several separated by `|` (the job still gets one type), or `any`."""
    num_gpus: int
    min_gpus: int | None = None
    """None = not elastic (min = num_gpus)."""
    gpus_per_node: int | None = None
    """None = let placement choose (fewest nodes whose GPU count is a multiple of tp)."""
    tp: int = 1
    pp: int = 1
    max_runtime_s: float = 86_400.0
    """Runtime estimate used for backfill reservations (EASY)."""
    checkpoint_interval_s: float | None = None
    """Declared (a trace's); None = learned from the commits the job reports (`Job.checkpoint_every`)."""
    user: str = ""
    """Who submitted it: runtime estimates look at the user's own similar jobs first (estimates.py)."""

    def __post_init__(self) -> None:
        priority_rank(self.priority)
        if self.num_gpus < 1:
            raise ValueError(f"job {self.job_id}: num_gpus ({self.num_gpus}) must be >= 1")
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"job {self.job_id}: tp ({self.tp}) and pp ({self.pp}) must be >= 1")
        if self.num_gpus % (self.tp * self.pp):
            raise ValueError(f"job {self.job_id}: num_gpus ({self.num_gpus}) is not a multiple of "
                             f"tp({self.tp}) * pp({self.pp}); dp = num_gpus / (tp * pp) must be whole")
        if self.min_gpus is not None and not (1 <= self.min_gpus <= self.num_gpus):
            raise ValueError(f"job {self.job_id}: min_gpus ({self.min_gpus}) must be in 1..num_gpus ({self.num_gpus})")
        if self.min_gpus is not None and self.min_gpus % (self.tp * self.pp):
            raise ValueError(f"job {self.job_id}: min_gpus ({self.min_gpus}) is not a multiple of tp*pp "
                             f"({self.tp * self.pp})")
        g = self.gpus_per_node
        if g is not None:
            if g < 1 or self.num_gpus % g and g < self.num_gpus:
                raise ValueError(f"job {self.job_id}: gpus_per_node ({g}) must divide num_gpus ({self.num_gpus})")
            if min(g, self.num_gpus) % self.tp:
                raise ValueError(f"job {self.job_id}: gpus_per_node ({g}) is not a multiple of tp ({self.tp}): "
                                 "a tensor-parallel group would span nodes; use a multiple of tp")

    @property
    def rank(self) -> int:
        return priority_rank(self.priority)

    @property
    def floor_gpus(self) -> int:
        return self.min_gpus if self.min_gpus is not None else self.num_gpus

    @property
    def elastic(self) -> bool:
        return self.floor_gpus < self.num_gpus


@dataclass(frozen=True, slots=True)
class PlacementQuality:
    num_nodes: int
    num_racks: int
    tp_groups: int
    tp_groups_spanning_nodes: int
    """Must be 0."""
    pp_groups: int
    pp_groups_spanning_racks: int
    partial_nodes: int
    """Nodes the job shares with free GPUs left over (fragmentation it leaves behind)."""

    def to_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__slots__}


@dataclass(frozen=True, slots=True)
class Placement:
    gpu_type: str
    assignments: tuple[tuple[int, tuple[int, ...]], ...]
    """(node index, GPU indices on that node), in rank order: ranks fill nodes in this order."""
    quality: PlacementQuality
    num_gpus: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_gpus", sum(len(g) for _, g in self.assignments))

    def node_indices(self) -> list[int]:
        return [n for n, _ in self.assignments]


@dataclass(frozen=True, slots=True)
class TeamPolicy:
    weight: float = 1.0
    quota: dict[str, int] = field(default_factory=dict)
    """Hard cap on GPUs held, per GPU type (`*` = all types together)."""
    critical_quota: int | None = None
    """GPUs (all types together) the team's `critical` jobs may ask for at once; a `critical` job beyond it is
    scheduled as `high`. None = `SchedulerConfig.critical_share` of the cluster."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    policy: str = "ours"
    """`ours` (priorities, DRF fair share, EASY backfill, preemption, elastic, lending), `fifo`, `fifo-backfill`."""
    grace_s: float = 120.0
    """Checkpoint-then-stop grace period given to preemption victims."""
    backfill_depth: int = 256
    """Jobs examined for backfill behind a blocked head, per GPU class and pass (Slurm's bf_max_job_test)."""
    lending: bool = True
    """Lend idle dedicated-pool GPUs to other teams as preemptible capacity."""
    max_victims: int = 4096
    room_retry_s: float = 30.0
    """After failing to make room for a blocked head (not enough preemptible work), wait this long to retry."""
    critical_share: float = 0.1
    """`ours`: the critical quota of a team the cluster description gives none (`TeamPolicy.critical_quota`), as a
    share of the cluster's installed GPUs, rounded down: `critical` is the one priority that crosses teams."""
    patience_s: float = 3600.0
    """`ours`: a reserved gang (its team was under its fair share) whose start would come later than this after
    its reservation began preempts any job of a richer team (critical within quota aside) at its next checkpoint
    boundary (docs/scheduler.md, "No gang starves": the bound)."""

    checkpoint_interval_s: float = 1800.0
    """`ours`: the checkpoint interval assumed for a victim that neither declared one nor has shown its own yet
    (two commits in one run): a starving gang stops it at its next boundary by that, so every start keeps at least
    one interval of progress (with "checkpoint now" two starving gangs stopped each other in turn, training
    nothing). The flow's victims stop at their first commit after the notice, often sooner."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.critical_share <= 1.0:
            raise ValueError(f"critical_share ({self.critical_share}) must be within 0..1")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; use one of {', '.join(POLICIES)}")


POLICIES = ("ours", "fifo", "fifo-backfill")


@dataclass(slots=True, eq=False)
class Job:
    """A job as the policy tracks it (mutable)."""

    req: JobRequest
    submit_time: float
    seq: int
    state: JobState = JobState.PENDING
    boost: Boost = Boost.NORMAL
    placement: Placement | None = None
    start_time: float = math.nan
    last_checkpoint: float = math.nan
    preempt_deadline: float = math.nan
    borrowed_from: frozenset[str] = frozenset()
    planned: Placement | None = None
    """Placement reserved for this job while its preemption victims drain."""
    waiting_on: frozenset[str] = frozenset()
    reason: str = "queued"
    num_preemptions: int = 0
    num_requeues: int = 0
    room_retry_at: float = -math.inf
    """Making room (shrink/preempt) for this job failed: do not retry before this time."""
    reserved_since: float = math.nan
    """When this gang got a standing reservation (it was the head of its class and its team under its fair
    share): from then on it is ordered before every job of its class but critical ones, until it starts. NaN = none."""
    rank: int = -1
    """The priority the policy schedules it at: its request's, except a `critical` job beyond its team's critical
    quota when submitted, which runs as `high` (-1 here = the request's)."""
    last_commit: float = math.nan
    """When the job last reported a committed checkpoint (`Scheduler.checkpointed`); NaN = none yet."""
    checkpoint_every: float = math.nan
    """Its checkpoint interval in seconds, learned from its reports: the gap between its last two commits of one
    run (a gap across a stop and restart holds a queue wait, so it is not one). NaN = not learned yet."""
    preempt_at: float = math.nan
    """A victim told to stop at its next checkpoint boundary: that boundary (it trains on until then and stops
    once that checkpoint is written, by `preempt_deadline`). NaN = checkpoint on notice."""

    def __post_init__(self) -> None:
        if self.rank < 0:
            self.rank = self.req.rank

    @property
    def job_id(self) -> str:
        return self.req.job_id

    @property
    def gpus(self) -> int:
        return self.placement.num_gpus if self.placement else 0

    @property
    def checkpoint_interval_s(self) -> float | None:
        """The interval its next boundary is predicted by: learned from its commits, else the declared one."""
        if not math.isnan(self.checkpoint_every):
            return self.checkpoint_every
        return self.req.checkpoint_interval_s

    @property
    def est_end(self) -> float:
        if self.state is JobState.PREEMPTING:
            return self.preempt_deadline
        return self.start_time + self.req.max_runtime_s


# Decisions: what a pass tells the outside world to do.
@dataclass(frozen=True, slots=True)
class Start:
    job_id: str
    placement: Placement


PreemptRule = Literal["pool", "own-team", "preemptible", "critical", "fair-share", "starving"]


@dataclass(frozen=True, slots=True)
class Preempt:
    job_id: str
    deadline: float
    for_job: str
    reason: str
    at_checkpoint: float = math.nan
    """Stop at this checkpoint boundary (the job's next periodic checkpoint: nothing is lost, and the deadline is
    this plus the grace period). NaN = checkpoint on notice and stop within the grace period."""
    rule: PreemptRule | None = None
    """Which rule of the policy allowed it, decided when it was (shares change as jobs start; None = a model of
    another scheduler): `pool` (the owner reclaims its dedicated pool), `own-team` (lower priority, same team),
    `preemptible`, `critical` (within the requester's critical quota), `fair-share` (an under-share team takes a
    lower-priority job of a team holding a larger share), `starving` (a reserved gang past its patience takes a
    richer team's job at its next checkpoint boundary)."""


@dataclass(frozen=True, slots=True)
class Kill:
    """A preemption victim's grace period ended: its GPUs were taken back."""

    job_id: str


ResizeCause = Literal["lost_workers", "shrunk", "grown"]
"""Why a gang changed size: workers lost to a node failure or spot reclaim were replaced (the work since the last
checkpoint is lost), or the elastic job was shrunk for another job / grown into idle capacity (nothing lost)."""


@dataclass(frozen=True, slots=True)
class Resize:
    job_id: str
    placement: Placement
    old_gpus: int
    reason: str
    """For people: what happened, where."""
    cause: ResizeCause
    """For code: what the simulator and the flow act on (never the reason's text)."""


@dataclass(frozen=True, slots=True)
class Requeue:
    job_id: str
    reason: str


Decision = Start | Preempt | Kill | Resize | Requeue
