"""Step time, MFU and pipeline bubble of one layout.

Compute: the busiest pipeline rank's FLOPs per micro-batch (forward + backward, plus the recomputed forward under
activation checkpointing) over a sustained fraction of the GPU's dense peak. The sustained fraction falls when the
per-GPU matmuls get thin (h/t small) or short (few tokens per micro-batch): `matmul_efficiency`. Plus the
memory-bound kernels between the matmuls (norms, residual adds, the MLP activation, dropout, and -- without fused
flash attention -- softmax/mask/dropout over the a x s x s attention scores), timed by the bytes they move over HBM
bandwidth: `memory_bound_bytes_per_token` (fused kernels, as Megatron-style engines run them) or
`eager_bytes_per_token` (one kernel per op, as trainforge's native engine runs its block: about 4x the bytes).
Matmul FLOPs grow as h^2 per token and these bytes as h (and a*s), so
their share of the step is what makes small-hidden models reach a lower MFU (Dao et al. 2022, "FlashAttention",
sec. 1: softmax, masking and dropout are memory-bound and take most of the attention time of GPT-2 training;
Korthikanti et al. 2022, sec. 4, list the same elementwise tensors as the stored activations).
Pipeline: m micro-batches over p stages take (m + (p-1)/v) micro-batch slots (Narayanan et al. 2021, sec. 2.2:
bubble fraction (p-1)/(v*m) of the ideal time). Each slot also carries the exposed part of its TP / EP collectives
and PP send/recv.

Overlap: each collective is an `OverlapTerm` with its total time, the compute window it can hide behind and what
stays exposed (`trainforge plan --explain` lists them):
- DP gradient reduce (all-reduce, or reduce-scatter under shard-optimizer / shard-grad-op, and HSDP's all-reduce
  across replicas): bucketed, launched as backward produces each bucket, so it hides behind the last
  micro-batch's backward (2/3 of its compute; earlier micro-batches accumulate without communicating); what exceeds
  the window is exposed, and the last bucket always is (it is ready only when backward ends: DDP's 25 MiB buckets).
- DP weight all-gather after the optimizer step (shard-optimizer, shard-grad-op): hides behind the next step's first
  forward (1/3 of a micro-batch), except the first bucket, needed before that forward starts.
- FSDP (full-shard, hybrid-shard) all-gathers and reduce-scatters every micro-batch: each unit's all-gather is
  prefetched behind the previous unit's compute, so the traffic hides behind FSDP_OVERLAP of the micro-batches'
  compute and only the first unit's gather of each micro-batch is always exposed.
- TP (Megatron sequence parallelism): without TP communication overlap the collectives sit between the GEMMs that
  produce and consume them; TP_EXPOSED of them is on the critical path. With overlap (Megatron's
  --tp-comm-overlap, torchtitan's async TP: the collective is split into chunks pipelined with the GEMM) only
  TP_OVERLAP_EXPOSED is. trainforge's native engine does not overlap TP collectives, so the advisor plans without it
  (`PlanRequest.tp_comm_overlap`, set for published runs that used it).
- PP send/recv: on the critical path between stages (no overlap); EP all-to-all: EP_EXPOSED of it.
- The native engine's FSDP inside a pipeline reduce-scatters once the step's last backward is done (torch's pipeline
  stages): exposed whole.
MFU = model FLOPs (6N + attention, no recomputation; PaLM appendix B) per second / (GPUs x peak).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainforge.plan.comm import PIPELINE_FLUSH_REDUCE, CommItem, estimate_comm
from trainforge.plan.hardware import GpuSpec
from trainforge.plan.layout import Layout, gradient_accumulation_steps
from trainforge.plan.memory import (
    ENGINE_BLOCK_ENGINES,
    block_counted,
    engine_block_counted,
    local_params,
    shard_degrees,
    stage_layers,
    state_bytes_per_param,
)
from trainforge.plan.model import ModelShape
from trainforge.plan.topology import Topology

# Sustained fraction of dense peak for large bf16 GEMMs inside a full training step (kernels, norms, softmax,
# launch gaps included): the model's only fitted constants, one per GPU generation, each the value that minimises
# the mean absolute MFU error of that generation's published runs (tests/unit/plan/accuracy.py `fit`; its test
# fails when they drift from the fit). CPU: not fitted (no published runs).
SUSTAINED_FRACTION = {"ampere": 0.83, "hopper": 0.745, "cpu": 0.5}
# Fraction of HBM bandwidth reached by elementwise kernels (STREAM-like copies reach ~0.8-0.9 of the datasheet
# rate on A100/H100; fused norms and softmax a little less).
HBM_EFFICIENCY = 0.8
THIN_MATMUL_H = 256  # per-GPU width h/t at which efficiency is halved
SHORT_MATMUL_TOKENS = 256  # tokens per micro-batch at which efficiency is halved
TP_EXPOSED = 0.6  # share of TP collective time on the critical path (partial overlap with GEMMs)
TP_OVERLAP_EXPOSED = 0.2  # the same with TP communication overlap (chunked collectives pipelined with the GEMMs)
EP_EXPOSED = 0.8
FSDP_OVERLAP = 0.9  # share of a micro-batch's compute that can hide its FSDP all-gathers / reduce-scatters
DP_BUCKET_BYTES = 25 * 2**20  # DDP's bucket_cap_mb default: the last gradient bucket (first weight bucket) is exposed


@dataclass(frozen=True, slots=True)
class OverlapTerm:
    """One collective's time per step against the compute it can hide behind."""

    name: str
    axis: str
    total_s: float
    window_s: float
    """The compute it runs beside, where the model times that (DP); 0 where a fixed share of it is charged
    instead (TP, EP) or all of it (PP)."""
    exposed_s: float
    rule: str

    @property
    def hidden_s(self) -> float:
        return self.total_s - self.exposed_s


