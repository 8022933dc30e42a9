"""prefect.yaml's deployments work against a real Prefect server with a process work pool and worker:
`prefect deploy --all` registers them, and `run_deployment` (what `prefect deployment run`, schedules,
`trainforge submit --deployment` and the SDK's `submit(..., backend="deployment")` use) trains a job to completion
through the worker, which clones the code with prefect.yaml's `git_clone` pull step (from a git snapshot of this
working tree). The train-job deployment's parameter schema is the JobSpec's (the UI's form, enforced by the
server), the flow run is named after the job id, and provisioning is its own task run.

Run: .venv/bin/python -m pytest tests/integration/test_deployment.py   (about 1.5 minutes on 2 cores)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from trainforge.datasets.demo import ensure_demo_dataset
from trainforge.infra.backends.local import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"prefect server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"prefect server not healthy after {timeout_s}s")


def _stop(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def git_snapshot(dest: Path) -> Path:
    """A git repository holding this working tree as one commit (tracked and untracked files, not the ignored
    ones): what the worker's `git_clone` pull step clones, so the test runs the code under test, committed or not."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = REPO / name
        if src.is_file() and not src.is_symlink():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.invalid", "-c", "commit.gpgsign=false"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "snapshot of the working tree"]):
        subprocess.run(git + args, cwd=dest, check=True, capture_output=True, timeout=60)
    return dest


def test_train_job_deployment_runs_through_a_process_worker(tmp_path, _isolated_home, monkeypatch):
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": api,
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "TRAINFORGE_REPO": str(REPO),
           "TRAINFORGE_GIT_URL": str(git_snapshot(tmp_path / "trainforge-src")),
           "TRAINFORGE_HOME": str(_isolated_home)}
    server_log = (tmp_path / "server.log").open("wb")  # noqa: SIM115 - lives as long as the server
    worker_log = (tmp_path / "worker.log").open("wb")  # noqa: SIM115
    server = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                              env=env, stdout=server_log, stderr=subprocess.STDOUT)
    worker = None
    try:
        _wait_healthy(api, server, 90)
        subprocess.run([str(BIN / "prefect"), "work-pool", "create", "trainforge", "--type", "process"], env=env,
                       cwd=REPO, check=True, capture_output=True, timeout=60)
        deployed = subprocess.run([str(BIN / "prefect"), "--no-prompt", "deploy", "--all"], env=env, cwd=REPO,
                                  capture_output=True, text=True, timeout=120)
        assert deployed.returncode == 0, deployed.stdout[-2000:] + deployed.stderr[-2000:]
        worker = subprocess.Popen([str(BIN / "prefect"), "worker", "start", "--pool", "trainforge"], env=env,
                                  cwd=tmp_path, stdout=worker_log, stderr=subprocess.STDOUT)
        ensure_demo_dataset()
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        from prefect.settings import PREFECT_API_URL, temporary_settings

        from trainforge import submit

        # Another test's session-wide Prefect harness may hold the API URL in a settings context: override it.
        # The SDK's deployment backend: `run_deployment` with the job id chosen here, then the job is followed.
        with temporary_settings(updates={PREFECT_API_URL: api}):
            job = submit(REPO / "examples" / "tiny-cpu.yaml", backend="deployment", detach=True, overrides={
                "training.max_steps": 8, "training.global_batch_size": 8, "training.seq_len": 64,
                "checkpoint.interval_steps": 4})
            state = job.wait(timeout=420)
        assert state == "completed", f"{job.error}\n{(tmp_path / 'worker.log').read_text()[-3000:]}"
        jobs = list((_isolated_home / "jobs").glob("tiny-cpu-*/job.json"))
        assert len(jobs) == 1
        record = yaml.safe_load(jobs[0].read_text())
        assert record["job_id"] == job.id and record["state"] == "completed"
        assert record["flow_run_id"] == job.flow_run_id and record["spec"]["training"]["max_steps"] == 8
        worker_said = (tmp_path / "worker.log").read_text()
        assert "git_clone" in worker_said, worker_said[-3000:]  # the pull step ran

        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        with temporary_settings(updates={PREFECT_API_URL: api}), get_client(sync_client=True) as client:
            deployment = client.read_deployment_by_name("train-job/train-job")
            run = client.read_flow_run(job.flow_run_id)
            tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
        schema = deployment.parameter_openapi_schema
        assert schema["properties"]["spec"]["$ref"] == "#/definitions/JobSpec"  # the UI renders the spec's form
        assert {"name", "team", "training", "resources"} <= set(schema["definitions"]["JobSpec"]["properties"])
        assert deployment.enforce_parameter_schema
        assert run.name == job.id  # the flow run is named after the job
        assert any(t.name.startswith("provision-gang") for t in tasks), [t.name for t in tasks]
    finally:
        if worker is not None:
            _stop(worker, signal.SIGINT)  # a worker ignores SIGTERM once its server is gone: stop it first
        _stop(server, signal.SIGTERM)
        server_log.close()
        worker_log.close()
