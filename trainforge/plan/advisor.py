"""The auto-parallelism advisor: enumerate every valid layout, drop those that break a rule or do not fit, rank the
rest by predicted throughput, and explain the winner against the alternatives.

The search space: tp over divisors of the node size that suit the heads; pp over divisors of world/tp up to the
layer count; dp = world/(tp*pp); virtual stages and schedule (GPipe, 1F1B, interleaved 1F1B) when pp > 1; ep over
divisors of the experts that divide dp (MoE only); micro-batch 1..16 dividing the per-replica batch; sharding none,
shard-optimizer, shard-grad-op, full-shard, hybrid-shard (those the job's engine runs); activation checkpointing
none, selective, full. Any value the user fixed is the only value tried (expert override). Memory is checked before
the step-time model runs, so the search is cheap.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from trainforge.plan.hardware import GPU_CATALOG, GpuSpec
from trainforge.plan.layout import Layout, LayoutProblem, interleaved_micro_batches_ok, layout_problems
from trainforge.plan.memory import MemoryEstimate, estimate_memory
from trainforge.plan.model import ModelShape
from trainforge.plan.perf import StepEstimate, estimate_step
from trainforge.plan.support import engine_choice_problems
from trainforge.plan.topology import Topology

GiB = 2**30
LAYOUT_FIELDS = ("dp", "tp", "pp", "ep", "vpp", "micro_batch_size", "schedule", "sharding",
                 "activation_checkpointing")
SHARDINGS = ("none", "shard-optimizer", "shard-grad-op", "full-shard", "hybrid-shard")
SHARDING_RANK = {s: i for i, s in enumerate(SHARDINGS)}
AC_MODES = ("none", "selective", "full")
MICRO_BATCHES = (1, 2, 4, 8, 16)
MAX_VPP = 12  # Megatron-Core runs interleave up to one block per chunk (GPT-3 175B, Nemotron-4 340B: 12)


class InfeasibleLayoutError(ValueError):
    """No layout satisfies the request (or the fixed layout does not fit); the message says by how much and what
    to change."""


@dataclass(frozen=True, slots=True)
class PlanRequest:
    model: ModelShape
    gpu: GpuSpec
    topology: Topology
    world_size: int
    global_batch_size: int
    seq_len: int
    precision: str = "bf16"
    fixed: Mapping[str, Any] = field(default_factory=dict)
    """Layout fields the user fixed (names of `Layout` fields); only these values are tried."""
    uneven_stages: bool = False
    """Allow pipeline stages with different block counts (as Llama 3 405B and BLOOM did)."""
    capacity_bytes: int | None = None
    """Per-GPU memory budget; None = the GPU's memory."""
    flash_attention: bool = True
    """Fused (flash) attention: the s x s scores are neither stored nor streamed through memory. False for runs
    that predate it (Megatron-LM 2021, BLOOM, MT-NLG)."""
    tp_comm_overlap: bool = False
    """TP collectives pipelined with their GEMMs (Megatron's --tp-comm-overlap, torchtitan's async TP). trainforge's
    native engine does not do it, so only published runs that did set it."""
    engine: str | None = "native"
    """The engine that will run the layout (`parallelism.engine`): only layouts it runs are returned. None: any
    engine (the published runs' own engines: Megatron's distributed optimizer is shard-optimizer)."""
    kernels: str | None = None
    """`fused` or `eager` non-matmul kernels (perf.memory_bound_bytes_per_token); None: the engine's (trainforge's
    engines run its block eagerly, one kernel per op)."""

    @property
    def capacity(self) -> int:
        return self.capacity_bytes or self.gpu.memory_bytes


@dataclass(frozen=True, slots=True)
class Plan:
    layout: Layout
    memory: MemoryEstimate
    step: StepEstimate | None
    problems: tuple[LayoutProblem, ...] = ()

    @property
    def feasible(self) -> bool:
        return not self.problems and self.memory.fits


@dataclass
class SearchResult:
    request: PlanRequest
    plans: list[Plan]
    """Feasible plans, fastest first."""
    considered: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    too_big: list[Plan] = field(default_factory=list)
    """Candidates that obeyed every rule but did not fit in memory (smallest first, a few kept)."""
    elapsed_s: float = 0.0

    @property
    def best(self) -> Plan:
        if not self.plans:
            raise InfeasibleLayoutError(no_plan_message(self))
        return self.plans[0]