@dataclass(frozen=True, slots=True)
class StepEstimate:
    step_time_s: float
    compute_s: float
    """Compute of the busiest rank over all its micro-batches (no bubble, no comm)."""
    bubble_s: float
    bubble_fraction: float
    exposed_comm_s: float
    optimizer_s: float
    tokens_per_s: float
    mfu: float
    hfu: float
    """Hardware FLOPs utilisation: recomputation counted."""
    matmul_efficiency: float
    comm: tuple[CommItem, ...]
    exposed_by_axis: dict[str, float]
    overlap: tuple[OverlapTerm, ...] = ()
    """Every collective's total, hidden and exposed seconds per step, with the rule (`--explain`)."""


def matmul_efficiency(model: ModelShape, layout: Layout, seq_len: int, gpu: GpuSpec,
                      sustained_fraction: float | None = None) -> float:
    """`sustained_fraction` replaces the generation's SUSTAINED_FRACTION (the calibration fits it)."""
    width = model.hidden / layout.tp
    tokens = seq_len * layout.micro_batch_size
    base = SUSTAINED_FRACTION.get(gpu.generation, 0.5) if sustained_fraction is None else sustained_fraction
    return base * (width / (width + THIN_MATMUL_H) / (1 + THIN_MATMUL_H / 8192) *
                   tokens / (tokens + SHORT_MATMUL_TOKENS) / (1 + SHORT_MATMUL_TOKENS / 8192))


