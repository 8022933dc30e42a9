"""Communication per training iteration: bytes each GPU sends per mesh axis, on the link that axis lands on, and how
much of it can hide behind compute.

Ring collectives over n ranks move, per GPU, 2(n-1)/n x size (all-reduce) or (n-1)/n x size (all-gather,
reduce-scatter); all-to-all moves (n-1)/n x size (Thakur et al. 2005; NCCL's bus-bandwidth convention).
Time = bytes / (link rate x LINK_EFFICIENCY) + steps x latency.

- TP (Megatron sequence parallelism, Korthikanti et al. 2022): per block and micro-batch, 2 all-gathers + 2
  reduce-scatters of s*b*h activations in forward and the same in backward (+2 + 2 more when full recomputation
  repeats the forward). Same volume as the 4 all-reduces without SP.
- PP: each stage boundary sends s*b*h/t activations forward and gradients back per micro-batch (scatter-gather
  over the TP ranks, Narayanan et al. 2021 sec. 4.1).
- DP: `none` all-reduces gradients once per step; `shard-optimizer` (ZeRO-1, Megatron's distributed optimizer) and
  `shard-grad-op` reduce-scatter gradients and all-gather updated weights once per step, except that
  `shard-grad-op` without a pipeline reduce-scatters every micro-batch (ZeRO-2, as trainforge's FSDP2 and
  DeepSpeed run it: the gradients stay sharded). Under the native engine FSDP inside a pipeline gathers each unit
  m + 1 times a step and reduce-scatters once, after the last backward (torch's pipeline stages keep the state
  whole until then). Widths (`dp_widths`): the native engine reduces fp32 gradients and gathers bf16 weights under
  bf16; otherwise both move at the training precision. `full-shard` all-gathers weights for forward and again for backward and reduce-scatters
  gradients every micro-batch (torch FSDP reshard_after_forward=True); `hybrid-shard` does full-shard traffic within
  the node plus an all-reduce of the shard across nodes.
- EP: per MoE block and micro-batch, 2 all-to-alls forward (dispatch, combine) and 2 backward of s*b*k*h tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainforge.plan.hardware import LINK_EFFICIENCY, LinkSpec
from trainforge.plan.layout import Layout, gradient_accumulation_steps
from trainforge.plan.memory import (
    ENGINE_BLOCK_ENGINES,
    dp_widths,
    hsdp_shard_group,
    local_params,
    pipeline_keeps_whole_state,
    stage_layers,
)
from trainforge.plan.model import ModelShape
from trainforge.plan.topology import Topology

PIPELINE_FLUSH_REDUCE = "dp reduce-scatter (after the last backward)"
"""Torch's pipeline stages reduce-scatter once the step's last backward is done (`perform_reduce_grad`): nothing
is left to hide it behind."""


@dataclass(frozen=True, slots=True)
class CommItem:
    kind: str
    """`tp`, `pp`, `dp` or `ep` (the mesh axis) plus the collective, e.g. `dp reduce-scatter`."""
    axis: str
    link: str
    scope: str
    """Where the group lives: node, rack or cluster."""
    bytes_per_gpu: float
    """Bytes each GPU sends per iteration."""
    time_s: float
    """What hides behind compute is the step model's (plan/perf.py `overlap_terms`)."""
    formula: str


def ring_time(bytes_per_gpu: float, link: LinkSpec, steps: int) -> float:
    return bytes_per_gpu / (link.bytes_per_s * LINK_EFFICIENCY) + steps * link.latency_s


def _factor(n: int, all_reduce: bool = False) -> float:
    return (2.0 if all_reduce else 1.0) * (n - 1) / n


def tp_recompute_collectives(recompute: str, engine: str | None) -> int:
    """TP collectives per block that recomputation repeats, beyond the 4 forward + 4 backward (sequence parallelism:
    an all-gather before, a reduce-scatter after, the attention and the MLP). Megatron's full recomputation reruns
    the forward's 4. The native engine's (tests/unit/plan/test_engine_block.py counts them on a fake process group):
    full reruns 3, stopping before the MLP's last reduce-scatter once every saved tensor is back; selective, which
    checkpoints the attention module with its input before the all-gather, reruns that all-gather."""
    if engine in ENGINE_BLOCK_ENGINES:
        return {"full": 3, "selective": 1}.get(recompute, 0)
    return 4 if recompute == "full" else 0


def estimate_comm(model: ModelShape, layout: Layout, topo: Topology, *, seq_len: int, global_batch_size: int,
                  precision: str, engine: str | None = None) -> list[CommItem]:
    """`engine` `native`: FSDP under torch's pipeline stages gathers and reduce-scatters as they make it
    (`_dp_items`); None: as ZeRO describes it (the published runs' engines)."""
    width = 4 if precision == "fp32" else 2
    m = max(1, gradient_accumulation_steps(layout, global_batch_size))
    s, b, h = seq_len, layout.micro_batch_size, model.hidden
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    layers = stage_layers(model, layout)
    out: list[CommItem] = []
    if tp > 1:
        link, scope = topo.link_for(1, tp), topo.scope(1, tp)
        colls = 8 + tp_recompute_collectives(layout.activation_checkpointing, engine)
        size = s * b * h * width
        per = colls * _factor(tp) * size * layers * m
        out.append(CommItem("tp all-gather/reduce-scatter", "tp", link.name, scope, per,
                            ring_time(per, link, colls * layers * m * (tp - 1)),
                            f"{colls} x (t-1)/t x s*b*h*{width} B x {layers} layers x {m} micro-batches"))
    if pp > 1:
        link, scope = topo.link_for(tp, pp), topo.scope(tp, pp)
        size = s * b * h * width / tp
        per = 2 * size * m * layout.vpp
        out.append(CommItem("pp send/recv", "pp", link.name, scope, per,
                            ring_time(per, link, 2 * m * layout.vpp),
                            f"2 (act + grad) x s*b*h/t*{width} B x {m} micro-batches x {layout.vpp} chunks"))
    if layout.ep > 1 and model.experts:
        # EP groups are carved from the DP ranks nearest each other.
        ep = layout.ep
        link, scope = topo.link_for(tp * pp, ep), topo.scope(tp * pp, ep)
        size = s * b * max(1, model.top_k) * h * width / tp
        per = 4 * _factor(ep) * size * layers * m
        out.append(CommItem("ep all-to-all", "ep", link.name, scope, per, ring_time(per, link, 4 * layers * m),
                            f"4 x (e-1)/e x s*b*k*h/t*{width} B x {layers} layers x {m} micro-batches"))
    if dp > 1:
        out += _dp_items(model, layout, topo, m, precision, engine)
    return out


