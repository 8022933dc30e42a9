"""The job's plan as the control plane records it, from the validated spec and the cluster: the layout (the
advisor's under `strategy: auto`) with the planner's predictions, and the checkpoint interval in steps when the
spec says `interval_steps: auto`.

Pure, like the rest of plan/: the tasks, the Kubernetes renderer and the CLI all call it (tasks/prepare.py
re-exports both names for the flow's steps).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from trainforge.plan.advisor import evaluate_layout
from trainforge.plan.checkpointing import plan_checkpoints
from trainforge.plan.cluster import ClusterSpec, default_cluster
from trainforge.plan.layout import Layout
from trainforge.plan.model import shape_from_spec
from trainforge.plan.resolve import plan_request, resolve_layout
from trainforge.spec import JobSpec


def make_plan(spec: JobSpec, cluster: ClusterSpec | None = None, layout: Layout | None = None) -> dict[str, Any]:
    """The layout (the advisor's under `strategy: auto`) with the planner's predictions for it. `layout`: the one
    validation already resolved (ValidationReport.layout, same spec and cluster), so it is not resolved again."""
    cluster = cluster or default_cluster()
    shape = shape_from_spec(spec.model, spec.name)
    layout = layout or resolve_layout(spec, shape, cluster)
    predicted = evaluate_layout(plan_request(spec, shape, cluster), layout)
    step = predicted.step
    return {"layout": asdict(layout), "model": {"layers": shape.layers, "hidden": shape.hidden, "heads": shape.heads,
            "kv_heads": shape.kv_heads, "ffn_hidden": shape.ffn_hidden, "vocab": shape.vocab,
            "experts": shape.experts, "top_k": shape.top_k},
            "parameters": shape.total_params, "world_size": layout.world_size,
            "memory_per_gpu_bytes": predicted.memory.total_bytes,
            "predicted": None if step is None else {"step_time_s": step.step_time_s, "mfu": step.mfu,
                                                    "tokens_per_s": step.tokens_per_s,
                                                    "bubble_fraction": step.bubble_fraction}}


def auto_checkpoint_interval(spec: JobSpec, plan: dict[str, Any], cluster: ClusterSpec | None = None) -> int:
    """Young/Daly optimum (trainforge.plan.checkpointing) in steps, from the checkpoint's write cost, the job's
    nodes' MTBF and the planner's predicted step time. Async saves block only while staging (~10% of a write)."""
    cluster = cluster or default_cluster()
    shape = shape_from_spec(spec.model, spec.name)
    nodes = max(1, spec.resources.world_size // max(1, min(spec.resources.gpus_per_node, spec.resources.world_size)))
    step_s = (plan.get("predicted") or {}).get("step_time_s") or 1.0
    result = plan_checkpoints(shape, nodes=nodes, node_mtbf_hours=cluster.node_mtbf_hours, step_time_s=step_s,
                              precision=spec.training.precision.value,
                              async_stall_fraction=0.1 if spec.checkpoint.async_save else 1.0)
    return max(1, min(spec.training.total_steps, result.interval_steps))
