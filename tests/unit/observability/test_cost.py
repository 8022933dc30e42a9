"""The cost model: GPU-hours from segments (failed ones included) split into productive / idle / lost / failed
that add up, queue time apart, storage cost, team rollup, price files.

Run: .venv/bin/python -m pytest tests/unit/observability -q
"""

from __future__ import annotations

import pytest

from trainforge.contract.events import Metrics
from trainforge.infra.cost import (
    DEFAULT_PRICES,
    job_cost,
    load_prices,
    simulated_cost,
    step_hours,
    team_rollup,
)

PRICES = {"h100": {"on_demand": 4.0, "spot": 2.0}, "cpu": {"on_demand": 1.0, "spot": 0.5}}


def record(state="completed", segments=((100.0, 3700.0, "completed"),), workers=8, gpu="h100", team="a", **extra):
    return {"job_id": f"job-{team}-{state}", "team": team, "state": state, "created_at": 40.0,
            "spec": {"resources": {"gpu_type": gpu}}, "plan": {"world_size": workers},
            "segments": [{"attempt": i, "started_at": s, "ended_at": e, "state": st}
                         for i, (s, e, st) in enumerate(segments)], **extra}


def metrics(steps, step_time=1.0, wait=0.0):
    return [Metrics(step=s, step_time_s=step_time, data_wait_s=wait) for s in steps]


def test_one_clean_segment():
    events = metrics(range(1, 3001), step_time=1.0, wait=0.1)  # 3000 s stepping of a 3600 s segment
    cost = job_cost(record(), events, prices=PRICES, now=5000.0)
    assert cost.gpu_hours == pytest.approx(8.0)
    assert cost.productive_hours == pytest.approx(3000 * 0.9 * 8 / 3600)
    assert cost.idle_hours == pytest.approx(8.0 - cost.productive_hours)  # startup + data wait
    assert cost.lost_hours == 0 and cost.failed_hours == 0
    assert cost.queue_hours == pytest.approx(60 / 3600)
    assert cost.compute_cost == pytest.approx(32.0)
    assert job_cost(record(), events, prices=PRICES, market="spot", now=5000.0).compute_cost == pytest.approx(16.0)


def test_failed_segment_and_recomputed_steps_are_lost_work():
    # segment 0 reached step 100 and failed; the last commit was step 80, so segment 1 redoes 81..100
    segs = ((0.0, 200.0, "failed"), (260.0, 560.0, "completed"))
    events = metrics(range(1, 101)) + metrics(range(81, 201))
    cost = job_cost(record(segments=segs, workers=2), events, prices=PRICES, now=1000.0)
    assert cost.gpu_hours == pytest.approx(500 * 2 / 3600)
    assert cost.lost_hours == pytest.approx(20 * 2 / 3600)
    assert cost.productive_hours == pytest.approx(200 * 2 / 3600)
    total = cost.productive_hours + cost.idle_hours + cost.lost_hours + cost.failed_hours
    assert total == pytest.approx(cost.gpu_hours)
    assert cost.segments == 2 and cost.failed_segments == 1
    assert step_hours(events, 2)[1] == pytest.approx(cost.lost_hours)


def test_failed_job_is_all_failed_hours():
    cost = job_cost(record(state="failed", segments=((0.0, 360.0, "failed"),)), metrics(range(1, 50)),
                    prices=PRICES, now=1000.0)
    assert cost.failed_hours == cost.gpu_hours == pytest.approx(0.8)
    assert cost.productive_hours == 0


def test_running_segment_counts_until_now_and_storage_cost():
    rec = record(segments=((0.0, None, "running"),), checkpoints={"10": {"bytes": 2e9, "committed_at": 0.0}})
    cost = job_cost(rec, [], prices=PRICES, now=86400.0, storage_gb_month=0.03)
    assert cost.gpu_hours == pytest.approx(24 * 8)
    assert cost.storage_gb_days == pytest.approx(2.0)
    assert cost.storage_cost == pytest.approx(2.0 * 0.03 / 30)
    assert cost.total_cost == pytest.approx(cost.compute_cost + cost.storage_cost)


def test_team_rollup_sums_jobs():
    a1 = job_cost(record(team="a"), [], prices=PRICES, now=5000.0)
    a2 = job_cost(record(team="a", gpu="cpu", workers=2), [], prices=PRICES, now=5000.0)
    b = job_cost(record(team="b", state="failed"), [], prices=PRICES, now=5000.0)
    teams = team_rollup([a1, a2, b])
    assert teams["a"].jobs == 2 and teams["a"].gpu_hours == pytest.approx(a1.gpu_hours + a2.gpu_hours)
    assert teams["a"].by_gpu_type == {"h100": pytest.approx(8.0), "cpu": pytest.approx(2.0)}
    assert teams["b"].failed_hours == pytest.approx(8.0)
    assert teams["a"].total_cost == pytest.approx(a1.total_cost + a2.total_cost)


def test_unknown_gpu_and_price_file(tmp_path):
    with pytest.raises(ValueError, match="no price for gpu type 'tpu'"):
        job_cost(record(gpu="tpu"), [], prices=PRICES)
    path = tmp_path / "prices.yaml"
    path.write_text("h100: {on_demand: 9.5, spot: 3}\nstorage_gb_month: 0.01\n")
    prices, storage = load_prices({"TRAINFORGE_PRICES": str(path)})
    assert prices["h100"] == {"on_demand": 9.5, "spot": 3.0} and prices["cpu"] == DEFAULT_PRICES["cpu"]
    assert storage == 0.01
    assert load_prices({}) == (DEFAULT_PRICES, 0.023)


def test_simulated_cost():
    assert simulated_cost({"h100": 3600 * 8}, PRICES) == pytest.approx(32.0)
