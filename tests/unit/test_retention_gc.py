"""Retention: the pure policy (table-driven) and garbage collection over a store (local folder here; the S3
server variant is in tests/integration/test_checkpoint_s3.py). Never deleted: the newest intact checkpoint,
protected steps, young unreferenced chunks (an in-flight save).

Run: .venv/bin/python -m pytest tests/unit/test_retention_gc.py -q
"""

from __future__ import annotations

import os
import time

import pytest

from trainforge.infra.storage import LocalObjectStore
from trainforge.registry.dedup import ChunkWriter, UploadStats, chunk_key
from trainforge.registry.manifest import list_committed, quarantine, step_prefix, write_manifest
from trainforge.registry.retention import RetentionPolicy, steps_to_keep
from trainforge.tasks.checkpoints import checkpoint_status, collect_garbage

JOB = "teams/t/jobs/j"


@pytest.mark.parametrize(("policy", "metrics", "protected", "expected"), [
    (RetentionPolicy(keep_last=2), {1: {}, 2: {}, 3: {}, 4: {}}, [], {3, 4}),
    (RetentionPolicy(keep_last=0), {1: {}, 2: {}}, [], {2}),  # the newest always stays
    (RetentionPolicy(keep_last=1), {1: {}, 2: {}, 3: {}}, [1], {1, 3}),
    (RetentionPolicy(keep_last=1, keep_every=2), {1: {}, 2: {}, 3: {}, 4: {}, 5: {}}, [], {2, 4, 5}),
    (RetentionPolicy(keep_last=1, keep_best_metric="eval_loss"),
     {1: {"eval_loss": 0.5}, 2: {"eval_loss": 0.9}, 3: {"eval_loss": float("nan")}}, [], {1, 3}),
    (RetentionPolicy(keep_last=1, keep_best_metric="acc", keep_best_mode="max", keep_best_count=2),
     {1: {"acc": 0.1}, 2: {"acc": 0.9}, 3: {"acc": 0.5}, 4: {}}, [], {2, 3, 4}),
    (RetentionPolicy(), {}, [7], set()),
])
def test_policy(policy, metrics, protected, expected):
    assert steps_to_keep(policy, metrics, protected) == expected


def make_checkpoints(store, tmp_path, steps, shared: bytes):
    writer = ChunkWriter(store, JOB)
    for step in steps:
        f = tmp_path / f"f{step}"
        f.write_bytes(shared + os.urandom(300_000))
        entry = writer.write_file(f, "__0_0.distcp", UploadStats())
        write_manifest(store, step_prefix(JOB, step), {"step": step, "files": [entry],
                                                       "metrics": {"train_loss": 1.0 / step}})
        writer.known = set()  # every checkpoint writes its own chunks (plus the shared ones)


def gc_store(store):
    return collect_garbage(store, JOB, RetentionPolicy(keep_last=1), protected=[2], grace_s=60, now=time.time() + 3600)


def test_gc_keeps_newest_and_protected_and_deletes_unreferenced_chunks(tmp_path):
    store = LocalObjectStore(tmp_path / "s").scoped(JOB)
    shared = os.urandom(1 << 20)
    make_checkpoints(store, tmp_path, [1, 2, 3, 4], shared)
    orphan = chunk_key(JOB, "ab" * 32, None)  # a crashed save's chunk
    store.put_bytes(orphan, b"x")
    store.put_bytes(f"{step_prefix(JOB, 5)}/__0_0.distcp", b"leftover")  # uncommitted folder
    deleted = gc_store(store)
    assert sorted(deleted) == [1, 3]
    assert [r.step for r in list_committed(store, JOB)] == [2, 4]
    assert not store.exists(orphan)
    assert not store.exists(f"{step_prefix(JOB, 5)}/__0_0.distcp")
    from trainforge.registry.manifest import verify

    for ref in list_committed(store, JOB):
        assert verify(store, ref) == []  # nothing the survivors reference was collected


def test_gc_spares_young_unreferenced_objects(tmp_path):
    store = LocalObjectStore(tmp_path / "s").scoped(JOB)
    make_checkpoints(store, tmp_path, [1], b"")
    young = chunk_key(JOB, "cd" * 32, None)
    store.put_bytes(young, b"in flight")
    store.put_bytes(f"{step_prefix(JOB, 2)}/__0_0.distcp", b"in flight")
    collect_garbage(store, JOB, RetentionPolicy(keep_last=1), protected=[], grace_s=600)
    assert store.exists(young) and store.exists(f"{step_prefix(JOB, 2)}/__0_0.distcp")
    rows = checkpoint_status(store, JOB, set())
    assert [(r["step"], r["status"]) for r in rows] == [(1, "committed"), (2, "in flight")]


def test_quarantined_newest_is_not_what_gc_protects(tmp_path):
    store = LocalObjectStore(tmp_path / "s").scoped(JOB)
    make_checkpoints(store, tmp_path, [1, 2, 3], b"")
    quarantine(store, list_committed(store, JOB)[-1], ["__0_0.distcp: sha256 mismatch"])
    deleted = collect_garbage(store, JOB, RetentionPolicy(keep_last=1), protected=[], grace_s=0,
                              now=time.time() + 10)
    assert sorted(deleted) == [1, 3]  # the corrupt newest goes; the newest intact one stays
    assert [r.step for r in list_committed(store, JOB)] == [2]
    rows = checkpoint_status(store, JOB, set(), verify_files=True)
    assert [(r["step"], r["status"], r.get("verified")) for r in rows] == [(2, "committed", True)]
