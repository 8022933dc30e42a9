"""Observability end to end: a real 2-worker job (train-job flow, torchrun, gloo) streams the new per-step metrics
(step-time split, peak memory per rank, MFU beside the plan's, rank min/median/max, CPU telemetry, checkpoint
stall) to MLflow; MFU equals model FLOPs over measured time and the calibrated peak; a profile window asked for
while the job runs (`trainforge profile`, the channel's `profile_window` command) leaves per-rank traces uploaded
into the job's store, `profile` events saying where, and the merged summary as run artifacts; the cost split adds
up to wall-clock x workers.

Run: .venv/bin/python -m pytest tests/integration/test_observability.py   (about 1 minute on 2 cores)
"""

from __future__ import annotations

import json
import math
import threading
import time

import pytest

from tests.integration.test_train_job import run_flow, small_spec
from trainforge.events import read_events
from trainforge.infra.cost import job_cost
from trainforge.registry.jobs import JobStore
from trainforge.registry.tracking import Tracker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NEW_METRICS = ("mfu", "mfu_predicted", "plan_attainment", "compute_s", "exposed_comm_s", "data_wait_s", "bubble_s",
               "optimizer_s", "peak_mem_bytes", "checkpoint_stall_s", "ranks/step_time_s_max",
               "ranks/step_time_s_median", "ranks/peak_mem_bytes_min", "ranks/straggler_rank",
               "system/cpu_percent", "system/workers_rss_peak_bytes")


def _request_profile(window: str, answers: list) -> None:
    """`trainforge profile JOB --steps a:b` as soon as the job's first segment runs (its workers are starting)."""
    from typer.testing import CliRunner

    from trainforge.cli import app

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        running = [r for r in JobStore().list()
                   if any(s.get("state") == "running" for s in r.data.get("segments", []))]
        if running:
            answers.append(CliRunner().invoke(app, ["profile", running[0].job_id, "--steps", window]))
            return
        time.sleep(0.1)
    answers.append(TimeoutError("no segment started within 300 s"))


def test_job_streams_observability_metrics(prefect_api, monkeypatch):
    from trainforge.datasets.demo import ensure_demo_dataset
    from trainforge.infra.storage import open_store

    ensure_demo_dataset()
    monkeypatch.delenv("TRAINFORGE_PROFILE_STEPS", raising=False)
    monkeypatch.setenv("TRAINFORGE_TELEMETRY_INTERVAL_S", "1")
    answers: list = []
    asker = threading.Thread(target=_request_profile, args=("8:9", answers), daemon=True)
    asker.start()
    result = run_flow(small_spec(max_steps=12))
    asker.join(10)
    [answer] = answers
    assert not isinstance(answer, Exception) and answer.exit_code == 0, answer
    assert result["state"] == "completed"
    record = JobStore().get(result["job_id"])
    events, _ = read_events(record.events_path)
    meta = next(e for e in events if e["type"] == "metrics_meta")
    steps = [e for e in events if e["type"] == "metrics"]
    assert len(steps) == 12
    for e in steps:  # MFU = model FLOPs x tokens / time / (world x peak); the split adds up to the step time
        tokens = 8 * 64
        expected = meta["flops_per_token"] * tokens / e["step_time_s"] / (meta["peak_flops"] * meta["world_size"])
        assert e["mfu"] == pytest.approx(expected, rel=1e-9)
        parts = sum(e[k] for k in ("data_wait_s", "compute_s", "exposed_comm_s", "bubble_s", "optimizer_s"))
        assert parts == pytest.approx(e["step_time_s"], rel=1e-6)
        assert e["peak_mem_bytes"] > 100e6  # RSS high-water of a torch worker
    assert meta["peak_source"] == "calibrated-cpu" and meta["peak_flops"] > 1e9
    ranks = [e for e in events if e["type"] == "rank_metrics"]
    assert {e["step"] for e in ranks} == set(range(1, 13))
    assert all(e["step_time_s_min"] <= e["step_time_s_median"] <= e["step_time_s_max"] for e in ranks)
    assert any(e["type"] == "system" and e["source"] == "cpu" for e in events)

    client = Tracker().client
    run = client.get_run(result["mlflow_run_id"])
    missing = [m for m in NEW_METRICS if m not in run.data.metrics]
    assert not missing, f"MLflow run lacks {missing}; has {sorted(run.data.metrics)}"
    history = client.get_metric_history(run.info.run_id, "mfu")
    assert len(history) == 12 and all(0 < m.value < 1.5 and math.isfinite(m.value) for m in history)

    # Each rank uploaded its trace into the job's store and said where in a `profile` event.
    config = json.loads((record.folder / "worker-config.json").read_text())
    store = open_store(config["storage_url"])
    profiles = sorted((e for e in events if e["type"] == "profile"), key=lambda e: e["rank"])
    assert [(e["rank"], e["start_step"], e["end_step"]) for e in profiles] == [(0, 8, 9), (1, 8, 9)]
    for e in profiles:
        assert e["trace"].startswith(config["storage_prefix"] + "/profiles/segment-0/")
        assert "traceEvents" in json.loads(store.get_bytes(e["trace"]))
    arts = Tracker().list_artifacts(run.info.run_id, "profiles")
    assert any(a.endswith("rank0.trace.json") for a in arts) and any(a.endswith("rank1.trace.json") for a in arts)
    assert any(a.endswith("summary.json") for a in arts)
    profile = record.data["profile"]
    assert profile["ranks"] == [0, 1] and set(profile["slowest_rank_per_step"]) == {"8", "9"}
    assert 0.0 <= profile["overlap_fraction_mean"] <= 1.0

    cost = job_cost(record.data, prices={"cpu": {"on_demand": 1.0, "spot": 0.4}})
    wall = sum(s["ended_at"] - s["started_at"] for s in record.data["segments"])
    assert cost.gpu_hours == pytest.approx(wall * 2 / 3600, rel=1e-6)
    split = cost.productive_hours + cost.idle_hours + cost.lost_hours + cost.failed_hours
    assert split == pytest.approx(cost.gpu_hours, rel=1e-6)

    # compare reads the run back from MLflow (same job twice: no config difference) and plots the curves
    from typer.testing import CliRunner

    from trainforge.cli import app

    png = record.folder / "compare.png"
    out = CliRunner().invoke(app, ["compare", record.job_id, record.job_id, "--json", "--plot", str(png)])
    assert out.exit_code == 0, out.output
    summary = json.loads(out.output)
    assert summary["config_diff"] == {}
    assert summary["metrics"][record.job_id]["mfu.median"] > 0
    assert png.stat().st_size > 10_000
