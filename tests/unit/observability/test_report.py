"""The per-job HTML report from a job record and its events (pure rendering: no MLflow, no flow): charts per
segment (a replay after a failure is its own line), the timeline of segments, faults and recoveries, checkpoint
stalls, the cost split, secrets redacted, and the `trainforge report` command on a job folder.

Run: .venv/bin/python -m pytest tests/unit/observability/test_report.py -q
"""

from __future__ import annotations

import json
import re

import pytest

from trainforge.contract.events import SegmentEvent, dump_event, parse_event
from trainforge.infra.cost import job_cost
from trainforge.registry.report import (
    MAX_POINTS,
    checkpoint_rows,
    metric_series,
    render_html,
    thin,
    timeline_rows,
)


def job(state: str = "completed", gpu: str = "cpu", error: str | None = None) -> tuple[dict, list[SegmentEvent]]:
    """A 2-worker job whose first segment died at step 7 and was resumed from the step-4 checkpoint."""
    record = {
        "job_id": "demo-1", "team": "research", "state": state, "created_at": 1000.0, "completed_at": 1100.0,
        "spec": {"resources": {"gpu_type": gpu}, "training": {"max_steps": 10}},
        "plan": {"world_size": 2, "layout": {"dp": 2, "tp": 1}, "parameters": 3_000_000,
                 "predicted": {"mfu": 0.05}},
        "segments": [{"attempt": 0, "started_at": 1010.0, "ended_at": 1040.0, "state": "failed",
                      "error": "rank 1 was killed"},
                     {"attempt": 1, "started_at": 1045.0, "ended_at": 1090.0, "state": "completed"}],
        "checkpoints": {"4": {"bytes": 40e6, "eval_loss": 3.0, "committed_at": 1030.0},
                        "10": {"bytes": 40e6, "eval_loss": 2.5, "committed_at": 1085.0}},
        "alerts": [{"rule": "loss_spike", "step": 6, "message": "loss 9 > 2x median", "time": 1028.0}],
        **({"error": error} if error else {}),
    }
    events: list[dict] = [{"type": "segment_start", "step": 0, "world_size": 2, "resumed_from": None, "time": 1015.0},
                          {"type": "metrics_meta", "step": 0, "peak_flops": 1e11, "peak_source": "calibrated-cpu",
                           "flops_per_token": 1.8e7, "world_size": 2, "bubble_fraction": 0.0, "time": 1015.5}]
    t = 1016.0
    for step in range(1, 8):
        events.append(metric(step, t))
        t += 1.5
        if step == 4:
            events += [{"type": "checkpoint_staged", "step": 4, "blocked_s": 0.25, "time": t},
                       {"type": "checkpoint", "step": 4, "prefix": "checkpoints/step-4", "time": t + 2}]
    events += [{"type": "fault_detected", "fault": "rank_lost", "rank": 1, "step": 7, "message": "rank 1 exited",
                "action": "segment retry", "attempt": 0, "detected_at": 1039.0, "time": 1039.0},
               {"type": "segment_start", "step": 4, "world_size": 2, "resumed_from": 4, "time": 1050.0},
               {"type": "recovered", "fault": "rank_lost", "tier": "segment retry", "mttr_s": 11.0, "resumed_from": 4,
                "lost_steps": 3, "attempt": 1, "time": 1050.0}]
    t = 1051.0
    for step in range(5, 11):
        events.append(metric(step, t))
        t += 1.5
    events += [{"type": "checkpoint_staged", "step": 10, "blocked_s": 0.5, "time": t},
               {"type": "checkpoint", "step": 10, "prefix": "checkpoints/step-10", "time": t + 1},
               {"type": "segment_end", "step": 10, "reason": "finished", "time": t + 2}]
    return record, [parse_event(e) for e in events]


def metric(step: int, t: float) -> dict:
    return {"type": "metrics", "step": step, "time": t, "loss": 5.0 - 0.2 * step, "tokens_per_s": 1000.0 + step,
            "mfu": 0.04, "step_time_s": 1.0, "data_wait_s": 0.1, "compute_s": 0.6, "exposed_comm_s": 0.1,
            "bubble_s": 0.0, "optimizer_s": 0.2}


def line_points(page: str, gid: str) -> int:
    """Vertices of the SVG path matplotlib wrote for the line with this gid."""
    m = re.search(rf'<g id="{re.escape(gid)}">\s*<path d="([^"]+)"', page)
    assert m, f"no line {gid} in the report"
    return len(re.findall(r"[ML]", m.group(1)))


