"""Alert rules over live metrics: each kind fires once when its condition holds and re-arms after it clears;
the observer maps worker events to MLflow metric rows.

Run: .venv/bin/python -m pytest tests/unit/observability -q
"""

from __future__ import annotations

import json

import pytest

from trainforge.contract.events import EventError, parse_event
from trainforge.registry.alerts import (
    DEFAULT_RULES,
    AlertEngine,
    AlertRule,
    MetricsObserver,
    load_rules,
)


def feed(engine, rows):
    fired = []
    for i, row in enumerate(rows, start=1):
        fired += engine.observe(i, row)
    return fired


def only(kind, **kw):
    return (AlertRule(kind, **kw),)


def test_loss_nan_fires_once():
    engine = AlertEngine(only("loss_nan", window=1, warmup=0))
    fired = feed(engine, [{"loss": 2.0}, {"loss": float("nan")}, {"loss": float("inf")}])
    assert [(a.kind, a.step) for a in fired] == [("loss_nan", 2)]


def test_loss_spike_against_recent_median():
    engine = AlertEngine(only("loss_spike", threshold=2.0, window=3, warmup=0))
    fired = feed(engine, [{"loss": 1.0}, {"loss": 1.1}, {"loss": 0.9}, {"loss": 1.5}, {"loss": 5.0}])
    assert [(a.step, a.value) for a in fired] == [(5, 5.0)]


def test_mfu_below_plan_uses_predicted_step_time():
    engine = AlertEngine(only("mfu_below_plan", threshold=0.5, window=2, warmup=0), predicted_step_time_s=1.0)
    assert feed(engine, [{"step_time_s": 1.5}, {"step_time_s": 1.5}]) == []  # 67% of plan: fine
    engine = AlertEngine(only("mfu_below_plan", threshold=0.5, window=2, warmup=0), predicted_step_time_s=1.0)
    fired = feed(engine, [{"step_time_s": 3.0}, {"step_time_s": 3.0}, {"step_time_s": 3.0}])
    assert len(fired) == 1 and fired[0].value == pytest.approx(1 / 3)
    assert AlertEngine(only("mfu_below_plan"), predicted_step_time_s=None).observe(9, {"step_time_s": 99}) == []


def test_throughput_drop_vs_own_baseline_and_rearm():
    engine = AlertEngine(only("throughput_drop", threshold=0.3, window=2, warmup=1))
    rows = [{"tokens_per_s": 10}] + [{"tokens_per_s": 100}] * 3 + [{"tokens_per_s": 50}] * 3 \
        + [{"tokens_per_s": 100}] * 3 + [{"tokens_per_s": 40}] * 2
    fired = feed(engine, rows)
    assert engine.baseline_tps == 100
    assert [a.step for a in fired] == [6, 12]  # fired, cleared, fired again
    assert fired[0].value == pytest.approx(0.5)


def test_data_wait_fraction():
    engine = AlertEngine(only("data_wait", threshold=0.2, window=2, warmup=0))
    fired = feed(engine, [{"step_time_s": 1, "data_wait_s": 0.1}, {"step_time_s": 1, "data_wait_s": 0.25},
                          {"step_time_s": 1, "data_wait_s": 0.5}])
    assert [a.step for a in fired] == [3]


def test_straggler_and_ecc_and_stall():
    engine = AlertEngine(only("straggler", threshold=1.3, window=2, warmup=0) + only("ecc_errors", window=1,
                         warmup=0) + only("stalled", threshold=60.0))
    engine.observe(1, {"loss": 1.0})
    assert engine.observe_ranks(1, {"straggler_ratio": 1.5, "straggler_rank": 3}) == []  # window of 2
    fired = engine.observe_ranks(2, {"straggler_ratio": 1.6, "straggler_rank": 3})
    assert fired[0].kind == "straggler" and "rank 3" in fired[0].message
    assert engine.observe_system(2, {"system/gpu_ecc_uncorrected": 0.0}) == []
    assert engine.observe_system(3, {"system/gpu_ecc_uncorrected": 2.0})[0].value == 2.0
    assert engine.check_stalled(3, 30.0) == []
    assert engine.check_stalled(3, 90.0)[0].kind == "stalled"
    assert engine.check_stalled(3, 120.0) == []  # still stalled: one alert


def test_rules_validate_and_load(tmp_path):
    with pytest.raises(ValueError, match="unknown alert kind"):
        AlertRule("gpu_on_fire")
    with pytest.raises(ValueError, match="window"):
        AlertRule("data_wait", window=0)
    assert load_rules({}) == DEFAULT_RULES
    path = tmp_path / "rules.json"
    path.write_text(json.dumps([{"kind": "data_wait", "threshold": 0.5, "name": "slow-input"}]))
    rules = load_rules({"TRAINFORGE_ALERT_RULES": str(path)})
    assert rules == (AlertRule("data_wait", threshold=0.5, name="slow-input"),)
    assert rules[0].label == "slow-input"


def test_observer_maps_events_to_rows_and_alerts():
    obs = MetricsObserver(DEFAULT_RULES, {"mfu": 0.4, "step_time_s": 0.5})
    rows = obs.rows(parse_event({"type": "metrics", "step": 3, "time": 10.0, "loss": 2.0, "step_time_s": 1.0,
                                 "mfu": 0.2, "src": {"job": "j", "rank": 0}}))
    assert rows == [(3, {"loss": 2.0, "step_time_s": 1.0, "mfu": 0.2, "mfu_predicted": 0.4,
                         "plan_attainment": 0.5})]
    # A flag or a name is not a metric: the event is refused where it is parsed (at the sender, when built).
    for bad in ({"flag": True}, {"name": "x"}):
        with pytest.raises(EventError, match=f"field '{next(iter(bad))}'"):
            parse_event({"type": "metrics", "step": 3, **bad})
    assert obs.rows(parse_event({"type": "rank_metrics", "step": 3, "step_time_s_max": 1.2})) == \
        [(3, {"ranks/step_time_s_max": 1.2})]
    assert obs.rows(parse_event({"type": "system", "step": 3, "source": "cpu", "cpu_percent": 50})) == \
        [(3, {"system/cpu_percent": 50.0})]
    assert obs.rows(parse_event({"type": "checkpoint_staged", "step": 4, "blocked_s": 0.02})) == \
        [(4, {"checkpoint_stall_s": 0.02})]
    assert obs.rows(parse_event({"type": "checkpoint", "step": 4, "prefix": "ckpt/step-4"})) == []
    obs.rows(parse_event({"type": "metrics", "step": 4, "time": 11.0, "loss": float("nan"), "step_time_s": 1.0}))
    assert [a.kind for a in obs.take_alerts()] == ["loss_nan"]
    assert obs.take_alerts() == []
