"""Checkpoints on a real S3 server (SeaweedFS on loopback): a whole job with TRAINFORGE_STORAGE_URL=s3://…,
workers on the per-job identity the flow has the server make at provision (and revoke at the end), whose own
model code tries to read, list and overwrite another team's checkpoint and is refused by the server (the
attempts recorded in the job record), a killed worker resumed from S3, evaluation and export read from S3,
retention and garbage collection on S3, `trainforge checkpoints JOB --verify`.

Run: .venv/bin/python -m pytest tests/integration/test_checkpoint_s3.py -q   (about 2 minutes on 2 cores)
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest
import yaml

from trainforge.datasets.demo import ensure_demo_dataset
from trainforge.events import read_events
from trainforge.infra.storage import open_store
from trainforge.infra.storage.layout import job_prefix
from trainforge.registry.jobs import JobStore
from trainforge.registry.manifest import list_committed, verify
from trainforge.registry.retention import RetentionPolicy
from trainforge.tasks.checkpoints import collect_garbage

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def small_spec() -> dict:
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    doc["training"].update({"max_steps": 24, "global_batch_size": 8, "seq_len": 64})
    doc["parallelism"]["micro_batch_size"] = 2
    doc["checkpoint"].update({"interval_steps": 8, "keep_last": 1})
    doc["evaluation"]["batches"] = 2
    return doc


ATTACK_MODEL = """
import json, os
from pathlib import Path

import boto3
from botocore.exceptions import ClientError

from trainforge.trainer.models.llama import build_model as reference


def build_model(config):
    # A colleague's model code, on rank 0 of the gang, once: with whatever credentials the platform handed this
    # process, read, list and overwrite another team's checkpoint through a boto3 client of its own.
    out = Path(__file__).with_name("attack.json")
    if os.environ.get("RANK") == "0" and not out.exists():
        bucket, key = os.environ["ATTACK_TARGET"].split("/", 1)
        s3 = boto3.client("s3")
        seen = {"access_key_id": os.environ.get("AWS_ACCESS_KEY_ID")}
        for name, call in (("read", lambda: s3.get_object(Bucket=bucket, Key=key)["Body"].read()),
                           ("overwrite", lambda: s3.put_object(Bucket=bucket, Key=key, Body=b"pwned")),
                           ("list", lambda: s3.list_objects_v2(Bucket=bucket, Prefix=key.rsplit("/", 1)[0])),
                           ("forge_command", lambda: s3.put_object(
                               Bucket=bucket, Key=os.environ["ATTACK_OWN_PREFIX"] + "/channel/segment-0/down/x.json",
                               Body=b"{}"))):
            try:
                call()
                seen[name] = "allowed"
            except ClientError as e:
                seen[name] = e.response["Error"]["Code"]
        out.write_text(json.dumps(seen))
    return reference(config)
