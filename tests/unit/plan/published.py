"""Published large-model training runs: layout, hardware and achieved throughput, as reported by their authors.

Each entry names its source. `published_mfu` is model-FLOPs utilisation (no recomputation) derived from the
reported figure: papers that report hardware TFLOP/s with full activation recomputation (Megatron-LM's
96*B*s*l*h^2*(1 + s/6h + V/16lh) formula, also used by BLOOM and MT-NLG) are converted with
model/hardware = (72*l*h^2*(1 + s/6h) + 6*h*V) / (96*l*h^2*(1 + s/6h) + 6*h*V). Values a paper does not state are
marked in `assumed`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainforge.plan.layout import Layout
from trainforge.plan.model import ModelShape

A100_PEAK = 312e12
H100_PEAK = 989e12


@dataclass(frozen=True)
class PublishedRun:
    name: str
    source: str
    model: ModelShape
    gpu: str
    layout: Layout
    global_batch_size: int
    seq_len: int
    published_mfu: float
    assumed: tuple[str, ...] = field(default=())
    uneven_stages: bool = False
    flash_attention: bool = True
    """False for runs before fused (flash) attention: Megatron-LM 2021, BLOOM, MT-NLG."""
    family: str = ""
    """The source, short (one per paper or page): the accuracy table groups by it and leaves each out in turn."""
    tp_comm_overlap: bool = False
    """The run overlapped TP collectives with their GEMMs (Megatron's --tp-comm-overlap, torchtitan's async TP)."""
    eager_kernels: bool = False
    """The run's non-matmul kernels ran eagerly, one per op (torchtitan without torch.compile), not fused."""


def recompute_to_mfu(tflops_per_gpu: float, m: ModelShape, seq: int, peak: float) -> float:
    """Convert a hardware TFLOP/s figure that counts full recomputation (Megatron's formula) to MFU."""
    n_layers, h, v = m.layers, m.hidden, m.vocab
    model = 72 * n_layers * h * h * (1 + seq / (6 * h)) + 6 * h * v
    hardware = 96 * n_layers * h * h * (1 + seq / (6 * h)) + 6 * h * v
    return tflops_per_gpu * 1e12 * model / hardware / peak


def _gpt(name: str, layers: int, hidden: int, heads: int, vocab: int = 51200) -> ModelShape:
    return ModelShape(name, layers, hidden, heads, heads, 4 * hidden, vocab, mlp="gelu", tied_embeddings=True)


MEGATRON = ("Narayanan et al. 2021, 'Efficient Large-Scale Language Model Training on GPU Clusters Using "
            "Megatron-LM' (arXiv 2104.04473), Table 1 / NVIDIA Megatron-LM README; A100-80GB Selene (DGX A100, "
            "NVSwitch + 8x HDR InfiniBand per node); TFLOP/s include full activation recomputation")
# (label, heads, hidden, layers, tp, pp, gpus, global batch, micro-batch, achieved TFLOP/s per GPU). The micro-batch
# column is not in the paper's Table 1 as published in the arXiv abstract page; it is from a transcription of the
# table with its TP/PP/DP/micro-batch breakdown (its other columns agree with four independent transcriptions).
_MEGATRON_ROWS = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 16, 137),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 16, 138),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 16, 142),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 8, 135),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 4, 138),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 2, 140),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 2, 148),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 1, 155),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 1, 163),
    ("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 1, 163),
]


def _megatron() -> list[PublishedRun]:
    runs = []
    for label, heads, hidden, layers, tp, pp, gpus, gbs, mb, tflops in _MEGATRON_ROWS:
        m = _gpt(f"megatron-gpt-{label}", layers, hidden, heads)
        dp = gpus // (tp * pp)
        runs.append(PublishedRun(
            f"megatron-{label}", MEGATRON, m, "a100-80gb",
            Layout(dp=dp, tp=tp, pp=pp, micro_batch_size=mb, schedule="1f1b", sharding="none",
                   activation_checkpointing="full"),
            gbs, 2048, recompute_to_mfu(tflops, m, 2048, A100_PEAK),
            assumed=("schedule 1f1b (Table 1 does not say which rows interleave)",),
            flash_attention=False, family="megatron-2021",
        ))
    return runs


BLOOM_MODEL = _gpt("bloom-176b", 70, 14336, 112, vocab=250880)
BLOOM = PublishedRun(
    "bloom-176b",
    "BigScience 2022, 'BLOOM: A 176B-Parameter Open-Access Multilingual Language Model' (arXiv 2211.05100), "
    "sec. 3.4.2: 384 A100-80GB (48 nodes), TP 4, PP 12, DP 8 with ZeRO stage 1, 156 TFLOP/s per GPU in the "
    "fastest configuration (Megatron-DeepSpeed, full recomputation); global batch 2048, seq 2048",
    BLOOM_MODEL, "a100-80gb",
    Layout(dp=8, tp=4, pp=12, micro_batch_size=2, schedule="1f1b", sharding="shard-optimizer",
           activation_checkpointing="full"),
    2048, 2048, recompute_to_mfu(156, BLOOM_MODEL, 2048, A100_PEAK),
    assumed=("micro-batch 2 (the released training script)",),
    uneven_stages=True, flash_attention=False, family="bloom",
)

