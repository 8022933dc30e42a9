"""Alerts that mean something, on real jobs (train-job flow, 2 torchrun workers, gloo): the demo job as shipped
(examples/tiny-cpu.yaml: checkpoint uploads and evaluations sharing the cores with training) raises no alert while
most of its steps are judged, and one rank made 30% slower (its compute, from a step on: the `slow` fault with
`pct=30`) raises a `straggler` alert naming that rank.

Run: .venv/bin/python -m pytest tests/integration/test_alerts_flow.py   (about 3 minutes on 2 cores)
"""

from __future__ import annotations

import pytest
import yaml

from tests.integration.test_train_job import EXAMPLES, run_flow, small_spec
from trainforge.datasets.demo import ensure_demo_dataset
from trainforge.registry.alerts import DEFAULT_RULES
from trainforge.registry.jobs import JobStore

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.mark.timing
def test_the_demo_job_raises_no_alert(prefect_api, monkeypatch):
    ensure_demo_dataset()
    monkeypatch.delenv("TRAINFORGE_FAULT", raising=False)
    monkeypatch.delenv("TRAINFORGE_ALERT_RULES", raising=False)
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())  # the demo's spec, unchanged
    result = run_flow(doc)
    assert result["state"] == "completed"
    record = JobStore().get(result["job_id"])
    assert record.data.get("alerts", []) == [], record.data["alerts"]
    coverage = record.data["alert_coverage"]
    steps = doc["training"]["max_steps"]
    assert coverage["judged"] + coverage["excused"] == steps
    # The rules looked at the job: enough steady-state steps for the throughput rule to fire (on 2 loaded cores
    # the platform's windows, commit bookkeeping and evaluation included, cover most of the rest: 17 of 60 judged).
    rule = next(r for r in DEFAULT_RULES if r.kind == "throughput_drop")
    assert coverage["judged"] >= rule.window + rule.persist - 1, coverage


@pytest.mark.timing
def test_a_rank_30_percent_slower_raises_a_straggler_alert(prefect_api, monkeypatch):
    ensure_demo_dataset()
    monkeypatch.delenv("TRAINFORGE_ALERT_RULES", raising=False)
    monkeypatch.setenv("TRAINFORGE_FAULT", "slow:rank=1:step=10:pct=30")
    doc = small_spec(max_steps=60)
    doc["checkpoint"]["interval_steps"] = 60  # one checkpoint, at the end: the slow phase is steady state
    result = run_flow(doc, job_id="tiny-cpu-straggler")
    assert result["state"] == "completed"
    alerts = JobStore().get("tiny-cpu-straggler").data.get("alerts", [])
    stragglers = [a for a in alerts if a["kind"] == "straggler"]
    assert stragglers, alerts
    assert all(a["step"] > 10 and "rank 1" in a["message"] and a["value"] > 1.2 for a in stragglers), stragglers