"""


@pytest.fixture
def s3_job(s3_server, s3_env, monkeypatch):
    bucket = s3_server.make_bucket()
    job_id = "tiny-s3-" + str(int(time.time() * 1000) % 10**8)
    monkeypatch.setenv("TRAINFORGE_STORAGE_URL", f"s3://{bucket}/platform")
    # The flow has the server make the job's identity (nothing preset): the stack's setting, on the test server.
    monkeypatch.setenv("TRAINFORGE_JOB_CREDENTIALS", f"seaweedfs:{s3_server.config_path}")
    for name in ("TRAINFORGE_JOB_S3_ACCESS_KEY_ID", "TRAINFORGE_JOB_S3_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    yield bucket, job_id
    s3_server.delete_bucket(bucket)


def test_job_on_s3_with_job_credentials_resumes_from_s3(prefect_api, s3_server, s3_job, monkeypatch, tmp_path):
    from trainforge.flows.train_job import train_job

    bucket, job_id = s3_job
    ensure_demo_dataset()
    admin = open_store(f"s3://{bucket}/platform")
    victim = f"{job_prefix('vision', 'their-job')}/checkpoints/step-0000000008/manifest.json"
    admin.put_bytes(victim, b"their checkpoint")
    (tmp_path / "attack_model.py").write_text(ATTACK_MODEL)
    monkeypatch.setenv("ATTACK_TARGET", f"{bucket}/platform/{victim}")
    monkeypatch.setenv("ATTACK_OWN_PREFIX", f"platform/{job_prefix('demo', job_id)}")
    # durable=1: the kill comes once its checkpoints in flight are committed, however slow the uploads run here
    monkeypatch.setenv("TRAINFORGE_FAULT", "kill:rank=1:step=21:durable=1")
    doc = copy.deepcopy(small_spec())
    doc["code"] = {"entrypoint": "attack_model:build_model", "repo": str(tmp_path)}
    result = train_job(doc, "s3-spec.yaml", str(EXAMPLES), job_id, False)
    assert result["state"] == "completed"
    record = JobStore().get(job_id)

    # The server refused the job's own code, with the job's own identity (not the platform's keys), and the
    # other team's checkpoint is untouched; the job's commands cannot be forged from inside the job.
    seen = json.loads((tmp_path / "attack.json").read_text())
    job_key = seen.pop("access_key_id")
    assert job_key.startswith("TFJOB") and job_key != s3_server.access_key
    assert seen == {"read": "AccessDenied", "overwrite": "AccessDenied", "list": "AccessDenied",
                    "forge_command": "AccessDenied"}
    assert admin.get_bytes(victim) == b"their checkpoint"
    # ... and the attempts are in the job record, as the store refused them.
    denied = {(e["operation"], e["key"]) for e in record.data["security"]}
    assert {("GetObject", f"platform/{victim}"), ("PutObject", f"platform/{victim}")} <= denied
    assert any(op == "ListObjectsV2" for op, _ in denied) and all(e["rank"] == 0 for e in record.data["security"])
    # The record names the identity and its grant, never a key; the identity is revoked now that the job ended.
    creds = record.data["iam"]["credentials"]
    assert creds["isolation"] == "seaweedfs" and creds["identity"] == f"job-demo-{job_id}"
    from trainforge.home import home

    assert [p for p in home().rglob("*") if p.is_file() and job_key.encode() in p.read_bytes()] == []
    entry = next(i for i in s3_server.identities().read() if i["name"] == creds["identity"])
    assert entry["actions"] == [] and entry["credentials"][0]["accessKey"] == job_key
    assert [s["state"] for s in record.data["segments"]] == ["failed", "completed"]
    events, _ = read_events(record.events_path)
    starts = [i for i, e in enumerate(events) if e["type"] == "segment_start"]
    assert len(starts) == 2 and events[starts[0]]["resumed_from"] is None
    # The resume read back, from S3, the newest checkpoint committed before the kill (step 16 once rank 1's
    # shards of it are durable; step 8 if rank 0's commit of 16 was still in flight when the gang stopped).
    committed_before = [e["step"] for e in events[: starts[1]] if e["type"] == "checkpoint"]
    assert committed_before and events[starts[1]]["resumed_from"] == max(committed_before) >= 8
    assert all("eval_loss" in c for c in record.data["checkpoints"].values())  # evaluation read from S3

    prefix = job_prefix("demo", job_id)
    keys = admin.list(prefix + "/")
    assert any(k.endswith("/manifest.json") for k in keys)
    assert any("/chunks/" in k for k in keys)
    refs = list_committed(admin, prefix)
    # keep_last=1 + the promoted (best) one; the newest is never deleted.
    assert refs[-1].step == 24 and len(refs) <= 2
    for ref in refs:
        assert verify(admin, ref) == []
        assert ref.manifest["dedup"]["bytes_logical"] > 0
    assert not (JobStore().root.parent / "store" / prefix).exists()  # nothing went to the local default store

    # CLI: list with status, verify every byte.
    from typer.testing import CliRunner

    from trainforge.cli import app

    out = CliRunner().invoke(app, ["checkpoints", job_id, "--verify", "--json"])
    assert out.exit_code == 0, out.output
    rows = json.loads(out.output)
    assert {r["step"] for r in rows if r["status"] == "committed"} == {r.step for r in refs}
    assert all(r.get("verified") for r in rows if r["status"] == "committed")

    # A flipped byte in a chunk of the newest checkpoint: --verify reports and quarantines it, exit 1.
    newest = refs[-1]
    sha = newest.files[0]["chunks"][0][0]
    key = next(k for k in admin.list(prefix + "/chunks/") if sha in k)
    data = bytearray(admin.get_bytes(key))
    data[0] ^= 0xFF
    admin.put_bytes(key, bytes(data))
    out = CliRunner().invoke(app, ["checkpoints", job_id, "--verify", "--json"])
    assert out.exit_code == 1
    assert [r.step for r in list_committed(admin, prefix)] == [r.step for r in refs[:-1]]


def test_gc_on_s3_never_deletes_newest_or_protected(s3_store):
    from trainforge.registry.dedup import ChunkWriter, UploadStats, chunk_key
    from trainforge.registry.manifest import step_prefix, write_manifest

    job = "teams/t/jobs/j"
    store = s3_store.scoped(job)
    shared = bytes(range(256)) * 4096
    for step in (1, 2, 3, 4):
        path = Path(f"/tmp/tf-gc-{id(store)}-{step}")
        path.write_bytes(shared + step.to_bytes(4, "little") * 50_000)
        entry = ChunkWriter(store, job).write_file(path, "__0_0.distcp", UploadStats())
        path.unlink()
        write_manifest(store, step_prefix(job, step), {"step": step, "files": [entry]})
    orphan = chunk_key(job, "ee" * 32, None)
    store.put_bytes(orphan, b"left by a crashed save")
    # Within the grace period nothing unreferenced goes.
    deleted = collect_garbage(store, job, RetentionPolicy(keep_last=1), protected=[2], grace_s=3600)
    assert sorted(deleted) == [1, 3] and store.exists(orphan)
    deleted = collect_garbage(store, job, RetentionPolicy(keep_last=1), protected=[2], grace_s=0,
                              now=time.time() + 5)
    assert deleted == [] and not store.exists(orphan)
    assert [r.step for r in list_committed(store, job)] == [2, 4]
    for ref in list_committed(store, job):
        assert verify(store, ref) == []
