"""The planner against published training runs (tests/unit/plan/published.py, each with its source).

(a) every published layout is feasible in memory, (b) predicted MFU is within MFU_TOLERANCE of the published one
(and the median error within MEDIAN_TOLERANCE), (c) the advisor's pick is at least as fast, by the model's own
numbers, as the published layout, and feasible. Run: pytest tests/unit/plan/test_published.py -q
"""

from __future__ import annotations

import statistics

import pytest

from tests.unit.plan.published import PUBLISHED, PublishedRun
from trainforge.plan.advisor import PlanRequest, evaluate_layout, search
from trainforge.plan.hardware import gpu_spec
from trainforge.plan.topology import default_topology

MFU_TOLERANCE = 0.25  # relative: |predicted - published| / published
MEDIAN_TOLERANCE = 0.08


def _request(run: PublishedRun) -> PlanRequest:
    return PlanRequest(run.model, gpu_spec(run.gpu), default_topology(run.gpu), run.layout.world_size,
                       run.global_batch_size, run.seq_len, uneven_stages=run.uneven_stages,
                       flash_attention=run.flash_attention, engine=None)  # each run's own engine (Megatron, DeepSpeed)


def relative_errors() -> dict[str, float]:
    out = {}
    for run in PUBLISHED:
        plan = evaluate_layout(_request(run), run.layout)
        assert plan.step is not None
        out[run.name] = (plan.step.mfu - run.published_mfu) / run.published_mfu
    return out


@pytest.mark.parametrize("run", PUBLISHED, ids=lambda r: r.name)
def test_published_layout_is_feasible_and_mfu_close(run: PublishedRun) -> None:
    plan = evaluate_layout(_request(run), run.layout)
    assert not plan.problems, plan.problems
    assert plan.memory.fits, plan.memory.explain()
    assert plan.step is not None
    error = (plan.step.mfu - run.published_mfu) / run.published_mfu
    assert abs(error) <= MFU_TOLERANCE, f"{run.name}: predicted {plan.step.mfu:.3f} vs {run.published_mfu:.3f}"


def test_mfu_error_distribution() -> None:
    errors = relative_errors()
    median = statistics.median(abs(e) for e in errors.values())
    print("\nMFU relative error: " + ", ".join(f"{k} {v:+.1%}" for k, v in errors.items()))
    print(f"median |error| {median:.1%}, max |error| {max(abs(e) for e in errors.values()):.1%}")
    assert median <= MEDIAN_TOLERANCE


@pytest.mark.parametrize("run", PUBLISHED, ids=lambda r: r.name)
def test_advisor_pick_at_least_as_fast_as_published(run: PublishedRun) -> None:
    req = _request(run)
    published = evaluate_layout(req, run.layout)
    best = search(req).best
    assert best.feasible and best.step is not None and published.step is not None
    assert best.step.step_time_s <= published.step.step_time_s * (1 + 1e-9)
