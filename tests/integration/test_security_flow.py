"""Security, end to end: a job runs with a secret from the file-backed store. The value reaches the workers'
environment (read from /proc while they run) and nothing else: every file under $TRAINFORGE_HOME (job record,
events, rank logs, checkpoints + manifests, safetensors export, MLflow database and artifacts, lineage database)
and the Prefect database (parameters, task runs, logs) is scanned for it — zero hits — and a log line that
quotes it is redacted. Tenant isolation: a job's scoped handle cannot read or overwrite another team's prefix
(local store; and on the real S3 server with separate per-job identities), and the job record carries the per-job
IAM policy limited to its own prefix.

Run: .venv/bin/python -m pytest tests/integration/test_security_flow.py   (one flow run, about 1 minute)
"""

from __future__ import annotations

import logging
import os
import secrets as pysecrets
import threading
from pathlib import Path

import pytest

from tests.integration.test_train_job import run_flow, small_spec
from trainforge.datasets.demo import ensure_demo_dataset
from trainforge.home import home
from trainforge.infra.storage import LocalObjectStore, PermissionDeniedError, job_prefix
from trainforge.registry.jobs import JobStore
from trainforge.registry.secrets import FileSecretStore, SecretNotFound

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def worker_envs(stop: threading.Event, job_id: str, seen: list[bytes]) -> None:
    """Sample the environment of this job's worker processes while they run."""
    marker = f"/jobs/{job_id}/worker-config.json".encode()
    while not stop.is_set():
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) == os.getpid():
                continue
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes()
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if marker in env and b"trainforge.trainer" in cmd:
                seen.append(env)
        stop.wait(0.3)


def files_containing(root: Path, needle: bytes, skip: Path | None = None) -> list[str]:
    hits = []
    for path in root.rglob("*"):
        if path.is_file() and (skip is None or skip not in path.parents):
            try:
                if needle in path.read_bytes():
                    hits.append(str(path))
            except OSError:
                continue
    return hits


def test_secret_reaches_workers_only(prefect_api):
    import prefect.settings

    ensure_demo_dataset()
    value = "tfsecret-" + pysecrets.token_hex(12)
    FileSecretStore().put("demo/api-token", value)
    doc = small_spec(max_steps=16)
    doc["secrets"] = [{"name": "demo/api-token", "env": "DEMO_API_TOKEN"}]
    job_id = "sec-" + pysecrets.token_hex(3)
    stop, seen = threading.Event(), []
    sampler = threading.Thread(target=worker_envs, args=(stop, job_id, seen), daemon=True)
    sampler.start()
    try:
        result = run_flow(doc, job_id=job_id)
    finally:
        stop.set()
        sampler.join(timeout=5)
    assert result["state"] == "completed"

    # injected into the workers' environment, and only there
    assert seen, "no worker process of the job was observed"
    assert all(f"DEMO_API_TOKEN={value}".encode() in env for env in seen)
    assert value not in os.environ.values()

    # something quoting the secret in the control plane's logs is redacted
    log_file = home() / "control-plane.log"
    handler = logging.FileHandler(log_file)
    logging.getLogger().addHandler(handler)
    try:
        logging.getLogger("trainforge.flows").error("upstream refused token %s", value)
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    assert "***demo/api-token***" in log_file.read_text()

    # the value is nowhere: record, events, logs, checkpoints, manifests, export, MLflow, lineage, Prefect DB
    needle = value.encode()
    assert files_containing(home(), needle, skip=home() / "secrets") == []
    db_url = prefect.settings.PREFECT_SERVER_DATABASE_CONNECTION_URL.value()
    prefect_db = Path(db_url.split("///", 1)[1])
    assert prefect_db.is_file()
    assert files_containing(prefect_db.parent, needle) == []
    assert files_containing(Path(os.environ["PREFECT_HOME"]), needle) == []

    # the record names the secret, never its value, and carries the job's IAM policy
    record = JobStore().get(job_id).data
    assert record["spec"]["secrets"] == [{"name": "demo/api-token", "env": "DEMO_API_TOKEN"}]
    statements = record["iam"]["policy"]["Statement"]
    prefix = job_prefix("demo", job_id)
    assert statements[0]["Resource"] == [f"arn:aws:s3:::BUCKET/{prefix}/*"]
    assert statements[1]["Condition"]["StringLike"]["s3:prefix"] == [f"{prefix}/", f"{prefix}/*"]


def test_missing_secret_fails_before_anything_starts(prefect_api):
    ensure_demo_dataset()
    doc = small_spec()
    doc["secrets"] = [{"name": "demo/absent", "env": "ABSENT_TOKEN"}]
    with pytest.raises(SecretNotFound, match="demo/absent"):
        run_flow(doc, job_id="sec-missing")
    assert not (JobStore().root / "sec-missing").exists()


def test_scoped_handle_cannot_cross_teams(tmp_path):
    root = LocalObjectStore(tmp_path / "store")
    theirs = job_prefix("vision", "job-b")
    root.put_bytes(f"{theirs}/checkpoints/step-0000000008/manifest.json", b"{}")
    mine = root.scoped(job_prefix("nlp", "job-a"))
    for attempt in (lambda: mine.get_bytes(f"{theirs}/checkpoints/step-0000000008/manifest.json"),
                    lambda: mine.put_bytes(f"{theirs}/checkpoints/step-0000000008/manifest.json", b"x"),
                    lambda: mine.delete(f"{theirs}/checkpoints/step-0000000008/manifest.json"),
                    lambda: mine.list("teams/vision/"),
                    lambda: mine.scoped("teams/vision")):
        with pytest.raises(PermissionDeniedError):
            attempt()
    assert root.get_bytes(f"{theirs}/checkpoints/step-0000000008/manifest.json") == b"{}"


def test_s3_identity_cannot_cross_teams(s3_server):
    """Separate server identities per job (as production's per-job IAM credentials): team nlp's job cannot read
    or overwrite team vision's checkpoints, and vice versa; the refusals come from the server."""
    bucket = s3_server.make_bucket()
    try:
        admin = s3_server.store(bucket, "platform")
        a, b = job_prefix("nlp", "job-a"), job_prefix("vision", "job-b")
        job_a = admin.with_credentials(*s3_server.add_job_identity(bucket, "nlp", "job-a", root="platform"))
        job_b = admin.with_credentials(*s3_server.add_job_identity(bucket, "vision", "job-b", root="platform"))
        job_a.put_bytes(f"{a}/checkpoints/step-0000000001/manifest.json", b"a")
        job_b.put_bytes(f"{b}/checkpoints/step-0000000001/manifest.json", b"b")
        for job, other in ((job_a, b), (job_b, a)):
            for attempt in (lambda j=job, o=other: j.get_bytes(f"{o}/checkpoints/step-0000000001/manifest.json"),
                            lambda j=job, o=other: j.put_bytes(f"{o}/checkpoints/step-0000000001/manifest.json",
                                                               b"overwrite"),
                            lambda j=job, o=other: j.list(f"{o}/")):
                with pytest.raises(PermissionDeniedError):
                    attempt()
        assert admin.get_bytes(f"{b}/checkpoints/step-0000000001/manifest.json") == b"b"
        assert admin.get_bytes(f"{a}/checkpoints/step-0000000001/manifest.json") == b"a"
    finally:
        s3_server.delete_bucket(bucket)
