"""The FSDP2 buffer terms, the fp32 shard-grad-op master copy and the memory-bound kernel time, checked against
arithmetic done by hand for the bench model of bench/memory_vs_rss.py (8 x 768, vocab 8192, fp32, 2 ranks)."""

from __future__ import annotations

from trainforge.plan.hardware import gpu_spec
from trainforge.plan.layout import Layout
from trainforge.plan.memory import estimate_memory, local_params
from trainforge.plan.model import PRESETS, ModelShape, swiglu_ffn
from trainforge.plan.perf import estimate_step, memory_bound_bytes_per_token
from trainforge.plan.topology import default_topology

BENCH = ModelShape("bench-llama", 8, 768, 12, 12, swiglu_ffn(768), 8192)
BLOCK = 4 * 768 * 768 + 3 * 768 * 2048 + 2 * 768  # 7,079,424
ROOT = 2 * 8192 * 768 + 768  # embedding + head + final norm: 12,583,680
HEAD = 8192 * 768


def _items(sharding: str, dp: int = 2) -> dict[str, int]:
    est = estimate_memory(BENCH, Layout(dp=dp, micro_batch_size=4, sharding=sharding), seq_len=128,
                          global_batch_size=4 * dp, precision="fp32", capacity_bytes=2**34, gpus_per_node=dp,
                          flash_attention=False, runtime_overhead_bytes=0)
    return est.by_name()