def memory_bound_bytes_per_token(model: ModelShape, layout: Layout, seq_len: int, flash_attention: bool,
                                 kernels: str = "fused") -> float:
    """HBM bytes moved per token by one block's non-matmul kernels (16-bit tensors), forward + backward + recompute,
    before the division by t (tensor/sequence parallelism splits them). Forward: two norms (read + write h each: 8h),
    two residual adds with their dropout (read 2h, write h, each: 12h), the MLP activation (GELU: read + write f = 4f;
    SwiGLU: read 2f, write f = 6f), RoPE on q and k for Llama blocks (4(h + kv*d)); without flash attention the
    softmax over the a*s scores of each token (read + write: 4as) and, for GPT blocks, dropout on the probabilities
    (read + write + 1 B mask: 5as). Backward reads the saved input and the incoming gradient and writes the input
    gradient of each: 2x forward. Full recomputation repeats the forward, selective the attention-score part.
    `kernels="eager"` (Llama blocks): one kernel per aten op, `eager_bytes_per_token`; the engine's selective
    recomputation reruns the attention module's forward."""
    if kernels == "eager" and block_counted(model):
        total, forward, attention = eager_bytes_per_token(model, layout)
        scores = 0.0 if flash_attention else 12.0 * model.heads * seq_len
        if layout.activation_checkpointing == "full":
            # The forward again, but for the block's last residual add: the recomputation stops once every saved
            # tensor is back (torch.utils.checkpoint's early stop), and nothing is saved after that add.
            return total + scores + forward - 6 * model.hidden + scores / 3
        if layout.activation_checkpointing == "selective":
            return total + scores + attention + scores / 3
        return total + scores
    h, s, a = model.hidden, seq_len, model.heads
    f = model.ffn_hidden * (max(1, model.top_k) if model.experts else 1)
    if model.mlp == "gelu":
        dense, scores = 8 * h + 12 * h + 4 * f, 9 * a * s
    else:
        dense, scores = 8 * h + 12 * h + 6 * f + 4 * (h + model.kv_heads * model.head_dim), 4 * a * s
    if flash_attention:
        scores = 0  # fused into the attention kernel, which is counted as matmul FLOPs
    forward = dense + scores
    total = 3.0 * forward
    if layout.activation_checkpointing == "full":
        total += forward
    elif layout.activation_checkpointing == "selective":
        total += scores
    return float(total)


def eager_bytes_per_token(model: ModelShape, layout: Layout) -> tuple[float, float, float]:
    """HBM bytes moved per token by one Llama block's non-matmul kernels when each aten op is its own kernel, as
    trainforge's engine runs its block (trainer/models/llama.py, no torch.compile) and torchtitan ran its published
    runs (norm_type rmsnorm, compile false): (forward + backward, forward, the attention module's forward), before
    the division by t. Each op reads its inputs and writes its output; bf16 activations, fp32 inside RMSNorm and
    RoPE. Counted on the engine's own block by tests/unit/plan/test_engine_block.py (within 0.1%), per token:
    - RMSNorm, each of two: 132h (36h forward: the fp32 upcast, square, mean, scale, downcast, weight);
    - RoPE on q and k: 100 per element (48 forward: fp32 halves, four products, sum and difference, stack,
      downcast) + 16 per head dimension, each (8 forward: the cos/sin rows);
    - SwiGLU's silu(gate) * up: 28f (10f forward);
    - the residual adds and the gradient sums where activations fork: 42h (12h forward);
    - grouped-query attention's repeat of k and v to the query heads: 12q + 4k (8q forward).
    The fused kernels of Megatron-style engines move about a quarter of this (`memory_bound_bytes_per_token`)."""
    h, d = model.hidden, model.head_dim
    q, k = model.heads * d, model.kv_heads * d
    f = model.ffn_hidden * (max(1, model.top_k) if model.experts else 1)
    gqa = model.kv_heads < model.heads
    attention_forward = 48 * (q + k) + 2 * 8 * d + (8 * q if gqa else 0)  # RoPE on q and k, the repeat
    forward = 2 * 36 * h + 12 * h + 10 * f + attention_forward
    total = 2 * 132 * h + 42 * h + 100 * (q + k) + 2 * 16 * d + 28 * f + (12 * q + 4 * k if gqa else 0)
    return float(total), float(forward), float(attention_forward)


def pipeline_slots(pp: int, vpp: int, micro_batches: int) -> float:
    """Micro-batch slots (one micro-batch's forward + backward on one rank) a step takes: m + (p-1)/v. Exact for
    the schedules the engine runs on every micro-batch count `layout_problems` allows (GPipe, 1F1B, interleaved
    1F1B; tests/unit/plan/test_pipeline_schedules.py simulates torch.distributed.pipelining's own action lists)."""
    return micro_batches + (pp - 1) / vpp


