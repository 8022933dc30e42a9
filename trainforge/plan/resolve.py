"""Turn a spec's parallelism hints into one concrete Layout.

Degrees the user fixed are respected (expert override). Unset degrees are filled by the advisor when
`strategy: auto` and the advisor is available; otherwise the simple rule applies: tp = pp = ep = 1 and dp takes the
rest of the world size.
"""

from __future__ import annotations

from trainforge.plan.cluster import ClusterSpec
from trainforge.plan.layout import Layout
from trainforge.plan.model import ModelShape
from trainforge.spec import JobSpec


def default_micro_batch(global_batch_size: int, dp: int, cap: int = 8) -> int:
    """Largest micro-batch <= cap that divides the per-replica batch (fewest accumulation steps)."""
    per_replica = max(1, global_batch_size // dp)
    return max(d for d in range(1, min(cap, per_replica) + 1) if per_replica % d == 0)


def resolve_layout(spec: JobSpec, shape: ModelShape, cluster: ClusterSpec) -> Layout:
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
