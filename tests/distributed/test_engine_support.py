"""The advisor never returns a layout the engine refuses (issue 20, deliverable 3), checked by enumeration.

Every candidate layout of a few models (dense with and without grouped-query attention, an 8-expert MoE) at a few
world sizes, every sharding included, goes through both sides for each engine: the planner's verdict
(`layout_problems` with the engine, which the advisor uses) and the engine's own start: for the native engine its
construction of the mesh degrees (`ParallelDims.from_layout`) plus the tensor-parallel check of `apply_tp`, for
DeepSpeed's the config it is handed (`deepspeed_config`, which picks the ZeRO stage). A layout the planner accepts
must be accepted by the engine, and every layout the engine refuses must carry a planner problem — so nothing is
refused after the GPUs are granted. No processes: pure.
Run: `.venv/bin/python -m pytest tests/distributed/test_engine_support.py -q`.
"""

from __future__ import annotations

from dataclasses import asdict, replace

import pytest

from trainforge.plan.advisor import PlanRequest, candidate_layouts, search
from trainforge.plan.hardware import gpu_spec
from trainforge.plan.layout import Layout, layout_problems
from trainforge.plan.model import PRESETS
from trainforge.plan.support import UnsupportedLayout, check_supported
from trainforge.plan.topology import default_topology
from trainforge.trainer.parallel.deepspeed_engine import deepspeed_config
from trainforge.trainer.parallel.mesh import ParallelDims

MOE = replace(PRESETS["llama-7b"], name="llama-7b-moe8", experts=8)
MODELS = [PRESETS["tiny"], PRESETS["llama-8b"], MOE]


def _request(model, gpus: int, gbs: int = 64, engine: str | None = "native") -> PlanRequest:
    return PlanRequest(model, gpu_spec("h100"), default_topology("h100"), gpus, gbs, 2048, engine=engine)


def _engine_refusal(layout: Layout, model, world: int, gpus_per_node: int, engine: str = "native") -> str | None:
    """What the engine says at worker start, without process groups: the mesh degrees and the TP/KV rule (native),
    the ZeRO config (deepspeed)."""
    try:
        if engine == "deepspeed":
            deepspeed_config(asdict(layout), {"global_batch_size": 64}, world)
            return None
        dims = ParallelDims.from_layout(asdict(layout), world, local_world_size=min(world, gpus_per_node))
        check_supported(tp=dims.tp, kv_heads=model.kv_heads)
    except (ValueError, UnsupportedLayout) as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("engine", ["native", "deepspeed"])
@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
@pytest.mark.parametrize("gpus", [8, 16])
def test_planner_and_engine_agree_on_every_candidate(model, gpus: int, engine: str) -> None:
    req = _request(model, gpus, engine=None)  # every sharding, whichever engine runs it
    node = req.topology.gpus_per_node
    accepted = refused = 0
    for layout in candidate_layouts(req):
        problems = layout_problems(layout, model, global_batch_size=req.global_batch_size, world_size=gpus,
                                   gpus_per_node=node, engine=engine)
        refusal = _engine_refusal(layout, model, gpus, node, engine)
        if not problems:
            assert refusal is None, f"planner accepts {layout.describe()} but {engine} refuses it: {refusal}"
            accepted += 1
        elif refusal is not None:
            refused += 1
    assert accepted > 0
    # every model has layouts each engine refuses (ep with FSDP, shard-optimizer on native; tp/pp/hybrid-shard
    # on deepspeed): all of them were caught above
    assert refused > 0


@pytest.mark.parametrize("engine", ["native", "deepspeed"])
def test_the_advisor_plans_only_what_the_jobs_engine_runs(engine: str) -> None:
    result = search(_request(PRESETS["llama-8b"], 16, gbs=256, engine=engine))
    assert result.plans
    for plan in result.plans:
        assert _engine_refusal(plan.layout, PRESETS["llama-8b"], 16, 8, engine) is None, plan.layout.describe()
    shardings = {p.layout.sharding for p in result.plans}
    if engine == "deepspeed":
        assert {(p.layout.tp, p.layout.pp, p.layout.ep) for p in result.plans} == {(1, 1, 1)}
        assert "shard-optimizer" in shardings and "hybrid-shard" not in shardings
    else:
        assert "shard-optimizer" not in shardings


def test_moe_on_16_h100_is_planned_as_the_engine_can_run() -> None:
    """The issue's case: an 8-expert llama-7b on 16 H100 was planned as ep=8 + shard-grad-op (refused at start)."""
    result = search(_request(MOE, 16))  # the native engine
    assert result.plans
    for plan in result.plans:
        assert _engine_refusal(plan.layout, MOE, 16, 8) is None, plan.layout.describe()
    assert result.rejected["parallelism.sharding"] > 0  # ep with FSDP was considered and refused, with its reason


def test_refusal_names_the_field_and_the_fix() -> None:
    layout = Layout(dp=8, ep=8, pp=2, sharding="shard-grad-op")
    problems = {p.field: p for p in layout_problems(layout, MOE, global_batch_size=64, world_size=16,
                                                     gpus_per_node=8)}
    assert "sharding: none" in problems["parallelism.sharding"].fix
    assert "pp: 1" in problems["parallelism.pp"].fix
    tiny_tp8 = layout_problems(Layout(dp=1, tp=8), PRESETS["tiny"], global_batch_size=8, world_size=8,
                               gpus_per_node=8)
    assert [p.field for p in tiny_tp8] == ["parallelism.tp"] and "kv_heads (4)" in tiny_tp8[0].message


def test_each_engines_refusal_names_the_field_and_the_fix() -> None:
    tiny = PRESETS["tiny"]
    native = layout_problems(Layout(dp=8, sharding="shard-optimizer"), tiny, global_batch_size=64, world_size=8,
                             gpus_per_node=8, engine="native")
    assert [p.field for p in native] == ["parallelism.sharding"] and "engine: deepspeed" in native[0].fix
    deep = layout_problems(Layout(dp=8, tp=2, sharding="hybrid-shard"), tiny, global_batch_size=64, world_size=16,
                           gpus_per_node=8, engine="deepspeed")
    assert sorted(p.field for p in deep) == ["parallelism.engine", "parallelism.sharding"]
    assert layout_problems(Layout(dp=8, sharding="shard-optimizer"), tiny, global_batch_size=64, world_size=8,
                           gpus_per_node=8, engine="deepspeed") == []
