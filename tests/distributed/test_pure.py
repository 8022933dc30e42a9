"""Pure parts of the engine, no processes: mesh dims and rank coordinates, layer split, bubble formula, DeepSpeed
config, script-mode environments. Run: `.venv/bin/python -m pytest tests/distributed/test_pure.py -q`."""

from __future__ import annotations

import json

import pytest

from trainforge.infra.launch import script_environment
from trainforge.plan.support import UnsupportedLayout
from trainforge.trainer.parallel.deepspeed_engine import deepspeed_config
from trainforge.trainer.parallel.mesh import ParallelDims
from trainforge.trainer.parallel.pp import bubble_fraction, split_layers


@pytest.mark.parametrize("layout,world,expect", [
    ({"dp": 4}, 4, (4, 1)),
    ({"dp": 4, "sharding": "full-shard"}, 4, (1, 4)),
    ({"dp": 4, "sharding": "shard-grad-op"}, 4, (1, 4)),
    ({"dp": 4, "sharding": "hybrid-shard", "hsdp_shard_degree": 2}, 4, (2, 2)),
    ({"dp": 2, "tp": 2, "pp": 2, "sharding": "full-shard"}, 8, (1, 2)),
])
def test_dims_from_layout(layout: dict, world: int, expect: tuple[int, int]) -> None:
    dims = ParallelDims.from_layout(layout, world)
    assert (dims.dp_replicate, dims.dp_shard) == expect


def test_hybrid_shard_uses_node_size() -> None:
    dims = ParallelDims.from_layout({"dp": 8, "tp": 2, "sharding": "hybrid-shard"}, 16, local_world_size=8)
    assert (dims.dp_replicate, dims.dp_shard) == (2, 4)  # shard over the 4 dp ranks of a node


@pytest.mark.parametrize("kwargs,message", [
    ({"dp_replicate": 2, "dp_shard": 1, "ep": 1, "pp": 1, "tp": 2, "world_size": 8}, "!= world_size(8)"),
    ({"dp_replicate": 3, "dp_shard": 1, "ep": 2, "pp": 1, "tp": 1, "world_size": 3}, "ep (2) must divide dp (3)"),
    ({"dp_replicate": 1, "dp_shard": 2, "ep": 2, "pp": 1, "tp": 1, "world_size": 2}, "sharding: none"),
])
def test_dims_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ParallelDims(**kwargs)


def test_rank_order_tp_innermost_then_pp_then_dp() -> None:
    dims = ParallelDims.from_layout({"dp": 2, "tp": 2, "pp": 2}, 8)
    assert [(c["dp"], c["pp"], c["tp"]) for c in map(dims.coords, range(8))] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    ep = ParallelDims.from_layout({"dp": 4, "ep": 2}, 4)
    assert [(c["dp"], c["ep"], c["dp_mod_ep"]) for c in map(ep.coords, range(4))] == [
        (0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]


def test_split_layers_balanced() -> None:
    assert split_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert [len(r) for r in split_layers(10, 4)] == [3, 3, 2, 2]
    with pytest.raises(ValueError, match="exceed layers"):
        split_layers(2, 4)


def test_bubble_formula() -> None:
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 8, v=2) < bubble_fraction(4, 8)


def test_deepspeed_config_from_spec() -> None:
    training = {"global_batch_size": 32, "grad_clip": 1.0, "precision": "bf16"}
    cfg = deepspeed_config({"dp": 4, "micro_batch_size": 2, "sharding": "shard-grad-op"}, training, 4)
    assert cfg["zero_optimization"]["stage"] == 2
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (2, 4)
    assert cfg["bf16"] == {"enabled": True} and cfg["gradient_clipping"] == 1.0
    assert deepspeed_config({"dp": 4, "zero_stage": 1}, training, 4)["zero_optimization"]["stage"] == 1
    # each sharding is the ZeRO stage the planner models it as (plan/support.py): none replicates (stage 0)
    stages = {s: deepspeed_config({"dp": 4, "sharding": s}, training, 4)["zero_optimization"]["stage"]
              for s in ("none", "shard-optimizer", "shard-grad-op", "full-shard")}
    assert stages == {"none": 0, "shard-optimizer": 1, "shard-grad-op": 2, "full-shard": 3}
    with pytest.raises(UnsupportedLayout, match="hybrid-shard is FSDP2's"):
        deepspeed_config({"dp": 4, "sharding": "hybrid-shard"}, training, 4)
    with pytest.raises(UnsupportedLayout, match="shard-optimizer"):
        ParallelDims.from_layout({"dp": 4, "sharding": "shard-optimizer"}, 4)


def test_script_environments() -> None:
    base = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    torch_env = script_environment("pytorch", base)
    assert torch_env["RANK"] == "1" and torch_env["MASTER_ADDR"] == "10.0.0.1"
    jax = script_environment("jax", base)
    assert (jax["JAX_COORDINATOR_ADDRESS"], jax["JAX_NUM_PROCESSES"], jax["JAX_PROCESS_ID"]) == (
        "10.0.0.1:29501", "2", "1")
    assert jax["JAX_LOCAL_DEVICE_IDS"] == "1"  # one accelerator per process: this rank's own
    tf = json.loads(script_environment("tensorflow", base)["TF_CONFIG"])
    assert tf == {"cluster": {"worker": ["10.0.0.1:29502", "10.0.0.1:29503"]}, "task": {"type": "worker", "index": 1}}
    with pytest.raises(ValueError, match="unknown framework"):
        script_environment("mxnet", base)
