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
# (label, heads, hidden, layers, tp, pp, gpus, global batch, achieved TFLOP/s per GPU)
_MEGATRON_ROWS = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    ("1008B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


def _megatron() -> list[PublishedRun]:
    runs = []
    for label, heads, hidden, layers, tp, pp, gpus, gbs, tflops in _MEGATRON_ROWS:
        m = _gpt(f"megatron-gpt-{label}", layers, hidden, heads)
        dp = gpus // (tp * pp)
        mb = 1 if pp > 1 else 4
        runs.append(PublishedRun(
            f"megatron-{label}", MEGATRON, m, "a100-80gb",
            Layout(dp=dp, tp=tp, pp=pp, micro_batch_size=mb, schedule="1f1b", sharding="none",
                   activation_checkpointing="full"),
            gbs, 2048, recompute_to_mfu(tflops, m, 2048, A100_PEAK),
            assumed=(f"micro-batch {mb}", "schedule 1f1b (Table 1 does not say which rows interleave)"),
            flash_attention=False,
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
    uneven_stages=True, flash_attention=False,
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
                     assumed=("micro-batch 1",), flash_attention=False)
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
                     uneven_stages=True)
        for gpus, dp, mfu in ((8192, 64, 0.43), (16384, 128, 0.41))
    ]


TORCHTITAN = ("PyTorch torchtitan, docs/performance.md (github.com/pytorch/torchtitan, commit 0413364): FSDP2 (1D), "
              "64 A100-80GB, local batch 1 (Llama 3, seq 8192) or 2 (Llama 2, seq 4096), bf16; MFU as torchtitan's "
              "train.py computes it: 6 x non-embedding params + 12 x layers x hidden x seq per token, A100 peak 312 TF")
# (name, model, activation checkpointing, local batch, seq, published MFU)
_TORCHTITAN_ROWS = [
    ("torchtitan-llama3-8b", ModelShape("llama-3-8b", 32, 4096, 32, 8, 14336, 128256), "selective", 1, 8192, 0.582),
    ("torchtitan-llama3-70b", ModelShape("llama-3-70b", 80, 8192, 64, 8, 28672, 128256), "full", 1, 8192, 0.517),
    ("torchtitan-llama2-13b", ModelShape("llama-2-13b", 40, 5120, 40, 40, 13824, 32000), "none", 2, 4096, 0.611),
]


def _torchtitan() -> list[PublishedRun]:
    return [
        PublishedRun(name, TORCHTITAN, m, "a100-80gb",
                     Layout(dp=64, micro_batch_size=mb, sharding="full-shard", activation_checkpointing=ac),
                     64 * mb, seq, mfu,
                     assumed=("8 GPUs per node with NVSwitch, one HDR InfiniBand NIC per GPU (the page does not "
                              "describe the A100 cluster)",
                              "torchtitan's selective *op* checkpointing modelled as selective (attention core)"))
        for name, m, ac, mb, seq, mfu in _TORCHTITAN_ROWS
    ]


PUBLISHED: list[PublishedRun] = [*_megatron(), BLOOM, *_mtnlg(), *_llama3(), *_torchtitan()]