def evaluate_layout(req: PlanRequest, layout: Layout, *, with_step: bool = True) -> Plan:
    """Memory, feasibility and predicted step time of one layout."""
    problems = layout_problems(layout, req.model, global_batch_size=req.global_batch_size,
                               world_size=req.world_size, gpus_per_node=min(req.topology.gpus_per_node,
                                                                            req.world_size),
                               uneven_stages=req.uneven_stages, engine=req.engine)
    memory = layout_memory(req, layout)
    step = None
    if with_step and not problems:
        step = estimate_step(req.model, layout, req.gpu, req.topology, seq_len=req.seq_len,
                             global_batch_size=req.global_batch_size, precision=req.precision,
                             flash_attention=req.flash_attention, tp_comm_overlap=req.tp_comm_overlap,
                             engine=req.engine, kernels=req.kernels)
    return Plan(layout, memory, step, tuple(problems))


def layout_memory(req: PlanRequest, layout: Layout) -> MemoryEstimate:
    """The layout's memory on the request's cluster: the advisor's and `validate`'s, so the two never disagree."""
    return estimate_memory(req.model, layout, seq_len=req.seq_len, global_batch_size=req.global_batch_size,
                           precision=req.precision, capacity_bytes=req.capacity,
                           gpus_per_node=req.topology.gpus_per_node, flash_attention=req.flash_attention,
                           runtime_overhead_bytes=req.gpu.runtime_overhead_bytes, engine=req.engine)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _choices(req: PlanRequest, name: str, default: tuple[Any, ...] | list[Any]) -> tuple[Any, ...] | list[Any]:
    value = req.fixed.get(name)
    return (value,) if value is not None else default