def hardware_layer_flops_per_token(model: ModelShape, layout: Layout, seq_len: int,
                                   engine: str | None = None) -> float:
    """One block's FLOPs per token, forward + backward + what recomputation repeats. Full recomputation reruns the
    forward; selective is Megatron's, the attention core again. The native engine (trainer/parallel/
    activation_checkpointing.py, non-reentrant checkpoints) stops a recomputation once every tensor saved for
    backward is back (torch.utils.checkpoint's early stop): full skips the MLP's down projection, and selective,
    which checkpoints the attention module, reruns the q/k/v projections with the core but not the output
    projection (tests/unit/plan/test_engine_block.py counts them on the engine's block). The deepspeed engine runs
    the same block with the same checkpointing."""
    flops = model.layer_flops_per_token(seq_len)
    h, core = model.hidden, 4.0 * model.hidden * seq_len
    if layout.activation_checkpointing == "full":
        rerun = model.active_layer_params
        if engine_block_counted(model, engine):
            rerun -= h * model.ffn_hidden
        flops += 2.0 * rerun + core  # the forward again
    elif layout.activation_checkpointing == "selective":
        flops += core
        if engine_block_counted(model, engine):
            flops += 2.0 * (model.attention_params - h * model.heads * model.head_dim)  # q, k, v projections
    return flops


def estimate_step(model: ModelShape, layout: Layout, gpu: GpuSpec, topo: Topology, *, seq_len: int,
                  global_batch_size: int, precision: str, flash_attention: bool = True,
                  tp_comm_overlap: bool = False, sustained_fraction: float | None = None,
                  engine: str | None = None, kernels: str | None = None) -> StepEstimate:
    """`engine`: the engine that runs the layout, for the collectives it makes (plan/comm.py `estimate_comm`).
    `kernels`: `fused` (Megatron-style fused norms and activations) or `eager` (one kernel per op); None: eager
    for trainforge's engines (native, deepspeed), which run its block eagerly, fused otherwise."""
    kernels = kernels or ("eager" if engine in ENGINE_BLOCK_ENGINES else "fused")
    m = max(1, gradient_accumulation_steps(layout, global_batch_size))
    tokens_mb = seq_len * layout.micro_batch_size
    layer_hw = hardware_layer_flops_per_token(model, layout, seq_len, engine)
    head = 6.0 * model.head_params
    layers = stage_layers(model, layout)
    stage_flops = max(layers * layer_hw, (model.layers * layer_hw + head) / layout.pp)
    if layout.pp == 1:
        stage_flops = model.layers * layer_hw + head
    eff = matmul_efficiency(model, layout, seq_len, gpu, sustained_fraction)
    rate = gpu.peak_flops(precision) * eff
    mem_layers = layers if layout.pp > 1 else model.layers
    t_mem = (mem_layers * memory_bound_bytes_per_token(model, layout, seq_len, flash_attention, kernels) * tokens_mb
             / layout.tp / (gpu.hbm_bytes_per_s * HBM_EFFICIENCY))
    t_mb = stage_flops * tokens_mb / layout.tp / rate + t_mem
    comm = estimate_comm(model, layout, topo, seq_len=seq_len, global_batch_size=global_batch_size,
                         precision=precision, engine=engine)
    terms = overlap_terms(comm, layout, t_mb, m, model, tp_comm_overlap=tp_comm_overlap)
    by_axis: dict[str, float] = {"tp": 0.0, "pp": 0.0, "ep": 0.0, "dp": 0.0}
    for term in terms:
        by_axis[term.axis] += term.exposed_s
    per_slot = (by_axis["tp"] + by_axis["ep"] + by_axis["pp"]) / m
    slots = pipeline_slots(layout.pp, layout.vpp, m)
    compute = t_mb * m
    bubble = (t_mb + per_slot) * (slots - m)
    optimizer = _optimizer_time(model, layout, gpu, precision)
    step = (t_mb + per_slot) * slots + by_axis["dp"] + optimizer
    tokens = global_batch_size * seq_len
    world = layout.world_size
    peak = gpu.peak_flops(precision) * world
    mfu = model.model_flops_per_token(seq_len) * tokens / step / peak
    hw_total = (model.layers * layer_hw + head) * tokens
    return StepEstimate(
        step_time_s=step, compute_s=compute, bubble_s=bubble,
        bubble_fraction=(slots - m) / slots, exposed_comm_s=sum(by_axis.values()),
        optimizer_s=optimizer, tokens_per_s=tokens / step, mfu=mfu, hfu=hw_total / step / peak,
        matmul_efficiency=eff, comm=tuple(comm), exposed_by_axis=by_axis, overlap=tuple(terms),
    )


