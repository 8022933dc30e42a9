"""Control-plane work on committed checkpoints: bookkeeping, held-out evaluation, retention, export.

Evaluation and export run the trainer's offline module in a subprocess, so the flow process never imports torch.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainforge.contract.config import SegmentConfig
from trainforge.infra.storage import ObjectStore, open_store
from trainforge.registry.dedup import chunks_prefix, referenced_chunks
from trainforge.registry.manifest import (
    CheckpointRef,
    checkpoints_prefix,
    list_committed,
    materialize,
    quarantine,
    quarantined_steps,
    read_manifest,
    step_prefix,
    verify,
)
from trainforge.registry.retention import RetentionPolicy, steps_to_keep
from trainforge.spec import JobSpec

EVAL_FILE = "evaluation.json"


class CheckpointCorrupt(RuntimeError):
    pass


JobLocation = SegmentConfig | Mapping[str, Any]
"""A job's config: the flow's SegmentConfig, or a stored worker-config.json read as JSON (its storage fields)."""


def _location(config: JobLocation) -> tuple[str, str]:
    if isinstance(config, SegmentConfig):
        return config.storage_url, config.storage_prefix
    return config["storage_url"], config["storage_prefix"]


def job_store(config: JobLocation) -> ObjectStore:
    url, prefix = _location(config)
    return open_store(url).scoped(prefix)


def committed_ref(store: ObjectStore, job_prefix: str, step: int) -> CheckpointRef:
    prefix = step_prefix(job_prefix, step)
    manifest = read_manifest(store, prefix)
    if manifest is None:
        raise CheckpointCorrupt(f"checkpoint step {step} has no manifest under {prefix}: not committed")
    return CheckpointRef(step, prefix, manifest)


def commit_bookkeeping(config: JobLocation, step: int) -> dict[str, Any]:
    """Verify every file of a committed checkpoint and return its catalog entry."""
    store = job_store(config)
    ref = committed_ref(store, _location(config)[1], step)
    problems = verify(store, ref)
    if problems:
        quarantine(store, ref, problems)
        raise CheckpointCorrupt(f"checkpoint step {step} is corrupt (quarantined): {'; '.join(problems)}")
    size = sum(f["bytes"] for f in ref.files)
    dedup = ref.manifest.get("dedup") or {}
    return {"step": step, "prefix": ref.prefix, "bytes": size, "files": len(ref.files),
            "bytes_written": dedup.get("bytes_written", size),
            "train_loss": ref.metrics.get("train_loss"), "committed_at": ref.manifest.get("committed_at")}


def _materialize(store: ObjectStore, ref: CheckpointRef, scratch: Path) -> Path:
    """The checkpoint's files in a local folder (reassembled from its chunks, every sha256 checked): the offline
    evaluation and export read DCP from there, whatever the store (local folder or S3)."""
    problems = materialize(store, ref, scratch)
    if problems:
        quarantine(store, ref, problems)
        raise CheckpointCorrupt(f"checkpoint step {ref.step} is corrupt (quarantined): {'; '.join(problems)}")
    return scratch


def _run_offline(args: list[str], timeout_s: float) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "trainforge.trainer.offline", *args], capture_output=True,
                          text=True, timeout=timeout_s, env=_single_thread_env())
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.splitlines()[-15:])
        raise RuntimeError(f"offline {args[0]} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _single_thread_env() -> dict[str, str]:
    import os

    return {**os.environ, "OMP_NUM_THREADS": "1"}


def evaluate(config_path: Path, config: JobLocation, step: int, batches: int,
             timeout_s: float = 600) -> dict[str, float]:
    store = job_store(config)
    ref = committed_ref(store, _location(config)[1], step)
    with tempfile.TemporaryDirectory(prefix="tf-eval-") as scratch:
        folder = _materialize(store, ref, Path(scratch))
        result = _run_offline(["evaluate", "--config", str(config_path), "--checkpoint", str(folder),
                               "--batches", str(batches)], timeout_s)
    # Results live beside the immutable manifest, so retention and promotion can rank checkpoints.
    store.put_bytes(f"{ref.prefix}/{EVAL_FILE}", json.dumps(result).encode())
    return result


def export_safetensors(config_path: Path, config: JobLocation, step: int, out: Path,
                       timeout_s: float = 600) -> dict[str, Any]:
    store = job_store(config)
    ref = committed_ref(store, _location(config)[1], step)
    with tempfile.TemporaryDirectory(prefix="tf-export-") as scratch:
        folder = _materialize(store, ref, Path(scratch))
        return _run_offline(["export", "--config", str(config_path), "--checkpoint", str(folder), "--out",
                             str(out)], timeout_s)


def checkpoint_metrics(store: ObjectStore, job_prefix: str) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for ref in list_committed(store, job_prefix):
        metrics = dict(ref.metrics)
        with contextlib.suppress(KeyError, ValueError):
            metrics.update(json.loads(store.get_bytes(f"{ref.prefix}/{EVAL_FILE}")))
        out[ref.step] = metrics
    return out


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
    return collect_garbage(store, _location(config)[1], policy_of(spec), protected, grace_s)


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
    from trainforge.infra.storage.layout import parse_checkpoint_step

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


def best_step(spec: JobSpec, metrics: dict[int, dict[str, float]]) -> int:
    """The checkpoint to promote: best by keep_best's metric when configured and measured, else the newest."""
    if not metrics:
        raise LookupError("the job has no committed checkpoint")
    kb = spec.checkpoint.keep_best
    if kb:
        scored = [(m[kb.metric], s) for s, m in metrics.items() if isinstance(m.get(kb.metric), int | float)]
        if scored:
            return (min(scored) if kb.mode == "min" else max(scored))[1]
    return max(metrics)
