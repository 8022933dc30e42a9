"""Turn a spec's parallelism hints into one concrete Layout.

`strategy: explicit`: unset degrees are tp = pp = ep = 1 and dp takes the rest of the world size (the simple rule;
validation then reports anything that breaks). `strategy: auto`: the advisor searches every valid layout with the
fields the user set held fixed (expert override) and returns the fastest that fits; if none fits it raises a
ValueError that says by how much and what to change.
"""

from __future__ import annotations

from typing import Any

from trainforge.plan.advisor import PlanRequest, search
from trainforge.plan.cluster import ClusterSpec
from trainforge.plan.hardware import gpu_spec
from trainforge.plan.layout import Layout
from trainforge.plan.model import ModelShape
from trainforge.plan.topology import topology_for
from trainforge.spec import JobSpec


def default_micro_batch(global_batch_size: int, dp: int, cap: int = 8) -> int:
    """Largest micro-batch <= cap that divides the per-replica batch (fewest accumulation steps)."""
    per_replica = max(1, global_batch_size // dp)
    return max(d for d in range(1, min(cap, per_replica) + 1) if per_replica % d == 0)


def fixed_fields(spec: JobSpec) -> dict[str, Any]:
    """The layout fields the user set in the spec (pydantic's fields_set tells a default from a choice)."""
    par = spec.parallelism
    given = par.model_fields_set
    out: dict[str, Any] = {}
    for name in ("dp", "tp", "pp", "ep", "micro_batch_size"):
        value = getattr(par, name)
        if value is not None:
            out[name] = value
    if "virtual_stages" in given:
        out["vpp"] = par.virtual_stages
    if "pipeline_schedule" in given:
        out["schedule"] = par.pipeline_schedule.value
    if par.sharding is not None:
        out["sharding"] = par.sharding.value
    if par.activation_checkpointing is not None:
        out["activation_checkpointing"] = par.activation_checkpointing.value
    return out


def plan_request(spec: JobSpec, shape: ModelShape, cluster: ClusterSpec) -> PlanRequest:
    """The advisor's request for a spec on a cluster (the flow, validation and `trainforge plan JOB` share it)."""
    gpu = gpu_spec(spec.resources.gpu_type.value)
    world = spec.resources.world_size
    topo = topology_for(cluster, gpu.name, min(spec.resources.gpus_per_node, world))
    return PlanRequest(shape, gpu, topo, world, spec.training.global_batch_size, spec.training.seq_len,
                       spec.training.precision.value, fixed_fields(spec), engine=spec.parallelism.engine)


def resolve_layout(spec: JobSpec, shape: ModelShape, cluster: ClusterSpec) -> Layout:
    par = spec.parallelism
    if par.strategy == "auto":
        return search(plan_request(spec, shape, cluster)).best.layout
    return explicit_layout(spec)


def explicit_layout(spec: JobSpec) -> Layout:
    par = spec.parallelism
    world = spec.resources.world_size
    tp, pp, ep = par.tp or 1, par.pp or 1, par.ep or 1
    if par.dp is not None:
        dp = par.dp
    else:
        if world % (tp * pp):
            raise ValueError(
                f"world size ({world}) is not divisible by tp ({tp}) * pp ({pp}); "
                f"choose degrees whose product divides {world}"
            )
        dp = world // (tp * pp)
    mb = par.micro_batch_size or default_micro_batch(spec.training.global_batch_size, dp)
    return Layout(
        dp=dp, tp=tp, pp=pp, ep=ep, vpp=par.virtual_stages, micro_batch_size=mb,
        schedule=par.pipeline_schedule.value,
        sharding=(par.sharding.value if par.sharding else "none"),
        activation_checkpointing=(par.activation_checkpointing.value if par.activation_checkpointing else "none"),
    )
