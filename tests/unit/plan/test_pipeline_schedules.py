"""The step model's pipeline terms against the schedules themselves, simulated operation by operation.

The planner times a pipelined step as m + (p-1)/v micro-batch slots (`perf.pipeline_slots`) and sizes its
activations by the micro-batches stage 0 holds at once (`memory.micro_batches_in_flight`). Both are checked here
against the orders torch.distributed.pipelining runs (the engine's schedules), for every pipeline of 2-8 ranks,
1-4 virtual stages and up to 4p micro-batches that `layout_problems` allows, with the backward at two and three
times the forward (without and with full recomputation). The interleaved rule (micro-batches a multiple of p) is
checked to be no stricter than it must be. The schedules the published runs used (Megatron-LM's 1F1B, DeepSpeed's
TrainSchedule) are checked too: the accuracy table prices them with the same slot count.
"""

from __future__ import annotations

import math

import pytest

from tests.unit.plan.schedules import (
    deepspeed_train,
    megatron_1f1b,
    simulate,
    torch_1f1b,
    torch_gpipe,
    torch_interleaved,
)
from trainforge.plan.layout import Layout, layout_problems
from trainforge.plan.memory import micro_batches_in_flight
from trainforge.plan.model import ModelShape, swiglu_ffn
from trainforge.plan.perf import pipeline_slots

RANKS = range(2, 9)
VIRTUAL = range(2, 5)
RATIOS = ((1.0, 2.0), (1.0, 3.0))  # forward : backward, without and with full recomputation


def _allowed(p: int, v: int, m: int, schedule: str) -> bool:
    """Whether `layout_problems` accepts m micro-batches (global batch m at dp 1, micro-batch 1) on p ranks."""
    model = ModelShape("sched", p * v * 2, 512, 8, 8, swiglu_ffn(512), 1024)
    layout = Layout(dp=1, pp=p, vpp=v, micro_batch_size=1, schedule=schedule)
    return not layout_problems(layout, model, global_batch_size=m, world_size=p, gpus_per_node=8)


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_single_stage_schedules_take_the_modelled_slots_and_hold_the_modelled_micro_batches(schedule: str) -> None:
    checked = 0
    for p in RANKS:
        for m in range(1, 4 * p + 1):
            if not _allowed(p, 1, m, schedule):
                continue
            order = torch_gpipe(p, m) if schedule == "gpipe" else torch_1f1b(p, m)
            layout = Layout(dp=1, pp=p, micro_batch_size=1, schedule=schedule)
            for fwd, bwd in RATIOS:
                run = simulate(order, stages=p, forward=fwd, backward=bwd)
                assert _close(run.makespan, pipeline_slots(p, 1, m) * (fwd + bwd)), (p, m, fwd, bwd)
            assert run.peak_in_flight[0] == max(run.peak_in_flight.values())
            assert _close(run.peak_in_flight[0], micro_batches_in_flight(layout, m)), (p, m)
            checked += 1
    assert checked > 100


def test_torch_interleaved_1f1b_takes_the_modelled_slots_and_holds_the_modelled_micro_batches() -> None:
    pytest.importorskip("torch")  # torch's own action lists; `make test-pure` runs without torch
    checked = 0
    for p in RANKS:
        for v in VIRTUAL:
            for m in range(p, 4 * p + 1):
                if not _allowed(p, v, m, "interleaved-1f1b"):
                    continue
                order = torch_interleaved(p, v, m)
                layout = Layout(dp=1, pp=p, vpp=v, micro_batch_size=1, schedule="interleaved-1f1b")
                for fwd, bwd in RATIOS:
                    run = simulate(order, stages=p * v, v=v, forward=fwd, backward=bwd)
                    assert _close(run.makespan, pipeline_slots(p, v, m) * (fwd + bwd)), (p, v, m, fwd, bwd)
                assert _close(max(run.peak_in_flight.values()), run.peak_in_flight[0])
                assert _close(run.peak_in_flight[0], micro_batches_in_flight(layout, m)), (p, v, m)
                checked += 1
    assert checked > 60


def test_every_interleaved_micro_batch_count_the_rules_refuse_is_refused_or_mispriced_by_torch() -> None:
    """The rule is not stricter than the models need: each refused count is one torch's constructor refuses, or one
    whose time (fewer micro-batches than ranks) or activations (torch's flexible rounds warm up more micro-batches
    when m is not a multiple of p) exceed what the planner would charge."""
    pytest.importorskip("torch")
    refused = 0
    for p in RANKS:
        for v in VIRTUAL:
            for m in range(1, 4 * p + 1):
                if _allowed(p, v, m, "interleaved-1f1b"):
                    continue
                refused += 1
                try:
                    order = torch_interleaved(p, v, m)
                except ValueError:
                    continue
                run = simulate(order, stages=p * v, v=v)
                layout = Layout(dp=1, pp=p, vpp=v, micro_batch_size=1, schedule="interleaved-1f1b")
                slower = run.makespan > pipeline_slots(p, v, m) * 3.0 * (1 + 1e-9)
                bigger = max(run.peak_in_flight.values()) > micro_batches_in_flight(layout, m) + 1e-9
                assert slower or bigger, (p, v, m)
    assert refused > 100


@pytest.mark.parametrize("p,m", [(2, 8), (4, 4), (4, 16), (8, 8), (8, 64), (12, 128), (35, 240), (35, 160)])
def test_the_published_engines_schedules_take_the_modelled_slots(p: int, m: int) -> None:
    """Megatron-LM's and DeepSpeed's 1F1B, with blocking point-to-point, take m + p - 1 slots when transfers are
    free, like torch's. With a transfer time X, Megatron's batched calls add 2X per slot (the model's "2 (act +
    grad)" per micro-batch, charged on the critical path); DeepSpeed's one-message calls add up to 4X."""
    for fwd, bwd in RATIOS:
        ideal = pipeline_slots(p, 1, m) * (fwd + bwd)
        for build in (megatron_1f1b, deepspeed_train):
            assert _close(simulate(build(p, m), stages=p, forward=fwd, backward=bwd).makespan, ideal)
        x = 0.05 * fwd
        megatron = simulate(megatron_1f1b(p, m), stages=p, forward=fwd, backward=bwd, transfer=x).makespan
        deepspeed = simulate(deepspeed_train(p, m), stages=p, forward=fwd, backward=bwd, transfer=x).makespan
        assert megatron <= pipeline_slots(p, 1, m) * (fwd + bwd + 2 * x) + 1e-9
        assert megatron <= deepspeed <= pipeline_slots(p, 1, m) * (fwd + bwd + 4 * x) + 1e-9


def test_the_simulator_sees_a_bubble_and_a_deadlock() -> None:
    """The simulator is not the formula restated: it finds GPipe's bubble from dependencies alone, and refuses an
    order whose ranks wait on each other."""
    run = simulate(torch_gpipe(4, 1), stages=4)
    assert run.makespan == 4 * 3.0  # one micro-batch crosses all four stages and back: no overlap at all
    order = torch_1f1b(2, 2)
    order[1] = list(reversed(order[1]))  # the last stage's backward first: it needs its own forward
    with pytest.raises(RuntimeError, match="deadlocks"):
        simulate(order, stages=2)
