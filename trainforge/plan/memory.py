"""Per-GPU memory estimate, itemised, with the arithmetic shown (`trainforge plan --explain`).

Model states. Mixed precision (bf16/fp16) with AdamW keeps, per parameter, 2 B of 16-bit weights, 2 B of 16-bit
gradients and 16 B of optimizer-side fp32 state: fp32 gradient copy, fp32 master weights, Adam momentum and variance
(4 B each). This is DeepSpeed's accounting (`estimate_zero2_model_states_mem_needs`: "2 = params_16bit, 18 =
2_grads_16bit + 4_grads_32bit + 4_params_32bit + 8_optimizer_states_32bit"), and within 2 B of ZeRO's 16 B/param
(Rajbhandari et al. 2020, sec. 3) and Megatron's 18 B. fp32 training keeps 4 + 4 + 8 B. Sharding, per ZeRO stage:
`none` (DDP, ZeRO-0) shards nothing; `shard-optimizer` (ZeRO-1, Megatron's distributed optimizer; DeepSpeed's stage
1 is how trainforge runs it) shards the optimizer state only: 16-bit weights and gradients stay whole, the fp32 side
(gradient copy, master weights, Adam m and v) is 16 B / d; `shard-grad-op` (ZeRO-2) shards gradients and optimizer
state (in fp32 the optimizer's weight shard is a copy of its own next to the whole weights: FSDP2 with
reshard_after_forward=False keeps the sharded parameter it updates besides the all-gathered one; DeepSpeed ZeRO-1/2
clones its fp32 partition into `single_partition_of_fp32_groups`; in mixed precision that copy is the fp32 master
already counted); `full-shard` (ZeRO-3 / FSDP) shards everything and gathers one unit (a block, or the embedding if
larger) at a time -- its 16-bit gradients are reduce-scattered per unit into the fp32 shard, so only the gathered
unit's weights + gradients (4 B x unit params) are extra, which is DeepSpeed's `4 * largest_layer_params`;
`hybrid-shard` shards like full-shard within a node and replicates across nodes.

FSDP2 (`fully_shard`, how trainforge runs full-shard) holds more than one gathered unit at its peak, the start of
backward (measured per phase by bench/memory_phases.py): the root unit -- everything outside the blocks: embedding,
final norm, output head -- is never resharded after forward (torch `FSDPModule.set_reshard_after_forward`: the
root's value is "specially set to False"; trainforge/trainer/parallel/fsdp.py sets it explicitly); the block being
differentiated plus the next one, all-gathered by backward prefetch (`FSDPParamGroup.pre_backward` ->
`_backward_prefetch`); the head's unsharded gradient, reduced only at the end of backward with the root; and one
block's reduce-scatter input (a copy of its unsharded gradients) and output (1/d of it) in the reduce dtype, fp32 by
default (`foreach_reduce`; trainforge's FSDPConfig.reduce_dtype="fp32"). The `fsdp buffers` item is that peak minus
the DeepSpeed-style gather buffer above, so model-state parity with DeepSpeed is kept. shard-grad-op runs the same
backward (FSDP2 with reshard_after_forward=False): its `comm buffers` are the gradient and reduce-scatter part.

Activations per block follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models", sec. 4): GPT blocks (GELU, dropout) store s*b*h*34 bytes plus 5*a*s^2*b without flash attention; with
tensor + sequence parallelism everything divides by t. Llama blocks (RMSNorm, SwiGLU, GQA, flash attention, no
dropout) store, in 16-bit: two norm inputs (4sbh), QKV input (2sbh), Q/K/V (2sbh + 4sb*kv*d), attention output
(2sbh), MLP input (2sbh), gate/up outputs and silu(gate) (6sbf) = sbh*10 + 4*sb*kv*d + 6*sbf. Selective
recomputation drops the attention-core term (and silu(gate)); full recomputation keeps only each block's input
(2sbh/t) plus one block's full activations while it is recomputed. A pipeline stage keeps several micro-batches in
flight (Narayanan et al. 2021, sec. 2.2): GPipe all m, 1F1B min(p, m), interleaved 1F1B p + (p-1)/v.
No KV cache: training processes each sequence in one forward pass with a causal mask, so keys/values are activations
freed after backward, never a cache that grows token by token (that is inference).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from trainforge.plan.layout import Layout, gradient_accumulation_steps
from trainforge.plan.model import ModelShape

GiB = 2**30
FRAGMENTATION_RESERVE = 0.08  # caching-allocator fragmentation + temporaries, measured at 5-10% on large runs
DEFAULT_RUNTIME_OVERHEAD = 1 * GiB  # CUDA context + cuBLAS workspace + NCCL buffers
RESERVE_RULE = f"{FRAGMENTATION_RESERVE:.0%} of the above (allocator fragmentation, temporaries)"
FSDP_REDUCE_BYTES = 4  # FSDP2 reduce-scatters in fp32 (trainforge FSDPConfig.reduce_dtype default)
# ZeRO-1 (DeepSpeed stage 1) reduces the whole gradients through a flat bucket of this many elements (its
# `reduce_bucket_size` default, which trainforge's generated config keeps).
DEEPSPEED_REDUCE_BUCKET = 500_000_000


@dataclass(frozen=True, slots=True)
class MemoryItem:
    name: str
    bytes: int
    rule: str | Callable[[], str]
    """The arithmetic, or a function that writes it: the advisor estimates thousands of layouts and shows a few."""

    @property
    def formula(self) -> str:
        return self.rule() if callable(self.rule) else self.rule


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    items: tuple[MemoryItem, ...]
    capacity_bytes: int
    notes: tuple[str, ...] = field(default=())

    @property
    def total_bytes(self) -> int:
        return sum(i.bytes for i in self.items)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.capacity_bytes

    @property
    def headroom_bytes(self) -> int:
        return self.capacity_bytes - self.total_bytes

    def by_name(self) -> dict[str, int]:
        return {i.name: i.bytes for i in self.items}

    def explain(self) -> str:
        lines = [f"  {i.name:<16} {i.bytes / GiB:10.2f} GiB  = {i.formula}" for i in self.items]
        lines.append(f"  {'total':<16} {self.total_bytes / GiB:10.2f} GiB  of {self.capacity_bytes / GiB:.2f} GiB "
                     f"({'fits' if self.fits else 'DOES NOT FIT'}, headroom {self.headroom_bytes / GiB:+.2f} GiB)")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def state_bytes_per_param(precision: str) -> tuple[int, int, int]:
    """(weights, gradients, optimizer state) bytes per parameter with AdamW (DeepSpeed's accounting)."""
    if precision == "fp32":
        return 4, 4, 8
    return 2, 2, 16


def fp32_master_copy_bytes(sharding: str, precision: str, group: int = 2) -> int:
    """fp32 + shard-grad-op or shard-optimizer over more than one rank: the optimizer's weight shard is a separate
    copy (4 B / d) beside the whole weights (DeepSpeed's stage 1 and 2 clone it; over one rank nothing is gathered:
    the shard is the weights)."""
    return 4 if precision == "fp32" and sharding in ("shard-grad-op", "shard-optimizer") and group > 1 else 0


def _fsdp2_units(model: ModelShape, layout: Layout) -> tuple[int, int, int]:
    """(block, root, head) parameters per GPU as FSDP2 units: one block (experts divided by ep), the root (all the
    stage's parameters outside blocks) and the output head whose gradient the root holds unsharded in backward."""
    expert = model.mlp_params * model.experts if model.experts else 0
    block = (model.params_per_layer - expert) // layout.tp + expert // max(1, layout.ep)
    root = max(0, stage_params(model, layout) - stage_layers(model, layout) * model.params_per_layer) // layout.tp
    head = model.head_params // layout.tp if layout.pp == 1 else 0  # later stages' heads: their peak is not stage 0's
    return block, root, head


def fsdp2_reduce_bytes(model: ModelShape, layout: Layout, *, group: int,
                       precision: str) -> tuple[int, Callable[[], str]]:
    """In backward FSDP2 (full-shard and shard-grad-op alike) holds one block's unsharded gradients, the head's
    (reduced with the root at the end of backward), and one block's reduce-scatter input and output in fp32."""
    _, g_b, _ = state_bytes_per_param(precision)
    block, _, head = _fsdp2_units(model, layout)
    total = g_b * (block + head) + FSDP_REDUCE_BYTES * (block + block // group)
    return total, lambda: (f"{g_b} B x (block {block:,} + head {head:,}) unsharded grads + {FSDP_REDUCE_BYTES} B x "
                           f"block x (1 + 1/{group}) reduce-scatter in/out")


def fsdp2_buffers_bytes(model: ModelShape, layout: Layout, *, group: int, precision: str, gather_bytes: int) -> tuple[
        int, Callable[[], str]]:
    """FSDP2 full-shard's gathered weights, unsharded gradients and reduce-scatter buffers at its peak (the start of
    backward), beyond the DeepSpeed-style gather buffer (one unit's weights + gradients) already counted; see the
    module doc."""
    p_b = state_bytes_per_param(precision)[0]
    block, root, _ = _fsdp2_units(model, layout)
    reduce, reduce_text = fsdp2_reduce_bytes(model, layout, group=group, precision=precision)
    extra = max(0, p_b * (root + 2 * block) + reduce - gather_bytes)
    return extra, lambda: (f"{p_b} B x (root {root:,} + 2 x block {block:,}) gathered + {reduce_text()} "
                           f"- gather buffer {gather_bytes / 2**20:,.0f} MiB")


def shard_degrees(sharding: str, group: int) -> tuple[int, int, int]:
    """Divisors of (weights, gradients, optimizer state) for a sharding strategy over `group` ranks."""
    if sharding == "shard-optimizer":
        return 1, 1, group
    if sharding == "shard-grad-op":
        return 1, group, group
    if sharding in ("full-shard", "hybrid-shard"):
        return group, group, group
    return 1, 1, 1


def hsdp_shard_group(layout: Layout, gpus_per_node: int) -> int:
    """Hybrid sharding shards within a node: the data-parallel ranks of one node."""
    return math.gcd(layout.dp, max(1, gpus_per_node // (layout.tp * layout.pp)))


def model_states_bytes(params: int, *, num_gpus: int, sharding: str, precision: str = "bf16",
                       largest_layer_params: int = 0) -> dict[str, int]:
    """Weights, gradients, optimizer state and gather buffer per GPU for `params` parameters sharded over
    `num_gpus` ranks. Equals DeepSpeed's estimators: ZeRO-2 = 2N + 18N/G, ZeRO-3 = 18N/G + 4*largest_layer."""
    p_b, g_b, o_b = state_bytes_per_param(precision)
    o_b += fp32_master_copy_bytes(sharding, precision, num_gpus)
    sp, sg, so = shard_degrees(sharding, num_gpus)
    full = sharding in ("full-shard", "hybrid-shard")
    # Under full sharding with mixed precision the 16-bit gradients exist only per gathered unit.
    grads = 0 if full and precision != "fp32" else params * g_b // sg
    gather = 0
    if full:
        # One gathered unit (weights + gradients); never more than keeping the weights whole would cost
        # (ZeRO-2's footprint), which only binds when one unit is most of the stage.
        unsharded = params * p_b + params * g_b // num_gpus - params * p_b // sp - grads
        gather = min((p_b + g_b) * largest_layer_params, max(0, unsharded))
    return {
        "parameters": params * p_b // sp,
        "gradients": grads,
        "optimizer": params * o_b // so,
        "gather buffer": gather,
    }


def stage_layers(model: ModelShape, layout: Layout) -> int:
    """Blocks on the busiest pipeline rank (all its virtual chunks together); uneven splits round up."""
    chunks = layout.pp * layout.vpp
    return math.ceil(model.layers / chunks) * layout.vpp


def first_stage_layers(model: ModelShape, layout: Layout) -> int:
    """Blocks on the first pipeline rank, which keeps the most micro-batches in flight. When the layers do not
    divide evenly the first stage takes the fewer (Llama 3 removed a layer from its first stage for this reason)."""
    if model.layers % (layout.pp * layout.vpp) == 0:
        return model.layers // layout.pp
    return max(1, model.layers // layout.pp)


def stage_params(model: ModelShape, layout: Layout) -> int:
    """Parameters held by the busiest pipeline stage before TP/EP/FSDP division (embedding or head included)."""
    if layout.pp == 1:
        return model.total_params
    return stage_layers(model, layout) * model.params_per_layer + model.embedding_params + model.hidden


def local_params(model: ModelShape, layout: Layout) -> tuple[int, int]:
    """(dense, expert) parameters on one GPU after pipeline, tensor and expert division, before sharding."""
    params = stage_params(model, layout)
    expert = stage_layers(model, layout) * model.mlp_params * model.experts if model.experts else 0
    dense = params - expert
    return dense // layout.tp, expert // max(1, layout.ep)


ENGINE_BLOCK_ENGINES = ("native", "deepspeed")
"""The engines that run trainforge's own Llama block (trainer/models/llama.py) eagerly, with its activation
checkpointing (trainer/parallel/activation_checkpointing.py): what their blocks save, recompute and move through
memory is counted on that block (tests/unit/plan/test_engine_block.py). None: published runs' engines."""


def block_counted(model: ModelShape) -> bool:
    """Whether the model's block is the one counted (tests/unit/plan/test_engine_block.py): a dense Llama block.
    MoE blocks (routing, token gather and scatter) and GPT blocks were not counted; they keep the Megatron-style
    formulas."""
    return model.mlp != "gelu" and not model.experts


def engine_block_counted(model: ModelShape, engine: str | None) -> bool:
    """Whether the model is priced by the counts of trainforge's block: a counted block on one of its engines."""
    return engine in ENGINE_BLOCK_ENGINES and block_counted(model)


def native_activation_bytes_per_layer(model: ModelShape, layout: Layout, seq_len: int,
                                      precision: str) -> tuple[float, str]:
    """What trainforge's engine saves for backward in one Llama block for one micro-batch (trainer/models/llama.py
    under the engine's TP plan and checkpointing), counted on the engine's own block by
    tests/unit/plan/test_engine_block.py. Per token, with w the activation width (2 B, 4 B in fp32):
    - each RMSNorm: its fp32 input (the upcast copy; in fp32 the input itself) and the normalised output: 4h + wh;
    - the attention's and the MLP's inputs, all-gathered to the full sequence by sequence parallelism before the
      column-parallel projections, which save them whole: wh each, not divided by t;
    - flash attention's q, k and v (k and v repeated to the query heads), its output and log-sum-exp: 4wq + 4a;
    - SwiGLU's gate and up outputs, silu(gate) and the product: 4wf.
    Selective recomputation (the attention module checkpointed) keeps the module's input before its all-gather,
    wh/t, instead of the attention's saves; full recomputation keeps each block's input, wh/t. About 1.3-1.7x the
    Megatron-style count below, which saves neither fp32 norm inputs nor whole-sequence projection inputs."""
    s, b, h, t = seq_len, layout.micro_batch_size, model.hidden, layout.tp
    q, a = model.heads * model.head_dim, model.heads
    f = model.ffn_hidden * (max(1, model.top_k) if model.experts else 1)
    w = 4 if precision == "fp32" else 2
    ac = layout.activation_checkpointing
    if ac == "full":
        return s * b * w * h / t, f"{w}*s*b*h/t (each block's input, held by its checkpoint) = {w}*{s}*{b}*{h}/{t}"
    sharded, whole = 2 * (4 * h + w * h) + 4 * w * f, w * h
    if ac == "selective":
        sharded += w * h
        text = f"s*b*(2*(4h + {w}h) + {w}h + 4*{w}f)/t + s*b*{w}h"
    else:
        sharded += 4 * w * q + 4 * a
        whole += w * h
        text = f"s*b*(2*(4h + {w}h) + 4*{w}q + 4a + 4*{w}f)/t + s*b*2*{w}h"
    return s * b * (sharded / t + whole), f"{text} with s={s} b={b} h={h} q={q} a={a} f={f} t={t} (engine's block)"


def activation_bytes_per_layer(model: ModelShape, layout: Layout, seq_len: int, precision: str,
                               flash_attention: bool = True, engine: str | None = None) -> tuple[float, str]:
    """Stored activation bytes of one block for one micro-batch, and the formula. An engine of
    `ENGINE_BLOCK_ENGINES` (Llama blocks): `native_activation_bytes_per_layer`."""
    if engine_block_counted(model, engine):
        return native_activation_bytes_per_layer(model, layout, seq_len, precision)
    s, b, h, a, t = seq_len, layout.micro_batch_size, model.hidden, model.heads, layout.tp
    ac = layout.activation_checkpointing
    width = 2 if precision == "fp32" else 1  # the formulas count 16-bit activations
    core = 0.0 if flash_attention else 5 * a * s * s * b
    k = max(1, model.top_k) if model.experts else 1
    if model.mlp == "gelu":
        terms, text = 34.0, "34"
        if k > 1:
            terms += 19.0 * (k - 1)
            text = f"(15 + 19*{k})"
    else:
        kv_frac = model.kv_heads * model.head_dim / h
        f_frac = model.ffn_hidden / h * k
        drop = 2 * f_frac if ac == "selective" else 0.0
        terms = 10 + 4 * kv_frac + 6 * f_frac - drop
        text = f"(10 + 4*{kv_frac:.3g} + {6 if ac != 'selective' else 4}*{f_frac:.3g})"
    if ac == "full":
        return 2.0 * s * b * h / t * width, f"2*s*b*h/t = 2*{s}*{b}*{h}/{t}" + (" x2 (fp32)" if width == 2 else "")
    per = (s * b * h * terms + (core if ac == "none" else 0.0)) / t * width
    formula = f"s*b*h*{text}{' + 5*a*s^2*b' if core and ac == 'none' else ''}/t with s={s} b={b} h={h} t={t}"
    return per, formula + (" x2 (fp32)" if width == 2 else "")


def _optimizer_text(sharding: str, precision: str, group: int) -> str:
    if precision != "fp32":
        return "fp32 grad+master+Adam m+v"
    return "fp32 master shard + Adam m+v" if fp32_master_copy_bytes(sharding, precision, group) else "Adam m+v"


ACCUMULATED_GRAD_BYTES = 4
"""Bytes per parameter of a gradient accumulated across micro-batches: the engine's FSDP reduce dtype (fp32,
trainer/parallel/fsdp.py FSDPConfig.reduce_dtype), which FSDP2 accumulates in."""


def dp_widths(precision: str, engine: str | None) -> tuple[int, int]:
    """Bytes per parameter of (a gradient reduced, a weight gathered) across data-parallel ranks. The native engine
    reduces gradients in fp32 (FSDP2's reduce dtype; DDP all-reduces the fp32 gradients of its fp32 weights) and
    gathers bf16 weights under bf16 training, the fp32 weights otherwise (trainer/parallel/parallelize.py
    `_fsdp_param_dtype`). None: the training precision's width for both (the published runs' engines)."""
    if engine == "native":
        return 4, 2 if precision == "bf16" else 4
    w = 4 if precision == "fp32" else 2
    return w, w


def pipeline_keeps_whole_state(layout: Layout) -> bool:
    """Whether a pipeline stage holds its whole gradients, and weights, through the step. Torch's pipeline stages
    (torch/distributed/pipelining/stage.py `backward_maybe_with_nosync`) turn FSDP2's gradient sync and its
    resharding after backward off until the last micro-batch's backward: gradients accumulate whole, in the reduce
    dtype, and a weight gathered for a backward stays until the next forward reshards it, so at the turn from
    backward to forward (and through the cool-down) every block's weights are whole. One reduce-scatter per step.
    Without a pipeline, full-shard and shard-grad-op reduce-scatter every micro-batch (plan/comm.py)."""
    return layout.pp > 1 and layout.dp > 1 and layout.ep == 1


def _pipeline_accumulation_items(model: ModelShape, layout: Layout, precision: str, micro: int,
                                 items: list[MemoryItem]) -> list[MemoryItem]:
    dense, expert = local_params(model, layout)
    params = dense + expert
    charged = {i.name: i.bytes for i in items}
    grads = max(0, params * ACCUMULATED_GRAD_BYTES - charged.get("gradients", 0))
    out = [MemoryItem("whole gradients", grads,
                      lambda: f"torch's pipeline stages keep whole gradients across the {micro} micro-batches: "
                      f"{params:,} params x {ACCUMULATED_GRAD_BYTES} B (the reduce dtype), less the "
                      f"{charged.get('gradients', 0) / 2**20:,.0f} MiB of gradients above")]
    if layout.sharding in ("full-shard", "hybrid-shard"):
        p_b = dp_widths(precision, "native")[1]  # the width the weights are gathered at
        held = charged.get("parameters", 0) + charged.get("gather buffer", 0)
        out.append(MemoryItem("whole weights", max(0, params * p_b - held),
                              lambda: f"weights gathered for a backward stay until the next forward: {params:,} "
                              f"params x {p_b} B, less the shard and the gather buffer above"))
    return out


def micro_batches_in_flight(layout: Layout, micro_batches: int) -> float:
    if layout.pp == 1:
        return 1.0
    if layout.schedule == "gpipe":
        return float(micro_batches)
    if layout.schedule == "interleaved-1f1b" and layout.vpp > 1:
        return min(float(micro_batches), layout.pp + (layout.pp - 1) / layout.vpp)
    return float(min(layout.pp, micro_batches))


# activation_bytes_per_layer reads tp, the micro-batch and the recomputation of its layout only
_activations = functools.lru_cache(maxsize=8192)(activation_bytes_per_layer)


@functools.lru_cache(maxsize=8192)
def _model_state_items(model: ModelShape, layout: Layout, precision: str,
                       gpus_per_node: int) -> tuple[MemoryItem, ...]:
    """Weights, gradients, optimizer state and the sharding's buffers per GPU (`layout`: degrees and sharding)."""
    dense, expert = local_params(model, layout)
    group = hsdp_shard_group(layout, gpus_per_node) if layout.sharding == "hybrid-shard" else layout.dp
    expert_group = max(1, group // max(1, layout.ep)) if expert else 1
    unit = model.largest_unit_params // layout.tp
    states = model_states_bytes(dense, num_gpus=group, sharding=layout.sharding, precision=precision,
                                largest_layer_params=unit)
    ex_states = model_states_bytes(expert, num_gpus=expert_group, sharding=layout.sharding, precision=precision)
    p_b, g_b, o_b = state_bytes_per_param(precision)
    sp, sg, so = shard_degrees(layout.sharding, group)

    def where() -> str:
        experts = f" + {expert:,} expert params (1/{layout.ep} of the experts)" if expert else ""
        return f"{dense:,} params/GPU{experts}"

    items = [
        MemoryItem("parameters", states["parameters"] + ex_states["parameters"], lambda: f"{where()} x {p_b} B / {sp}"),
        MemoryItem("gradients", states["gradients"] + ex_states["gradients"],
                   (lambda: f"{where()} x {g_b} B / {sg}") if states["gradients"] or not dense else
                   "16-bit gradients exist per gathered unit only (see gather buffer)"),
        MemoryItem("optimizer", states["optimizer"] + ex_states["optimizer"],
                   lambda: f"{where()} x {o_b + fp32_master_copy_bytes(layout.sharding, precision, group)} B "
                   f"({_optimizer_text(layout.sharding, precision, group)}) / {so}"),
    ]
    if states["gather buffer"]:
        items.append(MemoryItem("gather buffer", states["gather buffer"],
                                lambda: f"largest unit {unit:,} params x ({p_b}+{g_b}) B (weights + grads gathered)"))
    if layout.sharding in ("full-shard", "hybrid-shard") and group > 1:
        extra, text = fsdp2_buffers_bytes(model, layout, group=group, precision=precision,
                                          gather_bytes=states["gather buffer"])
        if extra:
            items.append(MemoryItem("fsdp buffers", extra, text))
    elif layout.sharding == "none" and layout.dp > 1:
        grads = (dense + expert) * g_b
        items.append(MemoryItem("comm buffers", grads,
                                lambda: f"DDP bucket copy of the gradients: {dense + expert:,} x {g_b} B"))
    elif layout.sharding == "shard-optimizer" and layout.dp > 1:
        bucket = min(dense + expert, DEEPSPEED_REDUCE_BUCKET)
        items.append(MemoryItem("comm buffers", bucket * g_b,
                                lambda: f"gradient reduce bucket: min({dense + expert:,}, "
                                f"{DEEPSPEED_REDUCE_BUCKET:,.0f} (DeepSpeed's reduce_bucket_size)) x {g_b} B"))
    elif layout.sharding == "shard-grad-op" and layout.dp > 1:
        reduce, text = fsdp2_reduce_bytes(model, layout, group=group, precision=precision)
        items.append(MemoryItem("comm buffers", reduce, lambda: f"FSDP2 backward: {text()}"))
    return tuple(items)


def estimate_memory(
    model: ModelShape,
    layout: Layout,
    *,
    seq_len: int,
    global_batch_size: int,
    precision: str,
    capacity_bytes: int,
    gpus_per_node: int = 8,
    flash_attention: bool = True,
    runtime_overhead_bytes: int = DEFAULT_RUNTIME_OVERHEAD,
    engine: str | None = None,
) -> MemoryEstimate:
    """Peak memory of the busiest GPU (first pipeline stage), itemised with the arithmetic. `engine`: the engine
    that runs the layout (`native`: trainforge's, whose pipeline stages keep whole state, `pipeline_keeps_whole_state`);
    None describes ZeRO's own accounting (the published runs' engines)."""
    # The model states depend on the degrees and the sharding only: the advisor asks for them once per (degrees,
    # sharding) and tries every micro-batch, schedule and recomputation on top.
    items = list(_model_state_items(model, Layout(dp=layout.dp, tp=layout.tp, pp=layout.pp, ep=layout.ep,
                                                  vpp=layout.vpp, sharding=layout.sharding),
                                    precision, gpus_per_node))
    per_layer, formula = _activations(model, Layout(dp=1, tp=layout.tp, micro_batch_size=layout.micro_batch_size,
                                                    activation_checkpointing=layout.activation_checkpointing),
                                      seq_len, precision, flash_attention, engine)
    micro = max(1, gradient_accumulation_steps(layout, global_batch_size))
    if engine == "native" and pipeline_keeps_whole_state(layout):
        items += _pipeline_accumulation_items(model, layout, precision, micro, items)
    in_flight = micro_batches_in_flight(layout, micro)
    layers = first_stage_layers(model, layout)
    items.append(MemoryItem("activations", int(per_layer * layers * in_flight),
                            lambda: f"{formula} = {per_layer / 2**20:,.1f} MiB/layer x {layers} layers x {in_flight:g} "
                            f"micro-batch(es) in flight ({layout.schedule if layout.pp > 1 else 'no pipeline'})"))
    if layout.activation_checkpointing == "full":
        full = _activations(model, Layout(dp=1, tp=layout.tp, micro_batch_size=layout.micro_batch_size),
                            seq_len, precision, flash_attention, engine)[0]
        items.append(MemoryItem("recompute", int(full), "one block's full activations while it is recomputed"))
    s, b, t = seq_len, layout.micro_batch_size, layout.tp
    logit_b = 12 if precision == "fp32" else 10
    items.append(MemoryItem("logits", s * b * model.vocab * logit_b // t,
                            lambda: f"s*b*V/t x {logit_b} B (logits, fp32 softmax, fp32 grad) = {s}*{b}*"
                            f"{model.vocab}/{t} x {logit_b}"))
    subtotal = sum(i.bytes for i in items)
    items.append(MemoryItem("reserve", int(subtotal * FRAGMENTATION_RESERVE),
                            RESERVE_RULE))
    items.append(MemoryItem("runtime", runtime_overhead_bytes, "CUDA context, cuBLAS workspace, NCCL buffers"
                            if runtime_overhead_bytes == DEFAULT_RUNTIME_OVERHEAD else "process baseline"))
    notes = ("no KV cache: training runs each sequence in one causal forward pass; keys/values are activations",)
    return MemoryEstimate(tuple(items), capacity_bytes, notes)