def test_replay_after_a_failure_is_its_own_line():
    record, events = job()
    loss = metric_series(events, "loss")
    assert [[s for s, _ in run] for run in loss.runs] == [list(range(1, 8)), list(range(5, 11))]
    assert [s for s, _ in loss.last_by_step()] == list(range(1, 11))
    page = render_html(record, events, now=2000.0)
    assert line_points(page, "loss-train-0") == 7 and line_points(page, "loss-train-1") == 6
    assert line_points(page, "throughput-0") == 7 and line_points(page, "mfu-0") == 7
    assert line_points(page, "loss-eval") == 2  # eval loss at the two committed checkpoints
    for name in ("loss", "throughput", "mfu", "split", "timeline"):
        assert f"id='chart-{name}'><svg" in page
    assert "<script" not in page  # a static page: MLflow's artifact viewer sandboxes it anyway


def test_timeline_orders_segments_faults_recoveries_and_alerts():
    record, events = job()
    rows = timeline_rows(record, events)
    assert [t for t, _, _ in rows] == sorted(t for t, _, _ in rows)
    what = [w for _, w, _ in rows]
    for a, b in [("submitted", "segment #0 launched"), ("alert: loss_spike", "fault: rank_lost"),
                 ("fault: rank_lost", "segment #0 failed"), ("segment #0 failed", "segment #1 launched"),
                 ("recovered (segment retry)", "training stopped"), ("segment #1 completed", "job completed")]:
        assert what.index(a) < what.index(b), (a, b, what)
    detail = dict((w, d) for _, w, d in rows)
    assert "3 step(s) recomputed" in detail["recovered (segment retry)"]
    assert "resumed from committed checkpoint 4" in [d for _, w, d in rows if w == "training started"][1]


def test_an_elastic_resize_is_on_the_timeline():
    record, events = job()
    events.insert(-6, parse_event({"type": "resize", "from_workers": 2, "to_workers": 4, "after_step": 4,
                                   "from_dp": 2, "to_dp": 4, "accumulation": [2, 1], "micro_batch_size": 2,
                                   "global_batch_size": 8, "reason": "the scheduler resized the allocation",
                                   "time": 1044.0}))
    rows = [(w, d) for _, w, d in timeline_rows(record, events)]
    assert ("resized", "2 -> 4 workers after step 4: the scheduler resized the allocation") in rows


def test_checkpoint_stalls_and_cost_match_the_cost_model():
    record, events = job()
    stalls = checkpoint_rows(record, events)
    assert [(r["step"], r["stall_s"], r["kept"]) for r in stalls] == [(4, 0.25, True), (10, 0.5, True)]
    assert stalls[0]["commit_after_s"] == pytest.approx(2.0)
    page = render_html(record, events, now=2000.0)
    assert "0.750 s over 2 checkpoint(s)" in page
    cost = job_cost(record, events, now=2000.0)  # the same typed events
    assert f"<td>total $</td><td>{cost.total_cost:.4f}</td>" in page
    assert f"<td>lost</td><td>{cost.lost_hours:.4f}</td>" in page and cost.lost_hours > 0


def test_unknown_gpu_price_and_failed_job_still_render(monkeypatch):
    from trainforge.registry import secrets

    monkeypatch.setitem(secrets._VALUES, "s3cr3t-value-123", "WANDB_KEY")  # as resolve_secrets registers it
    record, events = job(state="failed", gpu="tpu-v9", error="auth failed with s3cr3t-value-123")
    page = render_html(record, events, now=2000.0)
    assert "id='job-state'>failed<" in page
    assert "cost not available: no price for gpu type &#x27;tpu-v9&#x27;" in page
    assert "s3cr3t-value-123" not in page and "***WANDB_KEY***" in page


def test_a_job_with_no_steps_yet_renders():
    record = {"job_id": "j", "state": "running", "created_at": 1.0, "spec": {}, "plan": {}}
    page = render_html(record, [], now=5.0)
    assert "id='chart-loss-missing'" in page and "<svg" not in page


def test_long_series_are_thinned_keeping_the_end():
    points = [(s, float(s)) for s in range(1, 100_001)]
    kept = thin(points)
    assert len(kept) <= MAX_POINTS + 1 and kept[0] == points[0] and kept[-1] == points[-1]
    assert thin(points[:10]) == points[:10]


def test_report_command_writes_the_job_folder_and_out(tmp_path):
    from typer.testing import CliRunner

    from trainforge.cli import app
    from trainforge.registry.jobs import JobStore

    record, events = job()
    stored = JobStore().create("demo-1", **{k: v for k, v in record.items() if k not in ("job_id",)})
    stored.events_path.write_text("".join(json.dumps(dump_event(e)) + "\n" for e in events))
    out = tmp_path / "r" / "demo.html"
    result = CliRunner().invoke(app, ["report", "demo-1", "--out", str(out), "--no-mlflow"])
    assert result.exit_code == 0, result.output
    assert (stored.folder / "report.html").read_text() == out.read_text()
    assert line_points(out.read_text(), "loss-train-1") == 6
    result = CliRunner().invoke(app, ["report", "no-such-job"])
    assert result.exit_code == 1 and "no job 'no-such-job'" in result.output
