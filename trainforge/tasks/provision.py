"""Provisioning the gang: all of a job's worker slots at once, or none.

The live scheduler (trainforge.infra.scheduler.live) admits the gang against the cluster inventory shared by every
flow run on this host (SQLite in $TRAINFORGE_HOME); the local backend's inventory is this machine's worker slots.
"""

from __future__ import annotations

import os
from typing import Any

from trainforge.plan.cluster import default_cluster
from trainforge.spec import JobSpec

PROVISION_TIMEOUT_S = float(os.environ.get("TRAINFORGE_PROVISION_TIMEOUT_S", "600"))


def live_scheduler():  # -> LiveScheduler
    """The scheduler of the configured cluster, with its teams' weights and quotas; state in
    $TRAINFORGE_SCHEDULER_URL (PostgreSQL in production) or SQLite in $TRAINFORGE_HOME."""
    from trainforge.infra.scheduler.live import LiveScheduler
    from trainforge.infra.scheduler.model import TeamPolicy

    cluster = default_cluster()
    teams = {name: TeamPolicy(weight=t.weight, quota=dict(t.quota)) for name, t in cluster.teams.items()}
    return LiveScheduler(cluster, os.environ.get("TRAINFORGE_SCHEDULER_URL") or None, teams=teams or None)


def provision_gang(job_id: str, spec: JobSpec, layout: dict[str, Any]) -> dict[str, Any]:
    """Admit the whole gang with the plan's layout (TP groups within a node, pipelines within a rack)."""
    from trainforge.infra.scheduler.live import GangRequest

    request = GangRequest(
        job_id=job_id, team=spec.team, priority=spec.priority.value, gpu_type=spec.resources.gpu_type.value,
        num_gpus=spec.resources.world_size, gpus_per_node=min(spec.resources.gpus_per_node,
                                                              spec.resources.world_size),
        tp=layout["tp"], pp=layout["pp"], dp=layout["dp"],
        max_runtime_s=spec.max_runtime_s,
    )
    allocation = live_scheduler().request(request, timeout_s=PROVISION_TIMEOUT_S)
    return {"workers": spec.resources.world_size, "job_id": job_id, "placement": repr(allocation)}


def release_gang(job_id: str) -> None:
    live_scheduler().release(job_id)
