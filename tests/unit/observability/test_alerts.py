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
    overlaps,
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


# ---- steady state: platform windows, segment warm-up, persistence (tables) --------------------------------------

def run_steps(rule, tps, windows=(), restarts=(), ratios=None):
    """Feed 1-second steps (step i ends at t=i) with tokens/s `tps[i-1]` (and straggler ratios); `windows` are
    platform work (start, end); `restarts` the steps a new segment starts at. Returns the steps alerts fired at."""
    engine = AlertEngine((rule,))
    for k, (start, end) in enumerate(windows):
        engine.platform_started(f"w{k}", start)
        engine.platform_finished(f"w{k}", end)
    fired = []
    for i, value in enumerate(tps, start=1):
        if i in restarts:
            engine.segment_started()
        fired += engine.observe(i, {"tokens_per_s": value, "step_time_s": 1.0}, at=float(i))
        if ratios is not None:
            fired += engine.observe_ranks(i, {"straggler_ratio": ratios[i - 1], "straggler_rank": 1}, at=float(i))
    return [a.step for a in fired]


THROUGHPUT = AlertRule("throughput_drop", threshold=0.3, window=3, warmup=2, persist=3)
STEADY = [100.0] * 10


@pytest.mark.parametrize(("name", "tps", "windows", "restarts", "expected"), [
    ("healthy", STEADY * 3, (), (), []),
    ("slow while a checkpoint uploads", STEADY + [50.0] * 8 + STEADY, [(10.5, 18.2)], (), []),
    ("slow while an evaluation runs (still open at the end)", STEADY + [40.0] * 10, [(10.0, None)], (), []),
    # the window median (of 3) holds for as many steps as the slow phase lasts (one step late): persist 3 needs 3
    ("a blip of 2 slow steps", STEADY + [50.0] * 2 + STEADY, (), (), []),
    ("3 slow steps persist", STEADY + [50.0] * 3 + STEADY, (), (), [14]),
    ("a real drop persists: one alert", STEADY + [50.0] * 12, (), (), [14]),
    ("the drop continues across a window", STEADY + [50.0] * 3 + [50.0] * 4 + [50.0] * 3, [(13.5, 17.5)], (),
     [19]),
    ("slow first steps of a new segment", STEADY + [20.0, 30.0] + STEADY, (), (11,), []),
    ("a drop of 20% is under the threshold", STEADY + [80.0] * 20, (), (), []),
    ("fires, clears, fires again", STEADY + [50.0] * 8 + STEADY * 2 + [50.0] * 8, (), (), [14, 42]),
])
def test_throughput_drop_judged_on_steady_state(name, tps, windows, restarts, expected):
    assert run_steps(THROUGHPUT, tps, windows, restarts) == expected, name


STRAGGLER = AlertRule("straggler", threshold=1.2, window=3, warmup=2, persist=3)


@pytest.mark.parametrize(("name", "ratios", "windows", "expected"), [
    ("balanced ranks", [1.05] * 30, (), []),
    ("one rank slow while it uploads a checkpoint", [1.05] * 10 + [1.6] * 6 + [1.05] * 10, [(10.5, 16.5)], []),
    ("a blip", [1.05] * 10 + [1.5] * 2 + [1.05] * 10, (), []),
    ("slow before the job's first steady window", [1.05] * 3 + [1.3] * 2 + [1.05] * 10, (), []),
    ("a rank 30% slower for good", [1.05] * 10 + [1.3] * 10, (), [14]),
    ("slow during warm-up only", [2.0, 2.0] + [1.05] * 10, (), []),
])
def test_straggler_judged_on_steady_state(name, ratios, windows, expected):
    assert run_steps(STRAGGLER, [100.0] * len(ratios), windows, (), ratios) == expected, name


@pytest.mark.parametrize(("windows", "start", "end", "expected"), [
    ([], 0.0, 1.0, False),
    ([(2.0, 3.0)], 0.0, 1.0, False),
    ([(2.0, 3.0)], 1.0, 2.0, False),  # touching is not overlapping
    ([(2.0, 3.0)], 1.5, 2.5, True),
    ([(2.0, 3.0)], 2.2, 2.8, True),
    ([(2.0, None)], 9.0, 10.0, True),  # still open
    ([(2.0, 3.0)], 3.0, 4.0, False),
])
def test_overlaps(windows, start, end, expected):
    assert overlaps(windows, start, end) is expected


def test_observer_opens_checkpoint_windows_from_events_and_flow_windows_from_the_flow():
    rule = AlertRule("throughput_drop", threshold=0.3, window=2, warmup=1, persist=2)
    obs = MetricsObserver((rule,), {})

    def step(i, tps):
        obs.rows(parse_event({"type": "metrics", "step": i, "time": float(i), "tokens_per_s": tps,
                              "step_time_s": 1.0}))

    obs.rows(parse_event({"type": "segment_start", "step": 0, "world_size": 2, "time": 0.0}))
    for i in range(1, 8):
        step(i, 100.0)
    obs.rows(parse_event({"type": "checkpoint_staged", "step": 7, "blocked_s": 0.1, "time": 7.2}))
    for i in range(8, 12):
        step(i, 40.0)  # the upload slows training: excused
    obs.rows(parse_event({"type": "checkpoint", "step": 7, "prefix": "p", "time": 11.5}))
    obs.platform_started("evaluate-7", 11.6)
    for i in range(12, 16):
        step(i, 40.0)  # the evaluation competes for the cores: excused
    obs.platform_finished("evaluate-7", 15.4)
    assert obs.take_alerts() == []
    for i in range(16, 21):
        step(i, 40.0)  # slow with nothing running beside it (16 overlaps the evaluation's end): a real drop
    assert [a.step for a in obs.take_alerts()] == [19]
    obs.rows(parse_event({"type": "segment_start", "step": 20, "world_size": 2, "time": 20.5}))
    assert obs.engine.segment_steps == 0


