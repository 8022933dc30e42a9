"""The step-time model's overlap terms (issue 20, deliverable 1): every collective of a step is a named term with its
total, the compute window that hides it and what stays exposed; the step charges exactly the exposed seconds.

Run: pytest tests/unit/plan/test_overlap.py -q
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from trainforge.cli import app
from trainforge.plan.comm import PIPELINE_FLUSH_REDUCE
from trainforge.plan.hardware import gpu_spec
from trainforge.plan.layout import Layout
from trainforge.plan.model import PRESETS
from trainforge.plan.perf import (
    DP_BUCKET_BYTES,
    FSDP_OVERLAP,
    TP_EXPOSED,
    TP_OVERLAP_EXPOSED,
    StepEstimate,
    estimate_step,
)
from trainforge.plan.topology import default_topology

H100 = gpu_spec("h100")
TOPO = default_topology("h100")


def _step(model: str, layout: Layout, gbs: int, seq: int = 4096, **kw) -> StepEstimate:
    return estimate_step(PRESETS[model], layout, H100, TOPO, seq_len=seq, global_batch_size=gbs, precision="bf16",
                         **kw)


def _terms(step: StepEstimate) -> dict[str, object]:
    return {t.name: t for t in step.overlap}


def _t_mb(step: StepEstimate, layout: Layout, gbs: int) -> float:
    return step.compute_s / (gbs // (layout.dp * layout.micro_batch_size))


@pytest.mark.parametrize("layout", [
    Layout(dp=64, micro_batch_size=1),
    Layout(dp=64, micro_batch_size=1, sharding="shard-optimizer"),
    Layout(dp=64, micro_batch_size=1, sharding="full-shard"),
    Layout(dp=8, tp=8, pp=8, vpp=2, micro_batch_size=1, schedule="interleaved-1f1b", sharding="shard-grad-op"),
], ids=lambda lay: lay.describe())
def test_every_collective_is_a_term_and_the_step_charges_its_exposed_part(layout: Layout) -> None:
    step = _step("llama-8b" if layout.tp == 1 else "llama-70b", layout, gbs=512)
    kinds = {c.kind for c in step.comm}
    fsdp = {k for k in kinds if "fsdp" in k}
    names = {t.name for t in step.overlap}
    assert names == (kinds - fsdp) | ({"dp fsdp all-gather + reduce-scatter"} if fsdp else set())
    for t in step.overlap:
        assert 0.0 <= t.exposed_s <= t.total_s and t.hidden_s == pytest.approx(t.total_s - t.exposed_s), t
    for axis in ("tp", "pp", "ep", "dp"):
        assert step.exposed_by_axis[axis] == pytest.approx(sum(t.exposed_s for t in step.overlap if t.axis == axis))
    assert step.exposed_comm_s == pytest.approx(sum(t.exposed_s for t in step.overlap))


def test_a_gradient_all_reduce_hides_in_the_last_backward_but_its_last_bucket() -> None:
    """DDP: bucketed in the last micro-batch's backward (2/3 of its compute); the last 25 MiB bucket is exposed."""
    layout = Layout(dp=16, micro_batch_size=1)
    step = _step("llama-1b", layout, gbs=64, seq=2048)
    (reduce,) = step.overlap
    assert reduce.name == "dp all-reduce" and reduce.window_s == pytest.approx(2 * _t_mb(step, layout, 64) / 3)
    (item,) = step.comm
    last_bucket = item.time_s * DP_BUCKET_BYTES / item.bytes_per_gpu
    assert reduce.exposed_s == pytest.approx(max(reduce.total_s - reduce.window_s, last_bucket))
    assert reduce.exposed_s >= last_bucket > 0


def test_zero1_reduce_scatters_in_backward_and_gathers_behind_the_next_forward() -> None:
    zero1 = _step("llama-8b", Layout(dp=64, micro_batch_size=1, sharding="shard-optimizer"), gbs=512)
    ddp = _step("llama-8b", Layout(dp=64, micro_batch_size=1), gbs=512)
    terms = _terms(zero1)
    assert set(terms) == {"dp reduce-scatter", "dp all-gather"}
    # the bytes of one all-reduce, split in two halves
    assert sum(c.bytes_per_gpu for c in zero1.comm) == pytest.approx(ddp.comm[0].bytes_per_gpu)
    t_mb = _t_mb(zero1, Layout(dp=64, micro_batch_size=1), 512)
    assert terms["dp all-gather"].window_s == pytest.approx(t_mb / 3)
    assert terms["dp reduce-scatter"].window_s == pytest.approx(2 * t_mb / 3)


def test_fsdp_prefetch_hides_behind_most_of_the_compute_but_the_first_gather() -> None:
    layout = Layout(dp=64, micro_batch_size=1, sharding="full-shard")
    step = _step("llama-8b", layout, gbs=512)
    (term,) = step.overlap
    assert term.window_s == pytest.approx(FSDP_OVERLAP * step.compute_s)
    gather = next(c for c in step.comm if c.kind == "dp all-gather (fsdp)")
    assert term.exposed_s >= gather.time_s / (PRESETS["llama-8b"].layers + 1) > 0


def test_tp_overlap_exposes_less_of_the_tp_collectives_and_the_step_is_shorter() -> None:
    layout = Layout(dp=8, tp=8, pp=8, vpp=2, micro_batch_size=1, schedule="interleaved-1f1b", sharding="shard-grad-op")
    plain = _step("llama-70b", layout, gbs=512)
    overlapped = _step("llama-70b", layout, gbs=512, tp_comm_overlap=True)
    tp_plain = _terms(plain)["tp all-gather/reduce-scatter"]
    tp_over = _terms(overlapped)["tp all-gather/reduce-scatter"]
    assert tp_plain.exposed_s == pytest.approx(TP_EXPOSED * tp_plain.total_s)
    assert tp_over.exposed_s == pytest.approx(TP_OVERLAP_EXPOSED * tp_over.total_s)
    assert overlapped.step_time_s < plain.step_time_s
    pp = _terms(plain)["pp send/recv"]
    assert pp.exposed_s == pp.total_s and pp.window_s == 0.0  # on the critical path between stages


def test_plan_explain_and_json_name_each_term() -> None:
    runner = CliRunner()
    args = ["plan", "--model", "llama-70b", "--gpus", "512", "--global-batch", "1024",
            "--layout", "tp=8,pp=8,dp=8,mb=1,schedule=1f1b,sharding=shard-grad-op,ac=selective"]
    res = runner.invoke(app, [*args, "--explain"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.stdout.split())
    for name in (PIPELINE_FLUSH_REDUCE, "dp all-gather", "tp all-gather/reduce-scatter", "pp send/recv"):
        assert f"{name} " in text and "hidden" in text and "exposed" in text
    # torch's pipeline stages reduce-scatter after the step's last backward: nothing hides it
    assert "issued once the step's last backward is done" in text and "the first bucket exposed" in text
    doc = json.loads(runner.invoke(app, [*args, "--json"]).stdout)
    overlap = doc["plans"][0]["comm"]["overlap"]
    assert {t["name"] for t in overlap} == {PIPELINE_FLUSH_REDUCE, "dp all-gather", "tp all-gather/reduce-scatter",
                                            "pp send/recv"}
    flush = next(t for t in overlap if t["name"] == PIPELINE_FLUSH_REDUCE)
    assert flush["exposed_s"] == pytest.approx(flush["total_s"])
    for t in overlap:
        assert t["hidden_s"] + t["exposed_s"] == pytest.approx(t["total_s"]) and t["rule"]
