"""From a job spec to its manifests: plan -> placement -> render (pure; what `trainforge render` prints).

The placement comes from the scheduler's own placement function on an empty cluster (a preview, no database);
`submit --backend kubernetes` asks the live scheduler instead, so the nodes are really reserved.
"""

from __future__ import annotations

from typing import Any

from trainforge.contract.config import ResolvedDataset, SegmentConfig
from trainforge.infra.k8s.render import RUN_DIR, K8sOptions, render_job
from trainforge.infra.scheduler.model import SHARED_POOL
from trainforge.infra.scheduler.placement import find_placement
from trainforge.infra.scheduler.state import ClusterState
from trainforge.plan.cluster import ClusterSpec
from trainforge.plan.job import auto_checkpoint_interval, make_plan
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


def preview_worker_config(spec: JobSpec, job_id: str, plan: dict[str, Any], storage_url: str,
                          dataset: ResolvedDataset | None = None) -> SegmentConfig:
    """The job's SegmentConfig as a pod reads it. `dataset`: the resolved version (submit resolves it); without it
    (`trainforge render`, a preview that resolves nothing) the dataset is the spec's reference, unpinned, and a
    worker refuses to train on it. Paths are the pod's: the run folder and node-local staging on its emptyDir, the
    code on the image's Python path."""
    if dataset is None:
        d = spec.dataset
        dataset = ResolvedDataset(ref=d.ref, license=d.license, eval_fraction=d.eval_fraction,
                                  transforms=d.transforms, num_workers=d.num_workers)
    interval = spec.checkpoint.interval_steps
    if interval == "auto":
        interval = auto_checkpoint_interval(spec, plan)
    return SegmentConfig.build(spec, dataset, plan, job_id=job_id, run_dir=RUN_DIR, storage_url=storage_url,
                               staging_dir=f"{RUN_DIR}/staging", code_dir="", code_commit=spec.code.commit or "unknown",
                               checkpoint_interval=int(interval))


def manifests_for_spec(spec: JobSpec, job_id: str, cluster: ClusterSpec, options: K8sOptions | None = None,
                       storage_url: str = "s3://trainforge",
                       dataset: ResolvedDataset | None = None) -> list[dict[str, Any]]:
    plan = make_plan(spec, cluster)
    placement = preview_placement(spec, cluster, plan["layout"])
    config = preview_worker_config(spec, job_id, plan, storage_url, dataset)
    return render_job(spec, job_id, cluster, placement, config, options)
