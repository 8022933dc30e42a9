"""Elastic data-parallel sizes, pure: the world sizes an elastic job can run at and the layout at each size.

The layout of a size keeps tp / pp and the global batch: dp = world / (tp * pp), and gradient accumulation
(local batch / micro-batch) absorbs the change, so the learning-rate schedule and the sample order (a function of
the step and the global batch only) are unchanged. Used by provisioning (tasks/provision.py) and by whatever
decides a resize; it imports only the spec.
"""

from __future__ import annotations

from typing import Any

from trainforge.spec import JobSpec


def elastic_sizes(spec: JobSpec, layout: dict[str, Any]) -> list[int]:
    """World sizes the job can run at, largest first: multiples of tp * pp and of whole nodes between min_gpus and
    max_gpus whose dp divides the global batch (and is a multiple of ep). A fixed-size job,
    or one on the DeepSpeed engine (its ZeRO partitions do not reshard), has one size: min_gpus."""
    res = spec.resources
    if not res.elastic or spec.parallelism.engine == "deepspeed":
        return [res.world_size]
    unit = layout.get("tp", 1) * layout.get("pp", 1)
    batch = spec.training.global_batch_size
    top = res.max_gpus or res.min_gpus
    # The gang is requested with one node shape (gpus_per_node of the largest size), so every size is whole
    # nodes of it: the scheduler places, grows and shrinks an elastic job node by node.
    node = min(res.gpus_per_node, top)
    out = []
    for world in range(top, res.min_gpus - 1, -1):
        if world % unit or world % node or node % layout.get("tp", 1):
            continue
        dp = world // unit
        if batch % dp or dp % layout.get("ep", 1):
            continue
        out.append(world)
    return out or [res.world_size]


def layout_for(layout: dict[str, Any], world: int, global_batch: int) -> dict[str, Any]:
    """The plan's layout at `world` workers: same tp / pp / sharding, dp = world / (tp * pp); the micro-batch stays
    unless the local batch got smaller than it (then the largest divisor of the local batch below it), so
    accumulation = local batch / micro-batch keeps the global batch."""
    dp = world // (layout.get("tp", 1) * layout.get("pp", 1))
    local = global_batch // dp
    micro = max(d for d in range(1, min(layout.get("micro_batch_size", 1), local) + 1) if local % d == 0)
    return {**layout, "dp": dp, "micro_batch_size": micro}


def accumulation(layout: dict[str, Any], global_batch: int) -> int:
    return global_batch // layout["dp"] // layout["micro_batch_size"]
