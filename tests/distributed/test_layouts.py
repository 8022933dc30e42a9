"""Each parallel layout against the single-process reference (2-4 gloo ranks, tiny Llama, fp32).

Same seed, same synthetic tokens, same micro-batches: losses agree within relative 1e-5, gradient norms within
1e-4 and final weights within 5e-5 (see conftest.assert_same), and each run reports the data-parallel path it
took, so a layout that silently fell back to another fails. Run: `.venv/bin/python -m pytest tests/distributed -q`
(`-m "not slow"` for the 2-rank subset).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.conftest import TINY, assert_same, reference, run_layout
from trainforge.plan.comm import PIPELINE_FLUSH_REDUCE, estimate_comm
from trainforge.plan.layout import Layout
from trainforge.plan.model import ModelShape
from trainforge.plan.topology import default_topology

pytestmark = pytest.mark.slow  # starts torchrun, workers or servers: `make test`, not `make test-fast`

MICRO = 2
STEPS = 4
MOE = {**TINY, "experts": 4, "top_k": 2}


@pytest.fixture(scope="module")
def ref(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return reference(tmp_path_factory.mktemp("ref"), {"micro_batch_size": MICRO}, steps=STEPS, grad_clip=1.0)


def check(tmp: Path, ref: dict[str, Any], layout: dict[str, Any], kind: str,
          pipeline: bool = False) -> dict[str, Any]:
    got = run_layout(tmp, {"micro_batch_size": MICRO, **layout}, steps=STEPS, grad_clip=1.0)
    assert (got["kind"], got["pipeline"]) == (kind, pipeline), "the layout fell back to another path"
    assert_same(got, ref)
    return got


def test_ddp(tmp_path: Path, ref: dict[str, Any]) -> None:
    check(tmp_path, ref, {"dp": 2}, "ddp")


@pytest.mark.parametrize("sharding", ["shard-grad-op", "full-shard"])
def test_fsdp(tmp_path: Path, ref: dict[str, Any], sharding: str) -> None:
    """Also the collectives each step makes, as the planner charges them (plan/comm.py): shard-grad-op (ZeRO-2)
    gathers the weights once per step and reduce-scatters every micro-batch; full-shard gathers for forward and
    again for backward (the root, never resharded after forward, once) and reduce-scatters every micro-batch."""
    got = check(tmp_path, ref, {"dp": 2, "sharding": sharding}, "fsdp")
    m = 8 // 2 // MICRO  # micro-batches per rank and step (run_layout's global batch 8)
    units = got["fsdp_units"]  # the blocks and the root
    gathers = units if sharding == "shard-grad-op" else 2 * m * (units - 1) + m
    counts = [(c["all_gather"], c["reduce_scatter"]) for c in got["fsdp_calls"]]
    assert counts == [(gathers, m * units)] * STEPS
    layout = Layout(dp=2, micro_batch_size=MICRO, sharding=sharding)
    items = {c.kind: c for c in estimate_comm(_tiny_shape(), layout, default_topology("a100-80gb"), seq_len=16,
                                              global_batch_size=8, precision="fp32", engine="native")}
    if sharding == "shard-grad-op":
        assert items["dp reduce-scatter (fsdp)"].bytes_per_gpu == m * items["dp all-gather"].bytes_per_gpu
    else:
        assert items["dp all-gather (fsdp)"].bytes_per_gpu == 2 * items["dp reduce-scatter (fsdp)"].bytes_per_gpu


def _tiny_shape() -> ModelShape:
    return ModelShape("tiny", TINY["layers"], TINY["hidden"], TINY["heads"], TINY["kv_heads"], TINY["ffn_hidden"],
                      TINY["vocab"])


@pytest.mark.parametrize("sharding", ["shard-grad-op", "full-shard"])
def test_fsdp_bf16_gathers_bf16_weights_and_reduces_fp32_gradients(tmp_path: Path, sharding: str) -> None:
    """bf16 training under FSDP2 gathers the weights in bf16 and reduce-scatters fp32 gradients: the bytes the
    planner charges the native engine (plan/comm.py: 2 B per weight gathered, 4 B per gradient reduced)."""
    got = run_layout(tmp_path, {"micro_batch_size": MICRO, "dp": 2, "sharding": sharding, "precision": "bf16"},
                     steps=STEPS, grad_clip=1.0, weights=False)
    assert got["kind"] == "fsdp"
    for call in got["fsdp_calls"]:
        assert (call["all_gather_dtypes"], call["reduce_scatter_dtypes"]) == (["torch.bfloat16"], ["torch.float32"])
    assert all(math.isfinite(x) for x in got["losses"]) and got["losses"][-1] < got["losses"][0]
    layout = Layout(dp=2, micro_batch_size=MICRO, sharding=sharding)
    items = {c.kind: c for c in estimate_comm(_tiny_shape(), layout, default_topology("a100-80gb"), seq_len=16,
                                              global_batch_size=8, precision="bf16", engine="native")}
    gather = next(c for k, c in items.items() if "all-gather" in k)
    reduce = next(c for k, c in items.items() if "reduce-scatter" in k)
    per_micro_batch_gathers = 1 if sharding == "shard-grad-op" else 2 * (8 // 2 // MICRO)
    assert reduce.bytes_per_gpu / (8 // 2 // MICRO) == 2 * gather.bytes_per_gpu / per_micro_batch_gathers


def test_bf16_pipeline_with_fsdp_runs_in_mixed_precision(tmp_path: Path) -> None:
    """A bf16 pipeline (pp 2 x dp 2, full-shard) runs its stages under the same autocast as without a pipeline,
    gathers bf16 weights and reduces fp32 gradients, and trains."""
    got = run_layout(tmp_path, {"micro_batch_size": MICRO // 2, "dp": 2, "pp": 2, "schedule": "1f1b",
                                "sharding": "full-shard", "precision": "bf16"}, steps=STEPS, grad_clip=1.0,
                     weights=False)
    assert (got["kind"], got["pipeline"]) == ("fsdp", True)
    for call in got["fsdp_calls"]:
        assert (call["all_gather_dtypes"], call["reduce_scatter_dtypes"]) == (["torch.bfloat16"], ["torch.float32"])
    assert all(math.isfinite(x) for x in got["losses"]) and got["losses"][-1] < got["losses"][0]


@pytest.mark.parametrize("layout", [{"dp": 1, "tp": 2}, {"dp": 2, "tp": 2}, {"dp": 1, "tp": 2, "pp": 2}],
                         ids=["tp2", "tp2-dp2", "tp2-pp2"])
def test_bf16_tensor_parallelism_moves_bf16(tmp_path: Path, layout: dict[str, Any]) -> None:
    """bf16 training with TP moves bf16 through its TP collectives, as the planner charges (plan/comm.py, 2 B per
    element), with or without data parallelism: without it the engine still runs FSDP2 (on a one-rank mesh) for
    its mixed precision, since autocast alone leaves the weights and the residual stream fp32 (3/4 of the TP bytes
    were fp32)."""
    got = run_layout(tmp_path, {"micro_batch_size": MICRO, **layout, "precision": "bf16"}, steps=2, grad_clip=1.0,
                     weights=False, count_tp=True)
    assert (got["kind"], got["pipeline"]) == ("fsdp", "pp" in layout)
    moved = got["tp_bytes"]
    activations = {k: v for k, v in moved.items() if not k.startswith("all_reduce")}
    assert {k.split()[0] for k in activations} == {"all_gather_into_tensor", "reduce_scatter_tensor"}, moved
    assert {k.split()[1] for k in activations} == {"bfloat16"}, moved
    # The all-reduces are loss-parallel's per-token statistics and the gradient norm: fp32, and small.
    assert sum(moved.values()) - sum(activations.values()) < 0.02 * sum(activations.values()), moved
    assert all(math.isfinite(x) for x in got["losses"]) and got["losses"][-1] < got["losses"][0]


def test_fsdp_full_activation_checkpointing(tmp_path: Path, ref: dict[str, Any]) -> None:
    check(tmp_path, ref, {"dp": 2, "sharding": "full-shard", "activation_checkpointing": "full"}, "fsdp")


def test_tp_sequence_parallel_loss_parallel(tmp_path: Path, ref: dict[str, Any]) -> None:
    check(tmp_path, ref, {"dp": 1, "tp": 2}, "none")


@pytest.mark.slow
def test_tp_without_sequence_parallel(tmp_path: Path, ref: dict[str, Any]) -> None:
    check(tmp_path, ref, {"dp": 1, "tp": 2, "sequence_parallel": False, "loss_parallel": False}, "none")


@pytest.mark.parametrize("schedule,vpp", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)])
def test_pp(tmp_path: Path, ref: dict[str, Any], schedule: str, vpp: int) -> None:
    check(tmp_path, ref, {"dp": 1, "pp": 2, "vpp": vpp, "schedule": schedule}, "none", pipeline=True)


def test_pp_fsdp_gathers_m_plus_one_times_and_reduce_scatters_once_per_step(tmp_path: Path,
                                                                              ref: dict[str, Any]) -> None:
    """Torch's pipeline stages keep FSDP2's gradients whole until the step's last backward: one reduce-scatter per
    unit and step at 2 and at 4 micro-batches; and a weight gathered for a backward stays until the next forward:
    m + 1 gathers per block. The planner charges those whole gradients and weights and these collectives for the
    native engine (plan/memory.py pipeline_keeps_whole_state, plan/comm.py)."""
    layout = {"dp": 2, "pp": 2, "schedule": "1f1b", "sharding": "full-shard"}
    two = check(tmp_path / "m2", ref, layout, "fsdp", pipeline=True)
    four = run_layout(tmp_path / "m4", {**layout, "micro_batch_size": MICRO // 2}, steps=STEPS, weights=False)
    steady = slice(1, None)  # the first step also gathers for lazy initialisation
    per_step = {c["reduce_scatter"] for c in two["fsdp_calls"][steady] + four["fsdp_calls"][steady]}
    assert len(per_step) == 1, (two["fsdp_calls"], four["fsdp_calls"])
    assert per_step.pop() == TINY["layers"] // 2 + 1  # stage 0's two blocks and its root, once each
    # Each block gathers m + 1 times a step (plan/comm.py): 2 more gathers per block from 2 to 4 micro-batches.
    blocks = TINY["layers"] // 2
    gathers = {c["all_gather"] for c in four["fsdp_calls"][steady]}, {c["all_gather"] for c in two["fsdp_calls"][steady]}
    assert len(gathers[0]) == len(gathers[1]) == 1
    assert gathers[0].pop() - gathers[1].pop() == 2 * blocks
    layout_m2 = Layout(dp=2, pp=2, micro_batch_size=MICRO, sharding="full-shard")
    items = {c.kind: c for c in estimate_comm(_tiny_shape(), layout_m2, default_topology("a100-80gb"), seq_len=16,
                                              global_batch_size=8, precision="fp32", engine="native")}
    assert items["dp all-gather (fsdp)"].bytes_per_gpu == 3 * items[PIPELINE_FLUSH_REDUCE].bytes_per_gpu  # m + 1


def test_interleaved_pp_with_fewer_micro_batches_than_a_second_round(tmp_path: Path) -> None:
    """4 micro-batches on 3 ranks of 2 virtual stages: not a multiple of pp, but at most pp + (pp-1)/v, which the
    planner admits (plan/layout.py interleaved_micro_batches_ok) because torch runs it in one round as priced."""
    six = {**TINY, "layers": 6}
    ref6 = reference(tmp_path / "ref", {"micro_batch_size": MICRO}, steps=STEPS, grad_clip=1.0, model=six)
    got = run_layout(tmp_path, {"micro_batch_size": MICRO, "dp": 1, "pp": 3, "vpp": 2,
                                "schedule": "interleaved-1f1b"}, steps=STEPS, grad_clip=1.0, model=six)
    assert (got["kind"], got["pipeline"]) == ("none", True), "the layout fell back to another path"
    assert_same(got, ref6)


@pytest.mark.slow
def test_hsdp(tmp_path: Path, ref: dict[str, Any]) -> None:
    """Also: with 2 micro-batches, HSDP reduce-scatters inside each shard group every micro-batch and all-reduces
    across the replicas once per step, as plan/comm.py charges it."""
    layout = {"dp": 4, "sharding": "hybrid-shard", "hsdp_shard_degree": 2}
    check(tmp_path / "ref", ref, layout, "fsdp")
    got = run_layout(tmp_path / "m2", {**layout, "micro_batch_size": 1}, steps=STEPS, weights=False)
    units = got["fsdp_units"]
    assert [(c["reduce_scatter"], c.get("all_reduce", 0)) for c in got["fsdp_calls"]] == [(2 * units, units)] * STEPS


@pytest.mark.slow
def test_tp_fsdp_2d(tmp_path: Path, ref: dict[str, Any]) -> None:
    check(tmp_path, ref, {"dp": 2, "tp": 2, "sharding": "full-shard"}, "fsdp")


@pytest.mark.slow
def test_pp_dp(tmp_path: Path, ref: dict[str, Any]) -> None:
    check(tmp_path, ref, {"dp": 2, "pp": 2, "schedule": "1f1b"}, "fsdp", pipeline=True)


@pytest.mark.slow
def test_pp_tp(tmp_path: Path, ref: dict[str, Any]) -> None:
    check(tmp_path, ref, {"dp": 1, "pp": 2, "tp": 2, "schedule": "1f1b"}, "none", pipeline=True)


@pytest.mark.slow
def test_pp_tp_dp_3d(tmp_path: Path, ref: dict[str, Any]) -> None:
    """3-D: 8 gloo ranks, pp 2 x tp 2 x dp 2 (FSDP over dp, 1F1B). About 50 s on 2 shared cores: 8 tiny processes
    fit."""
    check(tmp_path, ref, {"dp": 2, "pp": 2, "tp": 2, "schedule": "1f1b"}, "fsdp", pipeline=True)


def test_ep_dispatch_equals_dense_routing(tmp_path: Path) -> None:
    """EP + DP (experts split over 2 ranks, tokens exchanged by all-to-all) vs every expert local in one process."""
    kw: dict[str, Any] = {"steps": STEPS, "model": MOE, "grad_clip": 1.0}
    dense = reference(tmp_path, {"micro_batch_size": MICRO}, **kw)
    got = run_layout(tmp_path, {"dp": 2, "ep": 2, "micro_batch_size": MICRO}, **kw)
    assert got["kind"] == "ep"
    assert_same(got, dense)


@pytest.mark.slow
@pytest.mark.parametrize("sharding,stage", [("none", 0), ("shard-optimizer", 1), ("shard-grad-op", 2),
                                            ("full-shard", 3)])
@pytest.mark.usefixtures("deepspeed_builds_nothing")
def test_deepspeed_zero_trains_like_reference(tmp_path: Path, ref: dict[str, Any], sharding: str, stage: int) -> None:
    """DeepSpeed ZeRO-0/1/2/3 (none, shard-optimizer, shard-grad-op, full-shard) on 2 gloo ranks (DeepSpeed's CPU
    accelerator): losses, grad norms and final weights equal the single-process reference. ZeRO-3 really
    partitions: outside a gather a rank holds no parameter data."""
    pytest.importorskip("deepspeed")
    got = run_layout(tmp_path, {"dp": 2, "micro_batch_size": MICRO, "engine": "deepspeed", "sharding": sharding},
                     steps=STEPS, grad_clip=1.0)
    assert (got["kind"], got["zero_stage"]) == ("deepspeed", stage), "the layout fell back to another path"
    if stage == 3:
        assert got["local_numel"] == 0 < got["full_numel"]
    else:
        assert got["local_numel"] == got["full_numel"]
    assert_same(got, ref)


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["selective", "full"])
@pytest.mark.usefixtures("deepspeed_builds_nothing")
def test_deepspeed_recomputes_as_the_layout_says(tmp_path: Path, ref: dict[str, Any], recompute: str) -> None:
    """The deepspeed engine applies the layout's activation checkpointing (it ignored it, while the planner sized
    memory with it): every block (full) or every attention module (selective) is checkpointed, and training equals
    the single-process reference."""
    pytest.importorskip("deepspeed")
    got = run_layout(tmp_path, {"dp": 2, "micro_batch_size": MICRO, "engine": "deepspeed",
                                "sharding": "shard-grad-op", "activation_checkpointing": recompute},
                     steps=STEPS, grad_clip=1.0)
    assert (got["kind"], got["checkpointed"]) == ("deepspeed", TINY["layers"])
    assert_same(got, ref)


@pytest.mark.slow
def test_checkpoint_fsdp_world2_resumes_as_tp_dp_world4(tmp_path: Path, ref: dict[str, Any]) -> None:
    """DCP resharding: FSDP on 2 ranks saves after step 2; TP x FSDP (2 x 2) on 4 ranks loads and finishes."""
    store = {"store": (tmp_path / "store").as_uri(), "store_staging": str(tmp_path / "staging")}
    first = run_layout(tmp_path, {"dp": 2, "sharding": "full-shard", "micro_batch_size": MICRO}, steps=2,
                       grad_clip=1.0, save_at=2, **store)
    resumed = run_layout(tmp_path, {"dp": 2, "tp": 2, "sharding": "full-shard", "micro_batch_size": MICRO},
                         steps=STEPS, grad_clip=1.0, load=True, **store)
    assert_same({**resumed, "losses": first["losses"] + resumed["losses"],
                 "norms": first["norms"] + resumed["norms"]}, ref)


@pytest.mark.slow
def test_checkpoint_fsdp_world4_resumes_as_ddp_world2(tmp_path: Path, ref: dict[str, Any]) -> None:
    """DCP resharding the other way: FSDP full-shard on 4 ranks saves after step 2 (sharded DTensor params and
    AdamW state); plain DDP on 2 ranks (full local tensors) loads and finishes. Same tolerances as every layout."""
    store = {"store": (tmp_path / "store").as_uri(), "store_staging": str(tmp_path / "staging")}
    first = run_layout(tmp_path, {"dp": 4, "sharding": "full-shard", "micro_batch_size": MICRO}, steps=2,
                       grad_clip=1.0, save_at=2, **store)
    assert first["kind"] == "fsdp"
    resumed = run_layout(tmp_path, {"dp": 2, "micro_batch_size": MICRO}, steps=STEPS, grad_clip=1.0, load=True,
                         **store)
    assert resumed["kind"] == "ddp", "the resumed layout fell back to another path"
    assert len(resumed["losses"]) == STEPS - 2, "the resumed run did not start at the checkpoint's step"
    assert_same({**resumed, "losses": first["losses"] + resumed["losses"],
                 "norms": first["norms"] + resumed["norms"]}, ref)


def test_checkpoint_bf16_tp_alone_resumes_as_fsdp(tmp_path: Path) -> None:
    """A bf16 TP run without data parallelism (FSDP2 on a one-rank mesh, for its mixed precision) saves after step
    2; full-shard FSDP on 2 ranks loads it and continues where an uninterrupted run goes (bf16: layouts round
    differently, so within 1%, not bit for bit)."""
    store = {"store": (tmp_path / "store").as_uri(), "store_staging": str(tmp_path / "staging")}
    tp = {"dp": 1, "tp": 2, "micro_batch_size": MICRO, "precision": "bf16"}
    whole = run_layout(tmp_path, tp, steps=STEPS, grad_clip=1.0, weights=False)
    first = run_layout(tmp_path, tp, steps=2, grad_clip=1.0, save_at=2, weights=False, **store)
    assert first["kind"] == "fsdp"
    resumed = run_layout(tmp_path, {"dp": 2, "sharding": "full-shard", "micro_batch_size": MICRO,
                                    "precision": "bf16"}, steps=STEPS, grad_clip=1.0, load=True, weights=False,
                         **store)
    assert len(resumed["losses"]) == STEPS - 2, "the resumed run did not start at the checkpoint's step"
    torch.testing.assert_close(torch.tensor(first["losses"] + resumed["losses"]), torch.tensor(whole["losses"]),
                               rtol=1e-2, atol=0.0)