MTNLG_MODEL = _gpt("mt-nlg-530b", 105, 20480, 128, vocab=50257)
MTNLG = "Smith et al. 2022, 'Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B' (arXiv 2201.11990), " \
        "sec. 2.3 / Table 1: TP 8, PP 35, global batch 1920, seq 2048, A100-80GB DGX SuperPOD"


def _mtnlg() -> list[PublishedRun]:
    return [
        PublishedRun(f"mt-nlg-530b-{gpus}", MTNLG, MTNLG_MODEL, "a100-80gb",
                     Layout(dp=gpus // 280, tp=8, pp=35, micro_batch_size=1, schedule="1f1b",
                            sharding="shard-optimizer", activation_checkpointing="full"),
                     1920, 2048, recompute_to_mfu(tflops, MTNLG_MODEL, 2048, A100_PEAK),
                     assumed=("micro-batch 1",), flash_attention=False, family="mt-nlg")
        for gpus, tflops in ((2240, 126), (2800, 121), (3360, 113))
    ]


LLAMA3_405B = ModelShape("llama-3-405b", 126, 16384, 128, 8, 53248, 128256)
LLAMA3 = ("Llama Team 2024, 'The Llama 3 Herd of Models' (arXiv 2407.21783), Table 4: 405B on H100-80GB, "
          "TP 8, CP 1, PP 16, seq 8192, 16M tokens per batch; FSDP without resharding after forward; "
          "400 Gb/s RoCE per GPU; one layer removed from the first and last stages (sec. 3.3.2)")


def _llama3() -> list[PublishedRun]:
    return [
        PublishedRun(f"llama3-405b-{gpus}", LLAMA3, LLAMA3_405B, "h100",
                     Layout(dp=dp, tp=8, pp=16, vpp=4, micro_batch_size=1, schedule="interleaved-1f1b",
                            sharding="shard-grad-op", activation_checkpointing="selective"),
                     2048, 8192, mfu,
                     assumed=("virtual stages 4", "micro-batch 1", "selective activation checkpointing"),
                     uneven_stages=True, family="llama3")
        for gpus, dp, mfu in ((8192, 64, 0.43), (16384, 128, 0.41))
    ]


TORCHTITAN = ("PyTorch torchtitan, docs/performance.md (github.com/pytorch/torchtitan, commit 0413364): FSDP2 (1D), "
              "64 A100-80GB, local batch 1 (Llama 3, seq 8192) or 2 (Llama 2, seq 4096), bf16; MFU as torchtitan's "
              "train.py computes it: 6 x non-embedding params + 12 x layers x hidden x seq per token, A100 peak 312 TF")
# (name, model, activation checkpointing, local batch, seq, published MFU): the rows whose recomputation the planner
# models as torchtitan ran it. Llama 3 70B with full checkpointing (docs/performance.md at commit 0413364); Llama 2
# 13B with none and 70B with full (every version of the page). Llama 2's vocab is 32,000 and its 13B has no
# grouped-query attention. Left out: the rows with torchtitan's selective checkpointing. Its "layer" mode fully
# recomputes every second block and its "op" mode recomputes every second matmul, neither of which is Megatron's
# selective mode (the attention core only) that the planner has: on the page, 13B loses 12% MFU to either, and
# the planner's selective mode costs it 2%.
# Kernels: eager. torchtitan's 64-A100 presets of the time (train_configs/llama2_13b.toml, llama2_70b.toml,
# llama3_70b.toml: "NOTE: this toml config is a preset for 64 A100 GPUs") set `norm_type = "rmsnorm"` (the eager
# PyTorch RMSNorm, not the fused Triton one) and `compile = false`, so every norm, RoPE and SwiGLU op is its own
# kernel, as in trainforge's engine (perf.eager_bytes_per_token, counted on trainforge's block; torchtitan's RoPE
# multiplies complex pairs instead of real halves, a few percent fewer of those bytes).
LLAMA2_13B = ModelShape("llama-2-13b", 40, 5120, 40, 40, 13824, 32000)
LLAMA2_70B = ModelShape("llama-2-70b", 80, 8192, 64, 8, 28672, 32000)
_TORCHTITAN_ROWS = [
    ("torchtitan-llama3-70b", ModelShape("llama-3-70b", 80, 8192, 64, 8, 28672, 128256), "full", 1, 8192, 0.517),
    ("torchtitan-llama2-13b", LLAMA2_13B, "none", 2, 4096, 0.611),
    ("torchtitan-llama2-70b", LLAMA2_70B, "full", 2, 4096, 0.505),
]