def test_full_shard_holds_root_prefetch_head_grads_and_reduce_scatter_buffers() -> None:
    items = _items("full-shard")
    assert BENCH.params_per_layer == BLOCK
    gather = 8 * BLOCK  # DeepSpeed's 4 x largest layer, in fp32: weights + grads of one block
    assert items["gather buffer"] == gather
    fsdp2 = 4 * (ROOT + 2 * BLOCK) + 4 * (BLOCK + HEAD) + 4 * (BLOCK + BLOCK // 2)
    assert items["fsdp buffers"] == fsdp2 - gather == 146_294_784


def test_shard_grad_op_in_fp32_keeps_a_sharded_master_copy_only_when_sharded() -> None:
    total = BENCH.total_params
    assert _items("shard-grad-op")["optimizer"] == total * 12 // 2
    assert _items("shard-grad-op", dp=1)["optimizer"] == total * 8
    assert _items("shard-grad-op")["comm buffers"] == 4 * (BLOCK + HEAD) + 4 * (BLOCK + BLOCK // 2)


def test_memory_bound_bytes_follow_the_kernel_list() -> None:
    gpt = ModelShape("gpt", 24, 2304, 24, 24, 4 * 2304, 51200, mlp="gelu", tied_embeddings=True)
    h, f, a, s = 2304, 4 * 2304, 24, 2048
    forward = 20 * h + 4 * f + 9 * a * s
    full = Layout(dp=1, activation_checkpointing="full")
    assert memory_bound_bytes_per_token(gpt, full, s, flash_attention=False) == 4 * forward
    assert memory_bound_bytes_per_token(gpt, full, s, flash_attention=True) == 4 * (20 * h + 4 * f)
    none = Layout(dp=1)
    assert memory_bound_bytes_per_token(gpt, none, s, flash_attention=False) == 3 * forward


def test_unfused_attention_costs_more_time_for_small_models_than_for_large() -> None:
    gpu, topo = gpu_spec("a100-80gb"), default_topology("a100-80gb")
    share = {}
    for h, layers in ((2304, 24), (12288, 80)):
        m = ModelShape(f"gpt-{h}", layers, h, h // 96, h // 96, 4 * h, 51200, mlp="gelu", tied_embeddings=True)
        lay = Layout(dp=8, micro_batch_size=1)
        fused = estimate_step(m, lay, gpu, topo, seq_len=2048, global_batch_size=8, precision="bf16")
        plain = estimate_step(m, lay, gpu, topo, seq_len=2048, global_batch_size=8, precision="bf16",
                              flash_attention=False)
        assert plain.step_time_s > fused.step_time_s
        share[h] = plain.step_time_s / fused.step_time_s - 1
    assert share[2304] > 2 * share[12288]


def test_shard_optimizer_shards_only_the_optimizer_state() -> None:
    """ZeRO-1 (DeepSpeed's stage 1): fp32 weights and gradients whole, Adam m+v and the fp32 master shard 1/d,
    and one reduce bucket of the gradients; between DDP and shard-grad-op in memory."""
    total = BENCH.total_params
    items = _items("shard-optimizer")
    assert (items["parameters"], items["gradients"]) == (total * 4, total * 4)
    assert items["optimizer"] == total * 12 // 2
    assert items["comm buffers"] == total * 4  # the bench model is smaller than DeepSpeed's 5e8-element bucket
    totals = {s: sum(_items(s).values()) for s in ("none", "shard-optimizer", "shard-grad-op")}
    assert totals["none"] > totals["shard-optimizer"] > totals["shard-grad-op"]


def test_native_pipeline_stages_hold_whole_gradients_and_weights_through_the_step() -> None:
    """Under the native engine a pipeline stage with FSDP keeps whole fp32 gradients across micro-batches, and under
    full-shard whole weights (tests/distributed/test_layouts.py: one reduce-scatter per step at any micro-batch
    count). No pipeline or a published run's engine (None): none of that."""
    model = PRESETS["llama-7b"]
    dense, expert = local_params(model, Layout(dp=4, pp=2))
    params = dense + expert

    def items(sharding: str, *, pp: int = 2, gbs: int = 64, engine: str | None = "native") -> dict[str, int]:
        lay = Layout(dp=4, pp=pp, micro_batch_size=1, sharding=sharding)
        return estimate_memory(model, lay, seq_len=2048, global_batch_size=gbs, precision="bf16",
                               capacity_bytes=80 * 2**30, engine=engine).by_name()

    sgo, full = items("shard-grad-op"), items("full-shard")
    assert sgo["whole gradients"] + sgo["gradients"] == params * 4
    assert "whole weights" not in sgo  # shard-grad-op keeps its weights whole anyway
    assert full["whole gradients"] + full["gradients"] == params * 4
    assert full["whole weights"] + full["parameters"] + full["gather buffer"] == params * 2
    for other in (items("full-shard", pp=1), items("full-shard", engine=None)):
        assert "whole gradients" not in other and "whole weights" not in other
    assert sum(full.values()) > sum(items("full-shard", engine=None).values())


def test_trainforges_engines_are_priced_by_their_own_block() -> None:
    """The deepspeed engine runs trainforge's block with the same checkpointing (trainer/parallel/deepspeed_engine.py
    applies `apply_ac`), so its activations, recomputed FLOPs and eager kernels are the native engine's; the
    published runs' engines (None) keep the Megatron-style count."""
    from trainforge.plan.memory import activation_bytes_per_layer
    from trainforge.plan.perf import hardware_layer_flops_per_token

    m = PRESETS["llama-7b"]
    gpu, topo = gpu_spec("h100"), default_topology("h100")
    for ac in ("none", "selective", "full"):
        lay = Layout(dp=8, micro_batch_size=1, sharding="shard-grad-op", activation_checkpointing=ac)
        native, deepspeed, published = (activation_bytes_per_layer(m, lay, 4096, "bf16", engine=e)[0]
                                        for e in ("native", "deepspeed", None))
        assert native == deepspeed and (native > published if ac != "full" else native == published)  # block input
        assert (hardware_layer_flops_per_token(m, lay, 4096, "deepspeed")
                == hardware_layer_flops_per_token(m, lay, 4096, "native"))
        steps = {e: estimate_step(m, lay, gpu, topo, seq_len=4096, global_batch_size=64, precision="bf16", engine=e)
                 for e in ("deepspeed", None)}
        assert steps["deepspeed"].compute_s > steps[None].compute_s  # eager kernels