def test_default_rules_persist_and_validate():
    rules = {r.kind: r for r in DEFAULT_RULES}
    assert rules["throughput_drop"].persist > 1 and rules["straggler"].persist > 1
    assert rules["straggler"].threshold < 1.3  # a rank 30% slower than the others must fire
    with pytest.raises(ValueError, match="persist"):
        AlertRule("straggler", persist=0)


# (straggler rank, straggler ratio) per step of a real 2-worker run on 2 loaded cores (load average ~60), rank 1 made
# 30% slower from step 11 (TRAINFORGE_FAULT=slow:rank=1:step=10:pct=30; tests/integration/test_alerts_flow.py).
# Before it the slowest rank alternates and single steps reach 2x: noise the rule must not call a straggler.
MEASURED_30PCT = [(1, 1.13), (0, 1.16), (0, 1.01), (1, 1.1), (0, 1.63), (1, 1.62), (0, 1.52), (1, 1.44), (0, 2.05), (1, 2.58), (0, 1.57), (1, 1.09), (1, 1.98), (1, 1.39), (1, 1.49), (1, 8.96), (0, 1.13), (1, 1.19), (1, 1.67), (0, 1.29), (1, 1.28), (1, 1.39), (1, 1.31), (1, 1.31), (1, 1.27), (0, 2.2), (0, 1.43), (1, 1.21), (1, 1.13), (0, 1.09), (1, 7.69), (1, 1.11), (1, 1.1), (1, 2.52), (1, 1.27), (1, 1.11), (1, 1.02), (1, 1.76), (0, 1.09), (1, 2.13), (0, 1.03), (0, 1.04), (1, 2.91), (1, 1.04), (1, 1.57), (1, 1.9), (1, 1.37), (1, 1.18), (1, 1.32), (1, 3.78)]


def feed_pairs(rule, pairs, world_size=2):
    engine = AlertEngine((rule,))
    engine.segment_started(world_size)
    fired = []
    for i, (rank, ratio) in enumerate(pairs, start=1):
        engine.observe(i, {"step_time_s": 1.0}, at=float(i))
        fired += engine.observe_ranks(i, {"straggler_rank": rank, "straggler_ratio": ratio}, at=float(i))
    return fired


@pytest.mark.parametrize(("name", "pairs", "world_size", "expected"), [
    # noise: whichever rank is slowest by 50% changes from step to step (the slowest rank's own ratio stays 1.5)
    ("the slowest rank alternates", [(i % 2, 1.5) for i in range(60)], 2, []),
    ("the slowest rank is random", [((i * 7) % 3 % 2, 1.6) for i in range(60)], 2, []),
    # slow from step 11: the window of 9 turns at its 6th slow step (16), then 8 in a row (persist)
    ("one rank 30% slower", [(1, 1.05)] * 10 + [(1, 1.3)] * 30, 2, [23]),
    ("one of 8 ranks 30% slower", [(i % 8, 1.1) for i in range(10)] + [(5, 1.3)] * 30, 8, [24]),
    ("one of 8 ranks sometimes slowest", [(i % 8, 1.4) for i in range(60)], 8, []),
])
def test_straggler_needs_the_same_rank_slow(name, pairs, world_size, expected):
    rule = next(r for r in DEFAULT_RULES if r.kind == "straggler")
    assert [a.step for a in feed_pairs(rule, pairs, world_size)] == expected, name


def test_measured_run_with_a_30pct_slower_rank_fires_after_the_slowdown():
    rule = next(r for r in DEFAULT_RULES if r.kind == "straggler")
    fired = feed_pairs(rule, MEASURED_30PCT)
    # In this run rank 1's excess fell to ~1.05 for 9 steps (26-34; the loaded machine): cleared, then fired again.
    assert [a.step for a in fired] == [25, 42] and all("rank 1" in a.message for a in fired), fired
    assert feed_pairs(rule, MEASURED_30PCT[:11]) == []  # the healthy part alone


def test_the_recorded_demo_run_raises_no_alert():
    """tests/fixtures/demo-run-events.jsonl: the workers' events of a real demo run (examples/tiny-cpu.yaml, 60 steps,
    checkpoints at 20/40/60 on 2 loaded cores; the fields the rules read). The rules before steady-state judging
    raised throughput_drop at steps 13, 29 and 58 and straggler at 40 on it; the flow's own windows (commit
    bookkeeping, evaluation) are not in the events, so this replay judges more steps than the flow did."""
    from pathlib import Path

    obs = MetricsObserver(DEFAULT_RULES, {})
    lines = (Path(__file__).parents[2] / "fixtures" / "demo-run-events.jsonl").read_text().splitlines()
    for line in lines:
        obs.rows(parse_event(json.loads(line)))
    assert obs.take_alerts() == []
    assert obs.engine.coverage["judged"] >= 40, obs.engine.coverage  # judged, not excused wholesale