def _torchtitan() -> list[PublishedRun]:
    return [
        PublishedRun(name, TORCHTITAN, m, "a100-80gb",
                     Layout(dp=64, micro_batch_size=mb, sharding="full-shard", activation_checkpointing=ac),
                     64 * mb, seq, mfu,
                     assumed=("8 GPUs per node with NVSwitch, one HDR InfiniBand NIC per GPU (the page does not "
                              "describe the A100 cluster)",),
                     family="torchtitan", eager_kernels=True)
        for name, m, ac, mb, seq, mfu in _TORCHTITAN_ROWS
    ]


KORTHIKANTI = ("Korthikanti et al. 2022, 'Reducing Activation Recomputation in Large Transformer Models' (arXiv "
               "2205.05198): Table 3 (configurations), Table 5 (iteration time, full recomputation vs selective "
               "recomputation + sequence parallelism) and the MFU of the present work (also NVIDIA Megatron-LM "
               "README); A100-80GB, seq 2048, vocab 51,200, data parallel 1")
# (label, heads, hidden, layers, tp, pp, virtual stages, gpus, global batch, micro-batch, MFU of the present work,
#  iteration time full recompute s, iteration time present work s)
_KORTHIKANTI_ROWS = [
    ("22B", 64, 6144, 48, 8, 1, 1, 8, 4, 4, 0.415, 1.42, 1.10),
    ("175B", 96, 12288, 96, 8, 8, 3, 64, 64, 1, 0.514, 18.13, 13.75),
    ("530B", 128, 20480, 105, 8, 35, 3, 280, 280, 1, 0.560, 49.05, 37.83),
    ("1T", 160, 25600, 128, 8, 64, 1, 512, 512, 1, 0.563, 94.42, 71.49),
]


def _korthikanti() -> list[PublishedRun]:
    """Each configuration twice: selective recomputation + sequence parallelism (the paper's MFU) and full
    recomputation (its MFU from the same FLOPs over Table 5's longer iteration time)."""
    runs = []
    for label, heads, hidden, layers, tp, pp, vpp, gpus, gbs, mb, mfu, t_full, t_sel in _KORTHIKANTI_ROWS:
        m = _gpt(f"gpt-{label}", layers, hidden, heads)
        for ac, value in (("selective", mfu), ("full", mfu * t_sel / t_full)):
            runs.append(PublishedRun(
                f"korthikanti-{label}-{ac}", KORTHIKANTI, m, "a100-80gb",
                Layout(dp=gpus // (tp * pp), tp=tp, pp=pp, vpp=vpp, micro_batch_size=mb,
                       schedule="interleaved-1f1b" if vpp > 1 else "1f1b", activation_checkpointing=ac),
                gbs, 2048, value, flash_attention=False, family="korthikanti-2022",
                assumed=("the full-recomputation row's MFU is derived: the present work's MFU x its iteration "
                         "time / the full-recomputation time (Table 5)",) if ac == "full" else ()))
    return runs


MEGASCALE = ("Jiang et al. 2024, 'MegaScale: Scaling Large Language Model Training to More Than 10,000 GPUs' (arXiv "
             "2402.15627, NSDI'24), Table 2: the Megatron-LM baseline (commit 285068c8) of the 175B model (96 layers, "
             "hidden 12288, 128 heads, Table 1) on NVIDIA Ampere GPUs, TP 8, PP 8 with 6 interleaved stages, ZeRO-2 "
             "data parallelism, sequence parallelism, seq 2048, vocab 64,000; batch 768 on 256-1,024 GPUs, 6,144 on "
             "3,072-12,288. MegaScale's own rows change the model (parallel blocks, sliding-window attention, LAMB) "
             "and are not used")
MEGASCALE_175B = _gpt("megascale-175b", 96, 12288, 128, vocab=64000)
_MEGASCALE_ROWS = [(256, 768, 0.530), (512, 768, 0.499), (768, 768, 0.467), (1024, 768, 0.447),
                   (3072, 6144, 0.487), (6144, 6144, 0.478), (8192, 6144, 0.433), (12288, 6144, 0.412)]


def _megascale() -> list[PublishedRun]:
    return [
        PublishedRun(f"megascale-megatron-175b-{gpus}", MEGASCALE, MEGASCALE_175B, "a100-80gb",
                     Layout(dp=gpus // 64, tp=8, pp=8, vpp=6, micro_batch_size=1, schedule="interleaved-1f1b",
                            sharding="shard-grad-op", activation_checkpointing="selective"),
                     gbs, 2048, mfu, flash_attention=False, family="megascale-2024",
                     assumed=("A100-80GB (the paper says NVIDIA Ampere; its MFU implies 312 TFLOP/s)",
                              "micro-batch 1", "selective recomputation", "no flash attention in the baseline "
                              "(MegaScale lists FlashAttention-2 among its own changes)"))
        for gpus, gbs, mfu in _MEGASCALE_ROWS
    ]


