"""The SDK drives a job end to end: `submit` (with overrides) runs the flow here, then `wait`, `metrics` and
`logs` read the job back; a detached job runs in a background process that `cancel` stops, workers and all.

Run: .venv/bin/python -m pytest tests/integration/test_sdk.py   (about a minute on 2 cores)
"""

from __future__ import annotations

import pytest

from tests.integration.test_cancel_resume import job_processes, wait_for
from tests.specs.cases import EXAMPLES, build_demo_dataset

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# The tiny CPU spec, shortened by overrides (what `--set` does on the command line).
SMALL = {"training.max_steps": 6, "training.global_batch_size": 8, "training.seq_len": 64,
         "checkpoint.interval_steps": 3, "evaluation.batches": 1}


def test_submit_waits_and_reads_metrics_and_logs(prefect_api):
    from trainforge import get_job, submit

    build_demo_dataset()
    job = submit(EXAMPLES / "tiny-cpu.yaml", overrides=SMALL)
    assert job.wait(timeout=5) == "completed", job.error
    assert job.status == "completed" and job.error is None
    steps = [m.step for m in job.metrics()]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert all(m.loss is not None and m.loss > 0 for m in job.metrics())
    assert job.result["checkpoints"] == [3, 6] and job.result["model"]["step"] in (3, 6)
    both = job.logs()
    assert "[rank 0] " in both and "[rank 1] " in both, both[-2000:]
    rank1 = job.logs(rank=1)
    assert rank1 and "[rank" not in rank1
    again = get_job(job.id)  # another handle, from the id alone: the same job
    assert again.status == "completed" and [m.step for m in again.metrics()] == steps


def test_cancel_stops_a_detached_job(prefect_api):
    from trainforge import get_job, submit
    from trainforge.sdk import _kill_tree

    build_demo_dataset()
    job = submit(EXAMPLES / "tiny-cpu.yaml", detach=True, overrides={**SMALL, "training.max_steps": 400})
    info = job._process()
    try:
        assert job.status in ("pending", "running")
        wait_for(lambda: job_processes(job.id), 240, "the detached job's workers")
        assert get_job(job.id).cancel(timeout=60) == "cancelled", job.error
        wait_for(lambda: not job_processes(job.id), 10, "no orphan worker processes")
        # The controller ends too, and nothing retried the segment the cancel stopped (it did, in a task-runner
        # thread the exiting interpreter then waited for, training on with nobody to stop it).
        wait_for(lambda: not job._controller_alive(info), 60, "the detached controller's exit")
        assert not job_processes(job.id)
        assert job.status == "cancelled"
        segments = job.record().data["segments"]
        assert segments[-1]["state"] == "cancelled" and all(s["state"] != "running" for s in segments), segments
        assert not job.metrics() or job.metrics()[-1].step < 400
    finally:  # a failed assertion must not leave the background job running past this test's Prefect server
        if job._controller_alive(info):
            _kill_tree(info["pid"])
