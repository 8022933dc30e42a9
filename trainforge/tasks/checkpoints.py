"""Control-plane work on committed checkpoints: bookkeeping, retention and garbage collection, status.

Reading a job's committed checkpoints (its store, a step's reference, metrics, the best step) and their offline
evaluation / export live one layer down, in `trainforge.registry.checkpoints` (registry/promotion uses them too);
they are re-exported here for the tasks and flows that call them.
"""

from __future__ import annotations

import time
from typing import Any

from trainforge.infra.storage import ObjectStore
from trainforge.infra.storage.layout import parse_checkpoint_step
from trainforge.registry.checkpoints import (
    CheckpointCorrupt,
    JobLocation,
    best_step,
    checkpoint_metrics,
    committed_ref,
    evaluate,
    export_folder,
    export_safetensors,
    job_location,
    job_store,
)
from trainforge.registry.dedup import chunks_prefix, referenced_chunks
from trainforge.registry.manifest import (
    checkpoints_prefix,
    list_committed,
    quarantine,
    quarantined_steps,
    step_prefix,
    verify,
)
from trainforge.registry.retention import RetentionPolicy, steps_to_keep
from trainforge.spec import JobSpec

__all__ = ["GC_GRACE_S", "CheckpointCorrupt", "apply_retention", "best_step", "checkpoint_metrics",
           "checkpoint_status", "collect_garbage", "commit_bookkeeping", "committed_ref", "evaluate",
           "export_folder", "export_safetensors", "job_location", "job_store", "policy_of"]


def commit_bookkeeping(config: JobLocation, step: int) -> dict[str, Any]:
    """Verify every file of a committed checkpoint and return its catalog entry."""
    store = job_store(config)
    ref = committed_ref(store, job_location(config)[1], step)
    problems = verify(store, ref)
    if problems:
        quarantine(store, ref, problems)
        raise CheckpointCorrupt(f"checkpoint step {step} is corrupt (quarantined): {'; '.join(problems)}")
    size = sum(f["bytes"] for f in ref.files)
    dedup = ref.manifest.get("dedup") or {}
    return {"step": step, "prefix": ref.prefix, "bytes": size, "files": len(ref.files),
            "bytes_written": dedup.get("bytes_written", size),
            "train_loss": ref.metrics.get("train_loss"), "committed_at": ref.manifest.get("committed_at")}


def policy_of(spec: JobSpec) -> RetentionPolicy:
    c = spec.checkpoint
    return RetentionPolicy(
        keep_last=c.keep_last,
        keep_best_metric=c.keep_best.metric if c.keep_best else None,
        keep_best_mode=c.keep_best.mode if c.keep_best else "min",
        keep_best_count=c.keep_best.count if c.keep_best else 1,
        keep_every=c.keep_every,
    )


GC_GRACE_S = 3600.0


def apply_retention(spec: JobSpec, config: JobLocation, protected: list[int],
                    grace_s: float = GC_GRACE_S) -> list[int]:
    """Delete checkpoints the policy does not keep, then garbage-collect. Returns the deleted steps.

    The manifest goes first, so a half-deleted checkpoint is never mistaken for a committed one. Never deleted:
    the newest intact committed checkpoint (a running or retrying segment resumes from it), protected steps (the
    registry references them), and anything younger than `grace_s` that no manifest references yet (an in-flight
    save's chunks and folders)."""
    store = job_store(config)
    return collect_garbage(store, job_location(config)[1], policy_of(spec), protected, grace_s)


def collect_garbage(store: ObjectStore, job_prefix: str, policy: RetentionPolicy, protected: list[int],
                    grace_s: float = GC_GRACE_S, now: float | None = None) -> list[int]:
    now = time.time() if now is None else now
    metrics = checkpoint_metrics(store, job_prefix)  # intact (non-quarantined) committed checkpoints
    keep = steps_to_keep(policy, metrics, protected)
    deleted = []
    committed = list_committed(store, job_prefix, include_quarantined=True)
    bad = quarantined_steps(store, job_prefix)
    for ref in committed:
        if ref.step in keep or (ref.step in protected):
            continue
        if ref.step not in bad and ref.step not in metrics:
            continue  # defensive: only what the policy saw may go
        _delete_checkpoint(store, ref.prefix)
        deleted.append(ref.step)
    live = {r.step for r in committed} - set(deleted)
    # Uncommitted leftovers (no manifest) older than the grace period: a crashed save's folder.
    for key in store.list(checkpoints_prefix(job_prefix) + "/"):
        step = _step_of(key)
        if step is not None and step not in live and _age(store, key, now) > grace_s:
            store.delete(key)
    # Chunks no remaining manifest references, older than the grace period (an in-flight save's are young).
    referenced = set()
    for ref in list_committed(store, job_prefix, include_quarantined=True):
        referenced |= referenced_chunks(ref.files)
    for key in store.list(chunks_prefix(job_prefix) + "/"):
        sha = key.rsplit("/", 1)[-1].split(".", 1)[0]
        if sha not in referenced and _age(store, key, now) > grace_s:
            store.delete(key)
    return deleted


def _delete_checkpoint(store: ObjectStore, prefix: str) -> None:
    store.delete(f"{prefix}/manifest.json")
    for key in store.list(prefix + "/"):
        store.delete(key)


def _step_of(key: str) -> int | None:
    return parse_checkpoint_step(key)


def _age(store: ObjectStore, key: str, now: float) -> float:
    """Seconds since the object was written; 0 (never collected) when the backend cannot say."""
    try:
        if hasattr(store, "local_path"):
            return now - store.local_path(key).stat().st_mtime
        modified = store.head(key).get("modified") if hasattr(store, "head") else None
        if modified is None and hasattr(store, "_client"):
            # S3ObjectStore.head() reports size and ETag only; ask the same client for LastModified.
            modified = store._client.head_object(Bucket=store.bucket, Key=store._full(key))["LastModified"].timestamp()
        if modified is not None:
            return now - float(modified)
    except (OSError, KeyError, AttributeError):
        return 0.0
    return 0.0


def checkpoint_status(store: ObjectStore, job_prefix: str, protected: set[int], verify_files: bool = False,
                      ) -> list[dict[str, Any]]:
    """Every checkpoint folder of the job: committed / quarantined / in flight (no manifest yet), with size,
    bytes written after deduplication, step and metrics; `verify_files` reads and hashes every byte."""
    metrics = checkpoint_metrics(store, job_prefix)
    bad = quarantined_steps(store, job_prefix)
    refs = {r.step: r for r in list_committed(store, job_prefix, include_quarantined=True)}
    steps = set(refs)
    for key in store.list(checkpoints_prefix(job_prefix) + "/"):
        if (step := _step_of(key)) is not None:
            steps.add(step)
    rows = []
    for step in sorted(steps):
        ref = refs.get(step)
        row: dict[str, Any] = {"step": step, "prefix": step_prefix(job_prefix, step), "protected": step in protected}
        if ref is None:
            row["status"] = "in flight"
            rows.append(row)
            continue
        row["status"] = "quarantined" if step in bad else "committed"
        row["bytes"] = sum(f["bytes"] for f in ref.files)
        row["bytes_written"] = (ref.manifest.get("dedup") or {}).get("bytes_written", row["bytes"])
        row.update(metrics.get(step, ref.metrics))
        if verify_files and row["status"] == "committed":
            problems = verify(store, ref)
            row["verified"] = not problems
            if problems:
                quarantine(store, ref, problems)
                row["status"], row["problems"] = "quarantined", problems
        rows.append(row)
    return rows
