"""Advisor, resolve_layout, checkpoint interval, model descriptions and the `trainforge plan` CLI.

Run: pytest tests/unit/plan/test_advisor.py -q
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainforge.cli import app
from trainforge.plan.advisor import InfeasibleLayoutError, PlanRequest, check_fixed_layout, search
from trainforge.plan.checkpointing import checkpoint_bytes, daly_interval, plan_checkpoints, young_interval
from trainforge.plan.cluster import load_cluster, local_cluster
from trainforge.plan.hardware import gpu_spec
from trainforge.plan.layout import Layout
from trainforge.plan.model import PRESETS, resolve_model, shape_from_spec
from trainforge.plan.report import explain
from trainforge.plan.resolve import resolve_layout
from trainforge.plan.topology import default_topology
from trainforge.spec import load_spec

ROOT = Path(__file__).resolve().parents[3]


def _req(model="llama-70b", gpus=512, gpu="h100", gbs=1024, seq=4096, **fixed):
    return PlanRequest(PRESETS[model], gpu_spec(gpu), default_topology(gpu), gpus, gbs, seq, fixed=fixed)


def test_fixed_degrees_are_respected():
    result = search(_req(tp=8, pp=4))
    assert result.plans and all(p.layout.tp == 8 and p.layout.pp == 4 and p.layout.dp == 16 for p in result.plans)
    result = search(_req(sharding="none", activation_checkpointing="full", micro_batch_size=1))
    assert all(p.layout.sharding == "none" and p.layout.activation_checkpointing == "full" for p in result.plans)


def test_infeasible_fixed_layout_says_by_how_much_and_what_to_change():
    req = _req(gpus=8, gpu="a100-40gb", gbs=64)
    with pytest.raises(InfeasibleLayoutError, match=r"over by \d+\.\d GiB") as err:
        check_fixed_layout(req, Layout(dp=1, tp=8, micro_batch_size=1))
    assert "a100-40gb" in str(err.value)
    # At 2k tokens (at 4k the engine's own activations, 22.8 GiB without recomputation, leave full-shard alone short)
    req = _req(model="llama-7b", gpus=8, gpu="a100-40gb", gbs=64, seq=2048)
    with pytest.raises(InfeasibleLayoutError, match="Changes that fit: .*sharding: full-shard"):
        check_fixed_layout(req, Layout(dp=8, micro_batch_size=1))


def test_no_feasible_layout_is_an_error_with_the_closest():
    with pytest.raises(InfeasibleLayoutError, match="no layout of llama-405b .* Closest"):
        _ = search(_req(model="llama-405b", gpus=8)).best


def test_explanation_compares_winner_with_alternatives():
    result = search(_req())
    lines = explain(result)
    assert lines[0].startswith("winner") and any(line.startswith("runner-up") for line in lines)
    assert any(line.startswith("why not") for line in lines)


def test_resolve_layout_uses_advisor_for_auto_and_keeps_explicit():
    fleet = load_cluster(ROOT / "examples/clusters/fleet-10k.yaml")
    spec = load_spec(ROOT / "examples/llama-7b-finetune.yaml")
    layout = resolve_layout(spec, shape_from_spec(spec.model, spec.name), fleet)
    assert (layout.sharding, layout.micro_batch_size, layout.activation_checkpointing) == ("full-shard", 2,
                                                                                         "selective")
    assert layout.world_size == 8
    best = search(_req(model="llama-7b", gpus=8, gpu="a100-80gb", gbs=128, sharding="full-shard",
                       micro_batch_size=2, activation_checkpointing="selective")).best.layout
    assert layout == best
    tiny = load_spec(ROOT / "examples/tiny-cpu.yaml")
    assert resolve_layout(tiny, shape_from_spec(tiny.model, tiny.name), local_cluster()) == Layout(
        dp=2, micro_batch_size=4)


def test_young_daly_interval_and_checkpoint_size():
    assert young_interval(60, 3600) == pytest.approx(math.sqrt(2 * 60 * 3600))
    assert daly_interval(60, 3600) < young_interval(60, 3600) and daly_interval(8000, 3600) == 3600
    sizes = checkpoint_bytes(PRESETS["llama-70b"])
    assert sizes["training_checkpoint"] == PRESETS["llama-70b"].total_params * 12
    plan = plan_checkpoints(PRESETS["llama-70b"], nodes=64, node_mtbf_hours=50_000, step_time_s=10,
                            max_lost_work_s=None)
    assert plan.cluster_mtbf_s == pytest.approx(50_000 * 3600 / 64)
    assert plan.interval_steps == round(plan.interval_s / 10) and 0 < plan.overhead_fraction < 0.05
    assert plan.interval_s == plan.daly_interval_s and not plan.capped


@pytest.mark.parametrize("mtbf_hours", [500, 2_000, 10_000, 50_000, 200_000])
@pytest.mark.parametrize("nodes", [1, 16, 128, 512])
def test_interval_never_risks_more_than_ten_minutes_of_work(nodes, mtbf_hours):
    """One failure must not cost more than 10 minutes (the requirements): the interval is Daly's optimum unless
    that would let a failure just before the next commit lose more; then it is capped, at a small overhead."""
    kwargs = dict(nodes=nodes, node_mtbf_hours=mtbf_hours, step_time_s=3.5, async_stall_fraction=0.1)
    plan = plan_checkpoints(PRESETS["llama-70b"], **kwargs)
    free = plan_checkpoints(PRESETS["llama-70b"], **kwargs, max_lost_work_s=None)
    assert plan.worst_lost_work_s <= 600 + 1e-9
    if plan.capped:  # rounded down under the cap, so the step count never overshoots the bound
        assert plan.interval_steps * 3.5 <= plan.interval_s + 1e-9
    assert plan.capped == (free.worst_lost_work_s > 600)
    assert plan.interval_s == pytest.approx(min(free.interval_s, 600 - plan.commit_s))
    assert plan.overhead_fraction >= free.overhead_fraction - 1e-12  # Daly's is the optimum: the cap only costs


def test_model_file_and_meta_module(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("layers: 4\nhidden: 256\nheads: 8\nkv_heads: 4\nvocab: 260\nseq_len: 128\nmlp: swiglu\n")
    shape, seq = resolve_model(str(path))
    assert (shape.layers, shape.ffn_hidden, seq) == (4, 768, 128)
    with pytest.raises(ValueError, match="neither a preset"):
        resolve_model("no-such-model")
    torch = pytest.importorskip("torch")
    from trainforge.plan.module_shape import shape_from_module

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.Linear(64, 192)
            self.mlp = torch.nn.Linear(64, 256)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(100, 64)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(3))

    with torch.device("meta"):
        net = Net()
    shape = shape_from_module(net, heads=4)
    assert shape.layers == 3 and shape.hidden == 64 and shape.vocab == 100
    assert shape.total_params == sum(p.numel() for p in net.parameters())


def test_cli_json_schema_and_layout_check():
    runner = CliRunner()
    res = runner.invoke(app, ["plan", "--model", "llama-70b", "--gpus", "512", "--global-batch", "1024", "--json",
                              "--top", "3"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["schema"] == "trainforge.plan/v1" and len(doc["plans"]) == 3
    plan = doc["plans"][0]
    assert plan["feasible"] is True
    assert set(plan["layout"]) >= {"dp", "tp", "pp", "vpp", "micro_batch_size", "schedule", "sharding",
                                   "activation_checkpointing"}
    assert set(plan["performance"]) >= {"step_time_s", "tokens_per_s", "mfu", "bubble_fraction"}
    assert plan["memory"]["total_bytes"] == sum(plan["memory"]["items"].values())
    assert plan["comm"]["bytes_per_iteration"]
    res = runner.invoke(app, ["plan", "--model", "llama-70b", "--gpus", "8", "--gpu-type", "a100-40gb",
                              "--layout", "tp=8,pp=1,mb=1", "--json"])
    assert res.exit_code == 1 and json.loads(res.stdout)["plans"][0]["feasible"] is False
    res = runner.invoke(app, ["plan", str(ROOT / "examples/llama-70b-pretrain.yaml"), "--cluster",
                              str(ROOT / "examples/clusters/fleet-10k.yaml"), "--explain"])
    assert res.exit_code == 0, res.output
    assert "activations" in res.stdout and "s*b*h" in res.stdout


def test_plan_package_stays_pure():
    code = ("import sys, trainforge.plan.advisor, trainforge.plan.report, trainforge.plan.resolve, "
            "trainforge.plan.checkpointing\n"
            "print(','.join(m for m in ('torch', 'torch.distributed', 'prefect', 'mlflow', 'deepspeed') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == ""