def candidate_layouts(req: PlanRequest) -> Iterator[Layout]:
    """Every layout in the search space that satisfies the cheap structural rules (the rest are never built)."""
    m, world, node = req.model, req.world_size, min(req.topology.gpus_per_node, req.world_size)
    tps = [t for t in _divisors(node) if m.heads % t == 0 and (m.kv_heads % t == 0 or t % m.kv_heads == 0)]
    for tp in _choices(req, "tp", tps):
        if world % tp:
            continue
        pps = [p for p in _divisors(world // tp) if p <= m.layers and (req.uneven_stages or m.layers % p == 0)]
        for pp in _choices(req, "pp", pps):
            if world % (tp * pp):
                continue
            dp = world // (tp * pp)
            if req.fixed.get("dp") not in (None, dp):
                continue
            yield from _inner(req, dp, tp, pp)


def _inner(req: PlanRequest, dp: int, tp: int, pp: int) -> Iterator[Layout]:
    m = req.model
    if req.global_batch_size % dp:
        return
    per_replica = req.global_batch_size // dp
    eps = [e for e in _divisors(m.experts) if dp % e == 0] if m.experts else [1]
    pipes: list[tuple[int, str]] = [(1, "1f1b")]
    if pp > 1:
        pipes = [(1, "gpipe"), (1, "1f1b")]
        pipes += [(v, "interleaved-1f1b") for v in range(2, MAX_VPP + 1)
                  if pp * v <= m.layers and (req.uneven_stages or m.layers % (pp * v) == 0)]
    if "vpp" in req.fixed or "schedule" in req.fixed:
        pipes = [(v, s) for v, s in pipes if req.fixed.get("vpp", v) == v and req.fixed.get("schedule", s) == s]
        if not pipes:
            pipes = [(req.fixed.get("vpp", 1), req.fixed.get("schedule", "1f1b"))]
    # Only what the engine runs (plan/support.py: shard-optimizer is DeepSpeed's, hybrid-shard FSDP2's).
    shardings = [s for s in SHARDINGS if req.engine is None or not engine_choice_problems(req.engine, sharding=s)]
    if dp == 1:
        shardings = ["none"]
    for ep in _choices(req, "ep", eps):
        for mb in _choices(req, "micro_batch_size", [b for b in MICRO_BATCHES if per_replica % b == 0]):
            micro = per_replica // mb
            if pp > 1 and micro < pp:
                continue
            for vpp, schedule in pipes:
                if vpp > 1 and not interleaved_micro_batches_ok(micro, pp, vpp):
                    continue
                for sharding in _choices(req, "sharding", shardings):
                    for ac in _choices(req, "activation_checkpointing", AC_MODES):
                        yield Layout(dp=dp, tp=tp, pp=pp, ep=ep, vpp=vpp, micro_batch_size=mb, schedule=schedule,
                                     sharding=sharding, activation_checkpointing=ac)


def search(req: PlanRequest, *, keep_too_big: int = 5) -> SearchResult:
    """Evaluate every candidate; feasible plans come back fastest first (ties: less memory)."""
    start = time.perf_counter()
    result = SearchResult(req, [])
    for layout in candidate_layouts(req):
        result.considered += 1
        plan = evaluate_layout(req, layout, with_step=False)
        if plan.problems:
            result.rejected[plan.problems[0].field] += 1
            continue
        if not plan.memory.fits:
            result.rejected["memory"] += 1
            result.too_big.append(plan)
            continue
        step = estimate_step(req.model, layout, req.gpu, req.topology, seq_len=req.seq_len,
                             global_batch_size=req.global_batch_size, precision=req.precision,
                             flash_attention=req.flash_attention, tp_comm_overlap=req.tp_comm_overlap,
                             engine=req.engine, kernels=req.kernels)
        result.plans.append(replace(plan, step=step))
    result.plans.sort(key=lambda p: (p.step.step_time_s if p.step else 0.0, p.memory.total_bytes))
    result.too_big.sort(key=lambda p: p.memory.total_bytes)
    del result.too_big[keep_too_big:]
    result.elapsed_s = time.perf_counter() - start
    return result


def best_layout(req: PlanRequest) -> Layout:
    return search(req).best.layout


def check_fixed_layout(req: PlanRequest, layout: Layout) -> Plan:
    """Evaluate a fully specified layout; raise InfeasibleLayoutError saying by how much and what to change."""
    plan = evaluate_layout(req, layout)
    if plan.problems:
        raise InfeasibleLayoutError(f"layout {layout.describe()} breaks {len(plan.problems)} rule(s): " + "; ".join(
            f"{p.field}: {p.message} ({p.fix})" for p in plan.problems))
    if not plan.memory.fits:
        raise InfeasibleLayoutError(does_not_fit_message(req, plan))
    return plan


def does_not_fit_message(req: PlanRequest, plan: Plan) -> str:
    mem = plan.memory
    over = (mem.total_bytes - mem.capacity_bytes) / GiB
    parts = ", ".join(f"{i.name} {i.bytes / GiB:.1f}" for i in mem.items if i.bytes >= 0.05 * GiB)
    fixes = fit_suggestions(req, plan.layout)
    text = (f"layout {plan.layout.describe()} needs {mem.total_bytes / GiB:.1f} GiB per GPU ({parts} GiB) but one "
            f"{req.gpu.name} has {mem.capacity_bytes / GiB:.1f} GiB: over by {over:.1f} GiB.")
    if fixes:
        text += " Changes that fit: " + "; ".join(fixes)
    else:
        text += " No single change fits: use more GPUs or a larger GPU type."
    return text


def fit_suggestions(req: PlanRequest, layout: Layout) -> list[str]:
    """Single changes to `layout` that make it fit, each with its resulting memory."""
    variants: list[tuple[str, Layout, PlanRequest]] = []
    if layout.activation_checkpointing != "full":
        variants.append(("activation_checkpointing: full", replace(layout, activation_checkpointing="full"), req))
    if layout.sharding != "full-shard" and layout.dp > 1:
        variants.append(("sharding: full-shard", replace(layout, sharding="full-shard"), req))
    if layout.micro_batch_size > 1:
        variants.append(("micro_batch_size: 1", replace(layout, micro_batch_size=1), req))
    for tp in (2, 4, 8):
        if tp > layout.tp and layout.dp % (tp // layout.tp) == 0:
            variants.append((f"tp: {tp} (dp {layout.dp * layout.tp // tp})",
                             replace(layout, tp=tp, dp=layout.dp * layout.tp // tp), req))
    for pp in (2, 4, 8, 16, 32):
        if pp > layout.pp and layout.dp % (pp // layout.pp) == 0 and pp % layout.pp == 0:
            variants.append((f"pp: {pp} (dp {layout.dp * layout.pp // pp})",
                             replace(layout, pp=pp, dp=layout.dp * layout.pp // pp), req))
    for name, gpu in GPU_CATALOG.items():
        if gpu.memory_bytes > req.gpu.memory_bytes and name != "cpu":
            variants.append((f"gpu_type: {name}", layout, replace(req, gpu=gpu, capacity_bytes=None)))
    out = []
    for text, variant, r in variants:
        plan = evaluate_layout(r, variant, with_step=False)
        if not plan.problems and plan.memory.fits:
            out.append(f"{text} -> {plan.memory.total_bytes / GiB:.1f} GiB")
    return out


def no_plan_message(result: SearchResult) -> str:
    req = result.request
    fixed = ", ".join(f"{k}={v}" for k, v in req.fixed.items()) or "nothing fixed"
    head = (f"no layout of {req.model.name} on {req.world_size} x {req.gpu.name} (global batch "
            f"{req.global_batch_size}, seq {req.seq_len}, {fixed}) is feasible; {result.considered} considered")
    if result.too_big:
        return head + ". Closest: " + does_not_fit_message(req, result.too_big[0])
    reasons = ", ".join(f"{k}: {n}" for k, n in result.rejected.most_common())
    return head + f"; rejected by rule ({reasons}). Relax the fixed degrees or change the batch / GPU count."
