"""Security, end to end: a job runs with a secret from the file-backed store, and its model code prints and logs
it (value, base64, URL encoding) on every rank. The value reaches the workers' environment and nothing else:
every file under $TRAINFORGE_HOME (job record, events, rank and agent logs, checkpoints + manifests, safetensors
export, MLflow database and artifacts, lineage database) and the Prefect database (parameters, task runs, logs)
is scanned for each spelling — zero hits — and a log line that quotes it is redacted. Tenant isolation: a job's scoped handle cannot read or overwrite another team's prefix
(local store; and on the real S3 server with separate per-job identities), and the job record carries the per-job
IAM policy limited to its own prefix.

Run: .venv/bin/python -m pytest tests/integration/test_security_flow.py   (one flow run, about 1 minute)
"""

from __future__ import annotations

import logging
import os
import secrets as pysecrets
from pathlib import Path

import pytest

from tests.integration.test_train_job import run_flow, small_spec
from trainforge.datasets.demo import ensure_demo_dataset
from trainforge.home import home
from trainforge.infra.storage import LocalObjectStore, PermissionDeniedError, job_prefix
from trainforge.registry.jobs import JobStore
from trainforge.registry.secrets import FileSecretStore, SecretNotFound

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


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


PROBE_MODEL = """
import base64, hashlib, logging, os, sys
from pathlib import Path
from urllib.parse import quote
from trainforge.trainer.models.llama import build_model as reference


def build_model(config):
    # Runs in every worker: record a digest of the injected secret (never the secret itself) and the rank.
    token = os.environ.get("DEMO_API_TOKEN", "")
    digest = hashlib.sha256(token.encode()).hexdigest()
    if "RANK" in os.environ:  # workers only; evaluation and export build the model outside the gang
        Path(__file__).with_name("probe-rank" + os.environ["RANK"]).write_text(digest)
        # ... and leak it every everyday way: the platform's captured streams must mask each one.
        print("debug: token is", token, "b64", base64.b64encode(token.encode()).decode(), "url",
              quote(token, safe=""), flush=True)
        print("S3 secret", os.environ.get("AWS_SECRET_ACCESS_KEY", ""), file=sys.stderr, flush=True)
        logging.getLogger("user.model").warning("calling the API with %s", token)
    return reference(config)
"""


def test_secret_reaches_workers_only(prefect_api, tmp_path):
    import hashlib

    import prefect.settings

    ensure_demo_dataset()
    value = "tfsecret-" + pysecrets.token_hex(12)
    FileSecretStore().put("demo/api-token", value)
    (tmp_path / "probe_model.py").write_text(PROBE_MODEL)
    doc = small_spec(max_steps=16)
    doc["code"] = {"entrypoint": "probe_model:build_model", "repo": str(tmp_path)}
    doc["secrets"] = [{"name": "demo/api-token", "env": "DEMO_API_TOKEN"}]
    job_id = "sec-" + pysecrets.token_hex(3)
    result = run_flow(doc, job_id=job_id)
    assert result["state"] == "completed"

    # injected into the workers' environment (both ranks saw it), and only there
    digest = hashlib.sha256(value.encode()).hexdigest()
    probes = sorted(tmp_path.glob("probe-rank*"))
    assert [p.name for p in probes] == ["probe-rank0", "probe-rank1"]
    assert all(p.read_text() == digest for p in probes)
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

    # the value is nowhere, in none of its spellings, though the model code printed and logged it on every rank:
    # record, events, rank logs, agent logs, checkpoints, manifests, export, MLflow, lineage, Prefect DB
    import base64
    from urllib.parse import quote

    logs = "".join(p.read_text(errors="replace") for p in (home() / "jobs" / job_id / "logs").rglob("*")
                   if p.is_file())
    assert "debug: token is ***DEMO_API_TOKEN***" in logs  # the line is kept, the value masked
    prefect_db = Path(prefect.settings.PREFECT_SERVER_DATABASE_CONNECTION_URL.value().split("///", 1)[1])
    assert prefect_db.is_file()
    for form in (value, base64.b64encode(value.encode()).decode(), quote(value, safe="")):
        needle = form.encode()
        assert files_containing(home(), needle, skip=home() / "secrets") == [], form
        assert files_containing(prefect_db.parent, needle) == [], form
        assert files_containing(Path(os.environ["PREFECT_HOME"]), needle) == [], form

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
