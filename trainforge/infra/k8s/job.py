"""From a job spec to its manifests: plan -> placement -> render (pure; what `trainforge render` prints).

The placement comes from the scheduler's own placement function on an empty cluster (a preview, no database);
`submit --backend kubernetes` asks the live scheduler instead, so the nodes are really reserved.
"""

from __future__ import annotations

from typing import Any

from trainforge.infra.k8s.render import K8sOptions, render_job
from trainforge.infra.scheduler.model import SHARED_POOL
from trainforge.infra.scheduler.placement import find_placement
from trainforge.infra.scheduler.state import ClusterState
from trainforge.infra.storage.layout import job_prefix
from trainforge.plan.cluster import ClusterSpec
from trainforge.plan.job import make_plan
from trainforge.spec import JobSpec


def preview_placement(spec: JobSpec, cluster: ClusterSpec, layout: dict[str, Any]) -> list[tuple[str, list[int]]]:
    state = ClusterState.from_spec(cluster)
    world = spec.resources.world_size
    placement = find_placement(state, spec.resources.gpu_type.value, world, tp=layout.get("tp", 1) or 1,
                               pp=layout.get("pp", 1) or 1,
                               gpus_per_node=min(spec.resources.gpus_per_node, world),
                               pools=[spec.team, SHARED_POOL])
    if placement is None:
        raise ValueError(f"cluster {cluster.name!r} cannot place {world} x {spec.resources.gpu_type.value} "
                         f"({spec.resources.gpus_per_node} per node) even when empty; use --cluster to name "
                         "the cluster the job is for")
    return [(state.nodes[n].name, list(g)) for n, g in placement.assignments]


def preview_worker_config(spec: JobSpec, job_id: str, plan: dict[str, Any], storage_url: str) -> dict[str, Any]:
    """The worker config's fields that do not depend on resolving the dataset (the flow fills the rest)."""
    return {"team": spec.team, "name": spec.name, "storage_url": storage_url,
            "storage_prefix": job_prefix(spec.team, job_id), "entrypoint": spec.code.entrypoint,
            "model": plan["model"], "layout": plan["layout"], "training": spec.training.model_dump(mode="json"),
            "total_steps": spec.training.total_steps, "dataset": {"ref": spec.dataset.ref},
            "config_hash": spec.config_hash()}


def manifests_for_spec(spec: JobSpec, job_id: str, cluster: ClusterSpec, options: K8sOptions | None = None,
                       storage_url: str = "s3://trainforge") -> list[dict[str, Any]]:
    plan = make_plan(spec, cluster)
    placement = preview_placement(spec, cluster, plan["layout"])
    config = preview_worker_config(spec, job_id, plan, storage_url)
    return render_job(spec, job_id, cluster, placement, config, options)
