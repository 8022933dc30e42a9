"""Cost of an elastic job: a `resize` event between segments sets the workers of the segments and steps after it,
so GPU-hours follow the gang's size and the split still adds up.

Run: .venv/bin/python -m pytest tests/unit/observability/test_cost_elastic.py -q
"""

from __future__ import annotations

import pytest

from trainforge.contract.events import Metrics, Resize, SegmentEvent
from trainforge.infra.cost import job_cost, step_hours, workers_at

PRICES = {"h100": {"on_demand": 4.0, "spot": 2.0}}


def elastic_job() -> tuple[dict, list[SegmentEvent]]:
    """8 workers for a 1000 s segment, then shrunk to 4 workers for a 2000 s segment."""
    record = {"job_id": "e", "team": "a", "state": "completed", "created_at": 0.0,
              "spec": {"resources": {"gpu_type": "h100"}}, "plan": {"world_size": 8},
              "segments": [{"attempt": 0, "started_at": 0.0, "ended_at": 1000.0, "state": "resized"},
                           {"attempt": 1, "started_at": 1010.0, "ended_at": 3010.0, "state": "completed"}]}
    events: list[SegmentEvent] = [Metrics(step=s, step_time_s=1.0, time=10.0 + s) for s in range(1, 801)]
    events.append(Resize(reason="the scheduler shrank the allocation", from_workers=8, to_workers=4, from_dp=8,
                         to_dp=4, accumulation=[1, 2], micro_batch_size=2, global_batch_size=16, after_step=800,
                         time=1005.0))
    events += [Metrics(step=s, step_time_s=2.0, time=1020.0 + 2 * s) for s in range(801, 1701)]
    return record, events


def test_gpu_hours_follow_the_gang_size():
    record, events = elastic_job()
    assert workers_at(events, 8) == [(float("-inf"), 8), (1005.0, 4)]
    cost = job_cost(record, events, prices=PRICES, now=3010.0)
    assert cost.resizes == 1
    assert cost.gpu_hours == pytest.approx((1000 * 8 + 2000 * 4) / 3600)
    productive, lost, _ = step_hours(events, 8)
    assert productive == pytest.approx((800 * 1.0 * 8 + 900 * 2.0 * 4) / 3600) and lost == 0
    assert cost.productive_hours + cost.idle_hours + cost.lost_hours == pytest.approx(cost.gpu_hours)
    assert cost.compute_cost == pytest.approx(cost.gpu_hours * 4.0)


def test_no_resize_is_the_plain_model():
    record, events = elastic_job()
    plain = [e for e in events if not isinstance(e, Resize)]
    cost = job_cost(record, plain, prices=PRICES, now=3010.0)
    assert cost.resizes == 0 and cost.gpu_hours == pytest.approx(3000 * 8 / 3600)
