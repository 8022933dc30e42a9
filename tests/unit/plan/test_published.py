"""The planner against published training runs (tests/unit/plan/published.py, each with its source; the table and
the fit are tests/unit/plan/accuracy.py).

(a) every published layout is feasible in memory; (b) the shipped efficiency constants are the fit (one per GPU
generation); (c) the issue's accuracy bounds: median absolute MFU error <= 5%, every run within 15%, as many runs over
as under (a sign test); (d) leave-one-source-out; (e) the advisor's pick is at least as fast, by the model's own
numbers, as the published layout, and feasible.

Known misses, asserted at their measured value so they cannot grow unseen (issue 20 stays open for them):
- MT-NLG (3 runs, +26% to +31%): its published throughput is 23% below Megatron-LM 2021's for the same 530B shape,
  TP 8 x PP 35 and A100s at a similar batch; nothing in the layout explains it (its DeepSpeed pipeline engine is not
  modelled), so no constant fitted to the other sources predicts both.
  Left out, it is predicted 32.1% over: the constant fitted without it (by mean absolute error, stop 57) is higher.
Run: pytest tests/unit/plan/test_published.py -q
"""

from __future__ import annotations

import math

import pytest

from tests.unit.plan.accuracy import Summary, errors, fit, leave_one_source_out, request
from tests.unit.plan.published import PUBLISHED, PublishedRun
from trainforge.plan.advisor import candidate_layouts, evaluate_layout, search
from trainforge.plan.perf import SUSTAINED_FRACTION

MEDIAN_TOLERANCE = 0.05  # median |predicted - published| / published over every run
RUN_TOLERANCE = 0.15  # every run
KNOWN_MISSES = {"mt-nlg": 0.32}  # source -> its measured worst error, asserted as a ceiling (module doc)
LOSO_KNOWN_MISSES = {"mt-nlg": 0.33}


@pytest.mark.parametrize("run", PUBLISHED, ids=lambda r: r.name)
def test_published_layout_is_feasible_and_mfu_close(run: PublishedRun) -> None:
    plan = evaluate_layout(request(run), run.layout)
    assert not plan.problems, plan.problems
    assert plan.memory.fits, plan.memory.explain()
    assert plan.step is not None
    error = (plan.step.mfu - run.published_mfu) / run.published_mfu
    bound = KNOWN_MISSES.get(run.family, RUN_TOLERANCE)
    assert abs(error) <= bound, f"{run.name}: predicted {plan.step.mfu:.3f} vs {run.published_mfu:.3f}"


def test_the_shipped_constants_are_the_fit() -> None:
    fitted = fit(PUBLISHED)
    assert fitted == {g: SUSTAINED_FRACTION[g] for g in fitted}, f"refit: {fitted}"


def test_mfu_error_distribution_has_a_small_median_and_no_bias() -> None:
    total = Summary.of(errors(PUBLISHED).values())
    print(f"\n{total}")
    assert total.median <= MEDIAN_TOLERANCE
    # no bias: as many over as under, within two standard deviations of a fair coin's count
    assert abs(total.over - total.under) <= 2 * math.sqrt(total.runs), total
    assert len({r.family for r in PUBLISHED}) >= 6 and total.runs >= 40


def test_each_source_left_out_is_predicted_by_the_constants_fitted_on_the_others() -> None:
    loso = leave_one_source_out(PUBLISHED)
    assert None not in loso.values()  # every generation has at least two sources
    for family, summary in loso.items():
        if summary is not None:
            assert summary.worst <= LOSO_KNOWN_MISSES.get(family, RUN_TOLERANCE), (family, summary)


@pytest.mark.parametrize("run", PUBLISHED, ids=lambda r: r.name)
def test_every_published_layout_is_among_the_advisors_candidates(run: PublishedRun) -> None:
    """So the advisor's pick, the fastest feasible candidate, is at least as fast as the published layout by the
    model's own numbers (the layout is feasible: the test above); the full search is run for one run per source."""
    assert run.layout in set(candidate_layouts(request(run))), run.layout.describe()


FIRST_OF_EACH_SOURCE = list({r.family: r for r in reversed(PUBLISHED)}.values())


@pytest.mark.parametrize("run", FIRST_OF_EACH_SOURCE, ids=lambda r: r.name)
def test_advisor_pick_at_least_as_fast_as_published(run: PublishedRun) -> None:
    req = request(run)
    published = evaluate_layout(req, run.layout)
    best = search(req).best
    assert best.feasible and best.step is not None and published.step is not None
    assert best.step.step_time_s <= published.step.step_time_s * (1 + 1e-9)