def overlap_terms(comm: list[CommItem], layout: Layout, t_mb: float, m: int, model: ModelShape, *,
                  tp_comm_overlap: bool = False) -> list[OverlapTerm]:
    """Each collective of the step as total, window and exposed seconds (the module doc gives the rules). TP, PP and
    EP terms are per step (all micro-batches); the step charges them per pipeline slot."""
    out: list[OverlapTerm] = []
    fsdp = [c for c in comm if c.axis == "dp" and "fsdp" in c.kind]
    if fsdp:
        total = sum(c.time_s for c in fsdp)
        gather = sum(c.time_s for c in fsdp if "all-gather" in c.kind)
        window = FSDP_OVERLAP * t_mb * m
        first_unit = gather / (stage_layers(model, layout) + 1)  # each micro-batch's first gather: not prefetched
        out.append(OverlapTerm(
            "dp fsdp all-gather + reduce-scatter", "dp", total, window,
            min(total, max(total - window, first_unit)),
            f"prefetched behind {FSDP_OVERLAP:.0%} of the micro-batches' compute; the first unit's gather of each "
            "micro-batch exposed"))
    for c in comm:
        if c.kind == PIPELINE_FLUSH_REDUCE:
            out.append(OverlapTerm(c.kind, "dp", c.time_s, 0.0, c.time_s,
                                   "exposed: issued once the step's last backward is done (torch's pipeline stages)"))
        elif c.axis == "dp" and "fsdp" not in c.kind:
            bucket = c.time_s * min(1.0, DP_BUCKET_BYTES / max(c.bytes_per_gpu, 1.0))
            if "all-gather" in c.kind:
                window = t_mb / 3
                rule = "behind the next step's first forward (1/3 of a micro-batch); the first bucket exposed"
            else:
                window = 2 * t_mb / 3
                rule = "bucketed in the last micro-batch's backward (2/3 of it); the last bucket exposed"
            out.append(OverlapTerm(c.kind, "dp", c.time_s, window, min(c.time_s, max(c.time_s - window, bucket)),
                                   rule))
        elif c.axis == "tp":
            share = TP_OVERLAP_EXPOSED if tp_comm_overlap else TP_EXPOSED
            out.append(OverlapTerm(
                c.kind, "tp", c.time_s, 0.0, c.time_s * share,
                f"{share:.0%} on the critical path " + ("(TP communication overlap: chunks pipelined with the GEMMs)"
                                                         if tp_comm_overlap else "(no TP communication overlap)")))
        elif c.axis == "ep":
            out.append(OverlapTerm(c.kind, "ep", c.time_s, 0.0, c.time_s * EP_EXPOSED,
                                   f"{EP_EXPOSED:.0%} on the critical path (dispatch/combine between expert GEMMs)"))
        elif c.axis == "pp":
            out.append(OverlapTerm(c.kind, "pp", c.time_s, 0.0, c.time_s,
                                   "on the critical path between stages"))
    return out


def _optimizer_time(model: ModelShape, layout: Layout, gpu: GpuSpec, precision: str) -> float:
    """AdamW is memory-bound: read and write weights, gradients and optimizer state of the local shard."""
    dense, expert = local_params(model, layout)
    p_b, g_b, o_b = state_bytes_per_param(precision)
    shard = shard_degrees(layout.sharding, layout.dp)[2]
    return 2 * (dense + expert) / shard * (p_b + g_b + o_b) / gpu.hbm_bytes_per_s