NEMO_DGXC = ("NVIDIA DGX Cloud Benchmarking recipes (github.com/NVIDIA/dgxc-benchmarking), NeMo (Megatron-Core) on DGX "
             "H100, BF16, weak-scaled (the global batch grows with the GPUs): nemo_megatron/README_175b.md, 'NeMo "
             "Megatron 24.11 BF16 (TP=4,PP=8, MBS=1, VP=12, SEQ=2048)', GBS 2 x GPUs; nemotron/README_15b.md, "
             "'Nemotron4 15b BF16 (TP=4, PP=1, MBS=4, GA=4)', seq 4096; nemotron/README_340b.md, 'Nemotron4 340b 24.11 "
             "BF16 (TP=8, PP=8, MBS=1, GA=16, VP=12)', seq 4096. MFU against 989 TFLOP/s with the recipes' model FLOPs "
             "(attention projections counted as multi-head: 24*L*h^2 + 12*L*h*s, MLP 48*L*h^2, head 6*V*h per token); "
             "the Nemotron rows are converted to trainforge's FLOPs (grouped-query attention) by the ratio of the two. "
             "Model shapes: NeMo's nemotron.py (Nemotron4Config15B: 32 layers, 6144 hidden, 24576 FFN, 48 heads, 8 "
             "query groups; 340B: 96, 18432, 73728, 96, 8), untied embeddings, squared-ReLU MLP, vocab 256,000")
GPT3_175B = _gpt("gpt3-175b", 96, 12288, 96)
NEMOTRON4_15B = ModelShape("nemotron-4-15b", 32, 6144, 48, 8, 24576, 256000, mlp="gelu")
NEMOTRON4_340B = ModelShape("nemotron-4-340b", 96, 18432, 96, 8, 73728, 256000, mlp="gelu")


def nemo_model_flops_per_token(m: ModelShape, seq: int) -> float:
    """The DGXC recipes' model FLOPs per token (multi-head attention projections, a 4h two-matrix MLP)."""
    return 24 * m.layers * m.hidden**2 + 12 * m.layers * m.hidden * seq + 48 * m.layers * m.hidden**2 + \
        6 * m.vocab * m.hidden


# (model, seq, tp, pp, virtual stages, micro-batch, [(gpus, global batch, published MFU)])
_DGXC_ROWS = [
    (GPT3_175B, 2048, 4, 8, 12, 1, [(128, 256, 0.4993), (256, 512, 0.4971), (512, 1024, 0.4894),
                                    (1024, 2048, 0.4938), (2048, 4096, 0.4932)]),
    (NEMOTRON4_15B, 4096, 4, 1, 1, 4, [(16, 64, 0.6249), (64, 256, 0.6177), (256, 1024, 0.6162),
                                       (2048, 8192, 0.6087)]),
    # Its 128- and 256-GPU rows (data parallel 2 and 4) are left out: the distributed optimizer over so few ranks
    # does not fit 80 GB without recomputation (106 and 83 GiB by the planner's memory model), and the README does
    # not say which recomputation those runs used.
    (NEMOTRON4_340B, 4096, 8, 8, 12, 1, [(512, 128, 0.5432), (1024, 256, 0.5398), (2048, 512, 0.5275)]),
]


def _dgxc() -> list[PublishedRun]:
    runs = []
    for m, seq, tp, pp, vpp, mb, rows in _DGXC_ROWS:
        ratio = m.model_flops_per_token(seq) / nemo_model_flops_per_token(m, seq)
        for gpus, gbs, mfu in rows:
            runs.append(PublishedRun(
                f"dgxc-{m.name}-{gpus}", NEMO_DGXC, m, "h100",
                Layout(dp=gpus // (tp * pp), tp=tp, pp=pp, vpp=vpp, micro_batch_size=mb,
                       schedule="interleaved-1f1b" if vpp > 1 else "1f1b", sharding="shard-optimizer"),
                gbs, seq, mfu * ratio, family="nemo-dgxc-h100", tp_comm_overlap=True,
                assumed=("the distributed optimizer, TP communication overlap and no recomputation (NeMo's recipe "
                         "defaults; the READMEs state TP, PP, VP, MBS and GBS only)",)))
    return runs


PUBLISHED: list[PublishedRun] = [*_megatron(), BLOOM, *_mtnlg(), *_llama3(), *_torchtitan(), *_korthikanti(),
                                 *_megascale(), *_dgxc()]
