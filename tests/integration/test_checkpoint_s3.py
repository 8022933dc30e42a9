"""Checkpoints on a real S3 server (SeaweedFS on loopback): a whole job with TRAINFORGE_STORAGE_URL=s3://…,
workers on per-job credentials, a killed worker resumed from S3, evaluation and export read from S3, retention
and garbage collection on S3, `trainforge checkpoints JOB --verify`.

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
from trainforge.infra.storage import PermissionDeniedError, open_store
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


@pytest.fixture
def s3_job(s3_server, s3_env, monkeypatch):
    bucket = s3_server.make_bucket()
    job_id = "tiny-s3-" + str(int(time.time() * 1000) % 10**8)
    access, secret = s3_server.add_job_identity(bucket, "demo", job_id, root="platform")
    monkeypatch.setenv("TRAINFORGE_STORAGE_URL", f"s3://{bucket}/platform")
    monkeypatch.setenv("TRAINFORGE_JOB_S3_ACCESS_KEY_ID", access)
    monkeypatch.setenv("TRAINFORGE_JOB_S3_SECRET_ACCESS_KEY", secret)
    yield bucket, job_id
    s3_server.delete_bucket(bucket)


def test_job_on_s3_with_job_credentials_resumes_from_s3(prefect_api, s3_job, monkeypatch):
    from trainforge.flows.train_job import train_job

    bucket, job_id = s3_job
    ensure_demo_dataset()
    monkeypatch.setenv("TRAINFORGE_FAULT", "kill:rank=1:step=21")
    result = train_job(copy.deepcopy(small_spec()), "s3-spec.yaml", str(EXAMPLES), job_id, False)
    assert result["state"] == "completed"
    record = JobStore().get(job_id)
    assert [s["state"] for s in record.data["segments"]] == ["failed", "completed"]
    events, _ = read_events(record.events_path)
    starts = [i for i, e in enumerate(events) if e["type"] == "segment_start"]
    assert len(starts) == 2 and events[starts[0]]["resumed_from"] is None
    # The resume read back, from S3, the newest checkpoint committed before the kill (step 16 unless its
    # asynchronous upload was still in flight at step 21, then step 8).
    committed_before = [e["step"] for e in events[: starts[1]] if e["type"] == "checkpoint"]
    assert committed_before and events[starts[1]]["resumed_from"] == max(committed_before) >= 8
    assert all("eval_loss" in c for c in record.data["checkpoints"].values())  # evaluation read from S3

    admin = open_store(f"s3://{bucket}/platform")
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

    # The workers' handle: the job's own identity, scoped to its prefix; another job's prefix is refused by the
    # handle and, without the handle's scope, by the server itself.
    from trainforge.trainer.checkpoint import with_job_credentials

    other = job_prefix("demo", "someone-else")
    admin.put_bytes(f"{other}/checkpoints/secret.bin", b"not yours")
    unscoped = with_job_credentials(open_store(f"s3://{bucket}/platform"))
    worker = unscoped.scoped(prefix)
    assert worker.list(prefix + "/")
    with pytest.raises(PermissionDeniedError):
        worker.get_bytes(f"{other}/checkpoints/secret.bin")
    with pytest.raises(PermissionDeniedError):
        unscoped.get_bytes(f"{other}/checkpoints/secret.bin")  # server-side refusal (403)
    with pytest.raises(PermissionDeniedError):
        unscoped.put_bytes(f"{other}/checkpoints/evil.bin", b"x")

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
