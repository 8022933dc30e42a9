"""Cluster scheduler: pure policy (gang, topology-aware placement, fair share, priorities and preemption,
EASY backfill, elastic, failures) in `policy`/`placement`/`state`, and the database-backed live scheduler in
`live` (imported lazily: it needs SQLAlchemy)."""

from trainforge.infra.scheduler.model import (
    Decision,
    Job,
    JobRequest,
    JobState,
    Kill,
    Placement,
    PlacementQuality,
    Preempt,
    Requeue,
    Resize,
    SchedulerConfig,
    Start,
    TeamPolicy,
)
from trainforge.infra.scheduler.placement import find_placement
from trainforge.infra.scheduler.policy import Scheduler
from trainforge.infra.scheduler.state import ClusterState, NodeInfo

__all__ = [
    "ClusterState", "Decision", "Job", "JobRequest", "JobState", "Kill", "NodeInfo", "Placement",
    "PlacementQuality", "Preempt", "Requeue", "Resize", "Scheduler", "SchedulerConfig", "Start", "TeamPolicy",
    "find_placement",
]
