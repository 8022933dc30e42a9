"""Cancelling a job stops every worker within seconds, leaves no orphan processes, keeps the last committed
checkpoint, and `trainforge submit --resume JOB` continues the same job from it. Covers Ctrl-C on the CLI and a
cancel through the Prefect API (what the UI's Cancel button does).

Run: .venv/bin/python -m pytest tests/integration/test_cancel_resume.py   (about 3 minutes on 2 cores)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from trainforge.datasets.demo import ensure_demo_dataset
from trainforge.events import last_event, read_events
from trainforge.registry.jobs import JobStore

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS_CTRL_C = 48
INTERVAL = 8
# The first segment attempt only (the resume is submitted without it): rank 0 parks at the start of step 8 once the
# step-8 checkpoint is committed (trainer/faults.py `park`, `durable=1`) until the cancel's SIGTERM reaches it; its
# peer waits in the step's collective. Ctrl-C lands mid-training however slowly this test process notices the
# commit, no step before it is slowed, and the resume runs the rest at full speed. A park past PARK_S (the cancel
# never came) raises in rank 0 and fails the attempt: the test fails (exit code, or the attempt that was cancelled).
PARK_S = 60
PARK_FIRST_ATTEMPT = f"park:rank=0:step={INTERVAL}:durable=1:s={PARK_S}"
# A parked gang makes no step progress: the hang watchdog (15 s floor) and the collective timeout (30 s floor) would
# call it a hang before the cancel on a loaded machine. Both wait longer than the park for the first attempt only.
PARK_HEALTH = json.dumps({"hang_timeout_s": 2 * PARK_S, "collective_timeout_s": 2 * PARK_S})


def spec_file(tmp_path: Path, steps: int = 48) -> Path:
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    doc["training"].update({"max_steps": steps, "global_batch_size": 8, "seq_len": 64})
    doc["checkpoint"]["interval_steps"] = INTERVAL
    doc["evaluation"]["batches"] = 1
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def job_processes(job_id: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if job_id in proc.environ().get("TRAINFORGE_JOB_CONFIG", ""):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def committed_event(job_id: str):
    try:
        record = JobStore().get(job_id)
    except LookupError:
        return None
    return last_event(record.events_path, "checkpoint")


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "trainforge", *args]


@pytest.mark.timing
def test_ctrl_c_stops_every_worker_and_resume_continues(tmp_path, _isolated_home):
    ensure_demo_dataset()
    # Ctrl-C must land mid-training even when this test process is slow to notice the first commit on a loaded
    # machine (a 48-step job at full speed once finished first in CI): rank 0 of the first attempt parks after it.
    spec = spec_file(tmp_path, steps=STEPS_CTRL_C)
    env = {**os.environ, "TRAINFORGE_HOME": str(_isolated_home), "PREFECT_HOME": str(tmp_path / "prefect")}
    proc = subprocess.Popen(cli("submit", str(spec), "--json"),
                            env={**env, "TRAINFORGE_FAULT": PARK_FIRST_ATTEMPT, "TRAINFORGE_HEALTH": PARK_HEALTH},
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        job_id = wait_for(lambda: [r.job_id for r in JobStore().list()], 120, "the job record")[0]
        wait_for(lambda: committed_event(job_id), 180, "the first committed checkpoint")
        assert job_processes(job_id), "workers should be running"
        ended = last_event(JobStore().get(job_id).events_path, "segment_end")
        assert ended is None, f"training ended (step {ended and ended['step']}) before Ctrl-C could be sent"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        stopped_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    # Under --json the error is the JSON document on stdout (docs/cli.md): a script parses stdout
    error = json.loads(out[out.rindex('{\n  "error"'):])
    assert "cancelled" in error["error"] and error["exit_code"] == 130, out[-3000:]
    assert stopped_s < 30, f"took {stopped_s:.1f}s to stop"
    wait_for(lambda: not job_processes(job_id), 10, "no orphan worker processes")
    record = JobStore().get(job_id)
    assert record.data["state"] == "cancelled"
    # Ctrl-C met the parked first attempt: one segment, attempt 0 (a park that ran out would have failed it and
    # started a retry). Its state is the stop's, as with any SIGTERM the workers take as a notice.
    assert [seg["attempt"] for seg in record.data["segments"]] == [0], record.data["segments"]
    kept = last_event(record.events_path, "checkpoint")["step"]

    resumed = subprocess.run(cli("submit", "--resume", job_id, "--json"), env=env, capture_output=True,
                             text=True, timeout=420)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    record = JobStore().get(job_id)
    assert record.data["state"] == "completed"
    events, _ = read_events(record.events_path)
    starts = [e["resumed_from"] for e in events if e["type"] == "segment_start"]
    assert starts[-1] is not None and starts[-1] >= kept
    assert last_event(record.events_path, "segment_end")["step"] == STEPS_CTRL_C


def test_cancel_through_the_prefect_api_stops_the_gang(prefect_api, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    from trainforge.flows.train_job import train_job

    ensure_demo_dataset()
    spec = spec_file(tmp_path, steps=400)
    doc = yaml.safe_load(spec.read_text())
    outcome: dict[str, BaseException | dict] = {}

    def run() -> None:
        try:
            outcome["result"] = train_job(doc, str(spec), str(spec.parent), "tiny-cpu-api-cancel")
        except BaseException as exc:  # the flow ends cancelled: record what it raised
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    job_id = "tiny-cpu-api-cancel"
    wait_for(lambda: committed_event(job_id), 180, "the first committed checkpoint")
    flow_run_id = JobStore().get(job_id).data["flow_run_id"]
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, Cancelling(), force=True)
    t0 = time.monotonic()
    thread.join(timeout=60)
    assert not thread.is_alive(), "the flow did not stop after the cancel request"
    assert time.monotonic() - t0 < 30
    assert "error" in outcome
    wait_for(lambda: not job_processes(job_id), 10, "no orphan worker processes")
    assert JobStore().get(job_id).data["state"] == "cancelled"
