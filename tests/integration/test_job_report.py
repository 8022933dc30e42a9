"""The per-job HTML report of a real job: a 2-worker flow run whose rank 1 is killed at step 10 and resumes from
its last committed checkpoint. When the job ends the flow writes report.html into the job folder and logs it as
the MLflow run's artifact; the report draws the replayed steps as their own line, lists the failure and the recovery in its
timeline, and its cost equals the cost model's. A report that cannot be written never changes the job's outcome.

Run: .venv/bin/python -m pytest tests/integration/test_job_report.py -q   (about 1-2 minutes on 2 cores)
"""

from __future__ import annotations

import re

import pytest

from tests.integration.test_train_job import run_flow, small_spec
from trainforge.registry.jobs import JobStore
from trainforge.registry.tracking import Tracker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_report_of_a_job_that_failed_and_recovered(prefect_api, monkeypatch, tmp_path):
    from trainforge.datasets.demo import ensure_demo_dataset
    from trainforge.events import read_events, typed
    from trainforge.infra.cost import job_cost

    ensure_demo_dataset()
    monkeypatch.setenv("TRAINFORGE_FAULT", "kill:rank=1:step=10")
    result = run_flow(small_spec(max_steps=12), job_id="tiny-cpu-report")
    assert result["state"] == "completed"
    record = JobStore().get("tiny-cpu-report")
    assert [s["state"] for s in record.data["segments"]] == ["failed", "completed"]
    page = (record.folder / "report.html").read_text()

    # The artifact in MLflow is the same page.
    tracker = Tracker()
    assert "report.html" in tracker.list_artifacts(result["mlflow_run_id"])
    local = tracker.client.download_artifacts(result["mlflow_run_id"], "report.html", str(tmp_path))
    with open(local) as f:
        assert f.read() == page

    events, _ = read_events(record.events_path)
    runs: list[list[int]] = []  # metrics steps per launch of the gang, as the report splits them
    for e in events:
        if e["type"] == "segment_start":
            runs.append([])
            resumed = e["resumed_from"]  # 8, or None when the step-8 commit had not finished before the kill
        elif e["type"] == "metrics":
            runs[-1].append(e["step"])
    assert len(runs) == 2 and runs[1][0] == (resumed or 0) + 1 and runs[1][0] <= runs[0][-1]  # steps replayed
    for i, steps in enumerate(runs):  # each launch is its own line, with one vertex per step it ran
        path = re.search(rf'<g id="loss-train-{i}">\s*<path d="([^"]+)"', page)
        assert path and len(re.findall(r"[ML]", path.group(1))) == len(steps)
    if resumed:
        assert f"resumed from committed checkpoint {resumed}" in page
    for text in ("segment #0 failed", "fault: ", "recovered (segment retry)",
                 "id='chart-mfu'><svg", 'id="checkpoint-table"', "id='job-state'>completed<"):
        assert text in page, text
    cost = job_cost(record.data, typed(events))
    assert cost.lost_hours > 0  # the replayed steps
    assert f"<td>lost</td><td>{cost.lost_hours:.4f}</td>" in page
    assert f"<td>GPU-hours (allocated)</td><td>{cost.gpu_hours:.4f}</td>" in page


def test_a_failing_report_never_masks_the_outcome(prefect_api, monkeypatch):
    from prefect import flow

    import trainforge.registry.report as report
    from trainforge.flows.train_job import _end_tracking

    tracker = Tracker()
    run_id = tracker.start_run("demo", "no-such-job", {"x": 1}, {"trainforge.job_id": "no-such-job"})

    @flow
    def end() -> str:
        _end_tracking(run_id, "FINISHED")  # the job record is missing: the report fails, the run still closes
        return "ok"

    assert end() == "ok"
    assert tracker.client.get_run(run_id).info.status == "FINISHED"

    def broken(run_id: str) -> None:
        raise OSError("disk full")

    run_id = tracker.start_run("demo", "j2", {}, {"trainforge.job_id": "j2"})
    monkeypatch.setattr(report, "report_for_run", broken)
    assert end() == "ok"
    assert tracker.client.get_run(run_id).info.status == "FINISHED"

    import trainforge.registry.promotion as promotion
    from trainforge.registry.jobs import JobStore

    def broken_upload(*_args) -> None:
        raise OSError("artifact store down")

    record = JobStore().create("j3")
    run_id = tracker.start_run("demo", "j3", {}, {"trainforge.job_id": "j3"})
    monkeypatch.setattr(promotion, "link_run_artifacts", broken_upload)

    @flow
    def end_with_record() -> str:
        _end_tracking(run_id, "FAILED", record)  # the artifacts cannot be logged: the run still closes
        return "ok"

    assert end_with_record() == "ok"
    assert tracker.client.get_run(run_id).info.status == "FAILED"
