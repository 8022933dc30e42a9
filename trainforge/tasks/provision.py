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


def provision_gang(job_id: str, spec: JobSpec) -> dict[str, Any]:
    from trainforge.infra.scheduler.live import GangRequest, LiveScheduler

    cluster = default_cluster()
    layout = spec.parallelism
    request = GangRequest(
        job_id=job_id, team=spec.team, priority=spec.priority.value, gpu_type=spec.resources.gpu_type.value,
        num_gpus=spec.resources.world_size, gpus_per_node=min(spec.resources.gpus_per_node,
                                                              spec.resources.world_size),
        tp=layout.tp or 1, pp=layout.pp or 1, dp=layout.dp or spec.resources.world_size,
        max_runtime_s=spec.max_runtime_s,
    )
    allocation = LiveScheduler(cluster).request(request, timeout_s=PROVISION_TIMEOUT_S)
    return {"workers": spec.resources.world_size, "job_id": job_id, "placement": repr(allocation)}


def release_gang(job_id: str) -> None:
    from trainforge.infra.scheduler.live import LiveScheduler

    LiveScheduler(default_cluster()).release(job_id)
