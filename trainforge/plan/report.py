"""What the advisor tells people: the winner against its alternatives, and the stable JSON schema of a plan.

JSON schema `trainforge.plan/v1` (one object per plan; `trainforge plan --json` prints
`{"schema", "request", "search", "plans": [...], "explanation", "checkpoint"}`):

    feasible            bool: obeys every rule and fits in memory
    problems            [{"field", "message", "fix"}]: broken rules (empty when feasible)
    layout              {"dp", "tp", "pp", "ep", "vpp", "micro_batch_size", "schedule", "sharding",
                         "activation_checkpointing", "gradient_accumulation_steps"}
    memory              {"total_bytes", "capacity_bytes", "fits", "items": {name: bytes}}
    comm                {"bytes_per_iteration": {kind: bytes per GPU}, "time_s": {kind: s},
                         "exposed_s": {"tp"|"pp"|"dp"|"ep": s},
                         "overlap": [{"name", "axis", "total_s", "window_s", "hidden_s", "exposed_s", "rule"}]}
    performance         {"step_time_s", "tokens_per_s", "mfu", "hfu", "bubble_fraction", "compute_s",
                         "bubble_s", "exposed_comm_s", "optimizer_s", "matmul_efficiency"} or null if infeasible
Fields are only ever added, never renamed or removed, within a schema version.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainforge.plan.advisor import SHARDING_RANK, Plan, PlanRequest, SearchResult
from trainforge.plan.layout import gradient_accumulation_steps

SCHEMA = "trainforge.plan/v1"
GiB = 2**30
AC_RANK = {"none": 0, "selective": 1, "full": 2}


def plan_to_dict(plan: Plan, req: PlanRequest) -> dict[str, Any]:
    lay = plan.layout
    step = plan.step
    out: dict[str, Any] = {
        "feasible": plan.feasible,
        "problems": [{"field": p.field, "message": p.message, "fix": p.fix} for p in plan.problems],
        "layout": {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "ep": lay.ep, "vpp": lay.vpp,
                   "micro_batch_size": lay.micro_batch_size, "schedule": lay.schedule, "sharding": lay.sharding,
                   "activation_checkpointing": lay.activation_checkpointing,
                   "gradient_accumulation_steps": gradient_accumulation_steps(lay, req.global_batch_size)},
        "memory": {"total_bytes": plan.memory.total_bytes, "capacity_bytes": plan.memory.capacity_bytes,
                   "fits": plan.memory.fits, "items": plan.memory.by_name()},
        "comm": None,
        "performance": None,
    }
    if step is not None:
        bytes_by: dict[str, float] = {}
        time_by: dict[str, float] = {}
        for c in step.comm:
            bytes_by[c.kind] = bytes_by.get(c.kind, 0) + c.bytes_per_gpu
            time_by[c.kind] = time_by.get(c.kind, 0) + c.time_s
        out["comm"] = {"bytes_per_iteration": {k: int(v) for k, v in bytes_by.items()}, "time_s": time_by,
                       "exposed_s": dict(step.exposed_by_axis),
                       "overlap": [{"name": t.name, "axis": t.axis, "total_s": t.total_s, "window_s": t.window_s,
                                    "hidden_s": t.hidden_s, "exposed_s": t.exposed_s, "rule": t.rule}
                                   for t in step.overlap]}
        out["performance"] = {
            "step_time_s": step.step_time_s, "tokens_per_s": step.tokens_per_s, "mfu": step.mfu, "hfu": step.hfu,
            "bubble_fraction": step.bubble_fraction, "compute_s": step.compute_s, "bubble_s": step.bubble_s,
            "exposed_comm_s": step.exposed_comm_s, "optimizer_s": step.optimizer_s,
            "matmul_efficiency": step.matmul_efficiency,
        }
    return out


def request_to_dict(req: PlanRequest) -> dict[str, Any]:
    m = req.model
    return {"model": {"name": m.name, "params": m.total_params, "layers": m.layers, "hidden": m.hidden,
                      "heads": m.heads, "kv_heads": m.kv_heads, "ffn_hidden": m.ffn_hidden, "vocab": m.vocab,
                      "mlp": m.mlp, "experts": m.experts, "top_k": m.top_k},
            "gpu": req.gpu.name, "gpus": req.world_size, "gpus_per_node": req.topology.gpus_per_node,
            "intra_node_link": req.topology.intra.name, "inter_node_link": req.topology.inter.name,
            "global_batch_size": req.global_batch_size, "seq_len": req.seq_len, "precision": req.precision,
            "fixed": dict(req.fixed), "engine": req.engine}


def _alternatives(w: Plan) -> list[tuple[str, Callable[[Plan], bool]]]:
    lw = w.layout
    return [
        ("more TP", lambda p: p.layout.tp > lw.tp),
        ("less TP", lambda p: p.layout.tp < lw.tp),
        ("more PP", lambda p: p.layout.pp > lw.pp),
        ("less PP", lambda p: p.layout.pp < lw.pp),
        ("more sharding", lambda p: SHARDING_RANK[p.layout.sharding] > SHARDING_RANK[lw.sharding]
         and p.layout.sharding != "hybrid-shard"),
        ("less sharding", lambda p: SHARDING_RANK[p.layout.sharding] < SHARDING_RANK[lw.sharding]),
        ("less recomputation", lambda p: AC_RANK[p.layout.activation_checkpointing]
         < AC_RANK[lw.activation_checkpointing]),
        ("more recomputation", lambda p: AC_RANK[p.layout.activation_checkpointing]
         > AC_RANK[lw.activation_checkpointing]),
        ("bigger micro-batch", lambda p: p.layout.micro_batch_size > lw.micro_batch_size),
        ("smaller micro-batch", lambda p: p.layout.micro_batch_size < lw.micro_batch_size),
    ]


def _why_slower(best: Plan, other: Plan) -> str:
    a, b = best.step, other.step
    assert a is not None and b is not None
    parts = {
        "compute (incl. recomputation, thinner matmuls)": b.compute_s - a.compute_s,
        "pipeline bubble": b.bubble_s - a.bubble_s,
        "exposed TP comm": b.exposed_by_axis["tp"] - a.exposed_by_axis["tp"],
        "exposed PP send/recv": b.exposed_by_axis["pp"] - a.exposed_by_axis["pp"],
        "exposed DP comm": b.exposed_by_axis["dp"] - a.exposed_by_axis["dp"],
        "exposed EP all-to-all": b.exposed_by_axis["ep"] - a.exposed_by_axis["ep"],
        "optimizer step": b.optimizer_s - a.optimizer_s,
    }
    worst = sorted(((v, k) for k, v in parts.items() if v > 1e-4), reverse=True)[:2]
    return ", ".join(f"{k} +{v:.2f} s" for v, k in worst) or "within noise"


def explain(result: SearchResult, top: int = 3) -> list[str]:
    """Why the winner: each runner-up's gap, then the best plan in each direction it did not take."""
    if not result.plans:
        return []
    best = result.plans[0]
    assert best.step is not None
    lines = [f"winner {best.layout.describe()}: {best.step.step_time_s:.2f} s/step, MFU {best.step.mfu:.1%}, "
             f"{best.memory.total_bytes / GiB:.1f} GiB/GPU"]
    for p in result.plans[1:top]:
        assert p.step is not None
        gap = p.step.step_time_s / best.step.step_time_s - 1
        lines.append(f"runner-up {p.layout.describe()}: {gap:+.1%} step time ({_why_slower(best, p)})")
    for label, pred in _alternatives(best):
        alt = next((p for p in result.plans if pred(p)), None)
        if alt is not None:
            assert alt.step is not None
            gap = alt.step.step_time_s / best.step.step_time_s - 1
            lines.append(f"why not {label}: best such layout {alt.layout.describe()} is {gap:+.1%} slower "
                         f"({_why_slower(best, alt)})")
            continue
        big = next((p for p in result.too_big if pred(p)), None)
        if big is not None:
            lines.append(f"why not {label}: the closest such layout {big.layout.describe()} needs "
                         f"{big.memory.total_bytes / GiB:.1f} GiB > {big.memory.capacity_bytes / GiB:.1f} GiB")
    return lines
