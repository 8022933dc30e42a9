"""Property tests of the planner (hypothesis): every advised plan obeys the rules; memory is monotonic in batch and
sequence length; more sharding never raises per-GPU memory. Run: pytest tests/unit/plan/test_properties.py -q
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainforge.plan.advisor import PlanRequest, search
from trainforge.plan.hardware import gpu_spec
from trainforge.plan.layout import Layout, layout_problems
from trainforge.plan.memory import estimate_memory, pipeline_keeps_whole_state
from trainforge.plan.model import PRESETS
from trainforge.plan.topology import default_topology

MODELS = ["llama-1b", "llama-7b", "llama-8b", "llama-13b", "llama-70b"]
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(model=st.sampled_from(MODELS), nodes=st.sampled_from([1, 2, 4, 8, 16]), gpus_per_node=st.sampled_from([4, 8]),
       gbs_per_gpu=st.sampled_from([1, 2, 4]), gpu=st.sampled_from(["a100-80gb", "h100", "h200"]))
def test_every_advised_plan_obeys_the_rules(model, nodes, gpus_per_node, gbs_per_gpu, gpu):
    world = nodes * gpus_per_node
    req = PlanRequest(PRESETS[model], gpu_spec(gpu), default_topology(gpu, gpus_per_node), world,
                      world * gbs_per_gpu, 2048)
    result = search(req)
    for plan in result.plans[:20]:
        lay = plan.layout
        assert lay.dp * lay.tp * lay.pp == world
        assert lay.tp <= gpus_per_node and gpus_per_node % lay.tp == 0
        assert PRESETS[model].heads % lay.tp == 0 and PRESETS[model].layers % (lay.pp * lay.vpp) == 0
        assert req.global_batch_size % (lay.dp * lay.micro_batch_size) == 0
        assert plan.memory.fits and not layout_problems(lay, PRESETS[model], global_batch_size=req.global_batch_size,
                                                        world_size=world, gpus_per_node=gpus_per_node)
    if result.plans:
        times = [p.step.step_time_s for p in result.plans]
        assert times == sorted(times)


layouts = st.builds(
    Layout, dp=st.sampled_from([1, 2, 8, 64]), tp=st.sampled_from([1, 2, 8]), pp=st.sampled_from([1, 2, 4]),
    micro_batch_size=st.sampled_from([1, 2, 4]), schedule=st.sampled_from(["gpipe", "1f1b"]),
    sharding=st.sampled_from(["none", "shard-grad-op", "full-shard"]),
    activation_checkpointing=st.sampled_from(["none", "selective", "full"]),
)


def _mem(model, layout, seq=2048, gbs=512, precision="bf16", engine=None):
    return estimate_memory(PRESETS[model], layout, seq_len=seq, global_batch_size=gbs, precision=precision,
                           capacity_bytes=80 * 2**30, engine=engine).total_bytes


@settings(max_examples=150, deadline=None)
@given(model=st.sampled_from(MODELS), layout=layouts, precision=st.sampled_from(["bf16", "fp32"]))
def test_memory_monotonic_in_batch_and_sequence(model, layout, precision):
    assert _mem(model, layout, seq=1024, precision=precision) <= _mem(model, layout, seq=2048, precision=precision)
    bigger = replace(layout, micro_batch_size=layout.micro_batch_size * 2)
    assert _mem(model, layout, precision=precision) <= _mem(model, bigger, gbs=1024, precision=precision)
    assert _mem(model, layout, gbs=512, precision=precision) <= _mem(model, layout, gbs=2048, precision=precision)


@settings(max_examples=150, deadline=None)
@given(model=st.sampled_from(MODELS), layout=layouts, precision=st.sampled_from(["bf16", "fp32"]),
       engine=st.sampled_from([None, "native"]))
def test_more_sharding_never_raises_memory(model, layout, precision, engine):
    order = ["none", "shard-grad-op", "full-shard"]
    mems = [_mem(model, replace(layout, sharding=s), precision=precision, engine=engine) for s in order]
    if engine == "native" and pipeline_keeps_whole_state(layout):
        # Torch's pipeline stages keep whole gradients and weights through the step under every sharding: sharding
        # saves optimizer state only (full-shard's gather buffers can cost a little more than shard-grad-op), and
        # never costs more than replication.
        assert mems[0] >= max(mems[1:]), dict(zip(order, mems, strict=True))
        return
    assert mems == sorted(mems, reverse=True), dict(zip(order, mems, strict=True))
    hybrid = replace(layout, sharding="hybrid-shard")
    assert _mem(model, hybrid, precision=precision, engine=engine) >= mems[2]


@settings(max_examples=100, deadline=None)
@given(model=st.sampled_from(MODELS), layout=layouts)
def test_more_recomputation_never_raises_activation_memory(model, layout):
    acts = [estimate_memory(PRESETS[model], replace(layout, activation_checkpointing=a), seq_len=2048,
                            global_batch_size=512, precision="bf16", capacity_bytes=1).by_name()["activations"]
            for a in ("none", "selective", "full")]
    assert acts == sorted(acts, reverse=True)
