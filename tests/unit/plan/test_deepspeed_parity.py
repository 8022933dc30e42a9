"""Model-state memory (weights + gradients + optimizer + ZeRO-3 gather buffer) equals DeepSpeed's own estimators for
the same inputs. deepspeed and torch are imported here only. Run: pytest tests/unit/plan/test_deepspeed_parity.py
"""

from __future__ import annotations

import contextlib
import io
import re

import pytest

from trainforge.plan.memory import model_states_bytes

deepspeed_stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
from deepspeed.runtime.zero import stage_1_and_2  # noqa: E402

torch = pytest.importorskip("torch")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(1000, 256), torch.nn.Linear(256, 1024), torch.nn.GELU(),
                               torch.nn.Linear(1024, 256), torch.nn.Linear(256, 1000))


def _total(states: dict[str, int]) -> int:
    return sum(states.values())


@pytest.mark.parametrize("gpus_per_node,nodes", [(1, 1), (8, 1), (8, 4), (4, 16)])
def test_zero2_and_zero3_model_states_match_deepspeed(gpus_per_node: int, nodes: int) -> None:
    total = 7_000_000_000
    largest = 1_048_576_000
    g = gpus_per_node * nodes
    _, ds2 = stage_1_and_2.estimate_zero2_model_states_mem_needs(total, gpus_per_node, nodes, cpu_offload=False)
    _, ds3, _ = deepspeed_stage3.estimate_zero3_model_states_mem_needs(total, largest, gpus_per_node, nodes,
                                                                      cpu_offload=False)
    ours2 = _total(model_states_bytes(total, num_gpus=g, sharding="shard-grad-op"))
    ours3 = _total(model_states_bytes(total, num_gpus=g, sharding="full-shard", largest_layer_params=largest))
    assert ours2 == ds2
    assert ours3 == ds3


def _gpu_gib_from_all_live(fn, model, gpus_per_node: int) -> float:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        fn(model, num_gpus_per_node=gpus_per_node, num_nodes=1)
    for line in out.getvalue().splitlines():
        if "offload_optimizer=none" in line and ("offload_param=none" in line or "offload_param" not in line):
            return float(re.findall(r"([\d.]+)GB", line)[1])
    raise AssertionError(out.getvalue())


@pytest.mark.parametrize("gpus_per_node", [1, 4])
def test_all_live_estimators_on_a_real_module(gpus_per_node: int) -> None:
    from trainforge.plan.module_shape import summarize_module

    model = _model()
    summary = summarize_module(model)
    ds3 = _gpu_gib_from_all_live(deepspeed_stage3.estimate_zero3_model_states_mem_needs_all_live, model,
                                 gpus_per_node)
    ds2 = _gpu_gib_from_all_live(stage_1_and_2.estimate_zero2_model_states_mem_needs_all_live, model,
                                 gpus_per_node)
    ours3 = _total(model_states_bytes(summary.total_params, num_gpus=gpus_per_node, sharding="full-shard",
                                      largest_layer_params=summary.largest_module_params))
    ours2 = _total(model_states_bytes(summary.total_params, num_gpus=gpus_per_node, sharding="shard-grad-op"))
    assert round(ours3 / 2**30, 2) == ds3
    assert round(ours2 / 2**30, 2) == ds2
