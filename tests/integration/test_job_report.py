"""A report that cannot be written never changes the job's outcome: the run still closes when the job record is
missing, when writing the report fails, and when the run's artifacts cannot be logged.

The report of a real job (a 2-worker flow run whose rank 1 is killed and resumes from its last committed
checkpoint: report.html in the job folder and as the MLflow run's artifact, the replayed steps as their own line,
the failure and the recovery in its timeline, its cost the cost model's) is checked on the killed-and-resumed job
tests/integration/test_train_job.py trains once for its resume test: test_report_of_a_job_that_failed_and_recovered.

Run: .venv/bin/python -m pytest tests/integration/test_job_report.py -q   (seconds: no job is trained)
"""

from __future__ import annotations

import pytest

from trainforge.registry.tracking import Tracker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


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