def _dp_items(model: ModelShape, layout: Layout, topo: Topology, m: int, precision: str,
              engine: str | None) -> list[CommItem]:
    dense, expert = local_params(model, layout)
    params = dense + expert
    gw, ww = dp_widths(precision, engine)
    dp, stride = layout.dp, layout.tp * layout.pp
    link, scope = topo.ring_link(stride, dp), topo.scope(stride, dp)
    grad, weights = params * gw, params * ww
    sharding = layout.sharding
    if sharding == "none":
        per = _factor(dp, True) * grad
        return [CommItem("dp all-reduce", "dp", link.name, scope, per, ring_time(per, link, 2 * (dp - 1)),
                         f"2(d-1)/d x {params:,} params x {gw} B, once per step")]
    if sharding in ("shard-grad-op", "shard-optimizer"):
        per, gathered = _factor(dp) * grad, _factor(dp) * weights
        gather = CommItem("dp all-gather", "dp", link.name, scope, gathered, ring_time(gathered, link, dp - 1),
                          f"(d-1)/d x {params:,} x {ww} B updated weights, once per step")
        if sharding == "shard-grad-op" and layout.pp == 1 and m > 1:
            # The engine's ZeRO-2 (trainer/parallel/parallelize.py `_sync`): gradients reduce-scattered every
            # micro-batch so they stay sharded, each behind its own micro-batch's backward as FSDP's are.
            return [CommItem("dp reduce-scatter (fsdp)", "dp", link.name, scope, per * m,
                             ring_time(per * m, link, m * (dp - 1)),
                             f"(d-1)/d x {params:,} x {gw} B gradients x {m} micro-batches"), gather]
        flush = sharding == "shard-grad-op" and engine == "native" and pipeline_keeps_whole_state(layout)
        return [CommItem(PIPELINE_FLUSH_REDUCE if flush else "dp reduce-scatter", "dp", link.name, scope, per,
                         ring_time(per, link, dp - 1), f"(d-1)/d x {params:,} x {gw} B gradients, once per step"),
                gather]
    group = hsdp_shard_group(layout, topo.gpus_per_node) if sharding == "hybrid-shard" else dp
    glink = topo.ring_link(stride, group) if sharding == "hybrid-shard" else link
    gscope = topo.scope(stride, group) if sharding == "hybrid-shard" else scope
    items = []
    if group > 1 and engine == "native" and pipeline_keeps_whole_state(layout):
        # Torch's pipeline stages: a weight gathered for a backward stays until the next forward, which then needs
        # no gather, so each unit gathers for every forward that follows a forward and for every backward that
        # follows a forward: m + 1 times a step in 1F1B, GPipe or interleaved order. One reduce-scatter per step.
        ag = (m + 1) * _factor(group) * weights
        rs = _factor(group) * grad
        items += [CommItem("dp all-gather (fsdp)", "dp", glink.name, gscope, ag,
                           ring_time(ag, glink, (m + 1) * group),
                           f"(m+1) x (d-1)/d x {params:,} x {ww} B (pipeline stage: kept after each backward)"),
                  CommItem(PIPELINE_FLUSH_REDUCE, "dp", glink.name, gscope, rs, ring_time(rs, glink, group),
                           f"(d-1)/d x {params:,} x {gw} B gradients, once per step (whole until the last backward)")]
    elif group > 1:
        ag = 2 * _factor(group) * weights * m
        rs = _factor(group) * grad * m
        items += [CommItem("dp all-gather (fsdp)", "dp", glink.name, gscope, ag, ring_time(ag, glink, 2 * m * group),
                           f"2 (fwd + bwd) x (d-1)/d x {params:,} x {ww} B x {m} micro-batches"),
                  CommItem("dp reduce-scatter (fsdp)", "dp", glink.name, gscope, rs, ring_time(rs, glink, m * group),
                           f"(d-1)/d x {params:,} x {gw} B x {m} micro-batches")]
    replicas = dp // group
    if replicas > 1:
        per = _factor(replicas, True) * grad / group
        rlink = topo.ring_link(stride * group, replicas)
        items.append(CommItem("dp all-reduce (hsdp replicas)", "dp", rlink.name, topo.scope(stride * group, replicas),
                              per, ring_time(per, rlink, 2 * replicas),
                              f"2(r-1)/r x {params:,}/{group} x {gw} B across {replicas} replicas, once per step"))
    return items
