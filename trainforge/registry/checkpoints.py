"""A job's committed checkpoints as the control plane reads them: the job's store, a committed step's reference,
the metrics of every committed step (with its held-out evaluation), the step to promote, and the offline
evaluation / export of one step.

Below tasks/ and registry/promotion (both use it). Evaluation and export run the trainer's offline module in a
subprocess (registry/offline.py, which can stop a winding-down job's), so the process that calls them never imports
torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainforge.contract.config import SegmentConfig
from trainforge.infra.storage import ObjectStore, open_store
from trainforge.infra.storage.credentials import without_platform_credentials
from trainforge.registry.manifest import (
    CheckpointRef,
    list_committed,
    materialize,
    quarantine,
    read_manifest,
    step_prefix,
)
from trainforge.registry.offline import refuse_if_stopped, run_offline
from trainforge.spec import JobSpec

EVAL_FILE = "evaluation.json"


class CheckpointCorrupt(RuntimeError):
    pass


JobLocation = SegmentConfig | Mapping[str, Any]
"""A job's config: the flow's SegmentConfig, or a stored worker-config.json read as JSON (its storage fields)."""


def job_location(config: JobLocation) -> tuple[str, str]:
    if isinstance(config, SegmentConfig):
        return config.storage_url, config.storage_prefix
    return config["storage_url"], config["storage_prefix"]


def job_store(config: JobLocation) -> ObjectStore:
    url, prefix = job_location(config)
    return open_store(url).scoped(prefix)


def committed_ref(store: ObjectStore, job_prefix: str, step: int) -> CheckpointRef:
    prefix = step_prefix(job_prefix, step)
    manifest = read_manifest(store, prefix)
    if manifest is None:
        raise CheckpointCorrupt(f"checkpoint step {step} has no manifest under {prefix}: not committed")
    return CheckpointRef(step, prefix, manifest)


def _materialize(store: ObjectStore, ref: CheckpointRef, scratch: Path, config: JobLocation, what: str) -> Path:
    """The checkpoint's files in a local folder (reassembled from its chunks, every sha256 checked): the offline
    evaluation and export read DCP from there, whatever the store (local folder or S3). A wind-down of the job
    stops the download between files (OfflineStopped)."""
    key = job_location(config)
    problems = materialize(store, ref, scratch, before_each=lambda: refuse_if_stopped(key, what))
    if problems:
        quarantine(store, ref, problems)
        raise CheckpointCorrupt(f"checkpoint step {ref.step} is corrupt (quarantined): {'; '.join(problems)}")
    return scratch


def _single_thread_env() -> dict[str, str]:
    """The offline process runs the user's model code on local files only: no object-store credentials, no
    secrets (infra/storage/credentials.py `without_platform_credentials`)."""
    return {**without_platform_credentials(os.environ), "OMP_NUM_THREADS": "1"}


def _write_eval_samples(config_path: Path, batches: int, out: Path) -> None:
    """The held-out samples, read here (this process may read the data; the offline one runs user code and may
    not: an in-place prefix or a remote catalog needs credentials it does not get)."""
    import numpy as np

    from trainforge.datasets.training_data import eval_samples

    cfg = SegmentConfig.load(str(config_path))
    rows = eval_samples(cfg.dataset, cfg.training.seed, cfg.training.seq_len, batches * cfg.layout.micro_batch_size)
    np.save(out, rows)


def evaluate(config_path: Path, config: JobLocation, step: int, batches: int,
             timeout_s: float = 600) -> dict[str, float]:
    store = job_store(config)
    ref = committed_ref(store, job_location(config)[1], step)
    with tempfile.TemporaryDirectory(prefix="tf-eval-") as scratch:
        folder = _materialize(store, ref, Path(scratch), config, "evaluate")
        samples = Path(scratch) / "eval-samples.npy"
        _write_eval_samples(config_path, batches, samples)
        result = run_offline(job_location(config), ["evaluate", "--config", str(config_path), "--checkpoint",
                                                     str(folder), "--batches", str(batches), "--samples",
                                                     str(samples)],
                             timeout_s, _single_thread_env())
    # Results live beside the immutable manifest, so retention and promotion can rank checkpoints.
    store.put_bytes(f"{ref.prefix}/{EVAL_FILE}", json.dumps(result).encode())
    return result


def export_folder(job_folder: Path | str, step: int) -> Path:
    """Where a job's export of `step` lives (the MLflow model folder promotion registers); one that exists is
    complete (export_safetensors renames it into place)."""
    return Path(job_folder) / "export" / f"step-{step}"


def export_safetensors(config_path: Path, config: JobLocation, step: int, out: Path,
                       timeout_s: float = 600) -> dict[str, Any]:
    store = job_store(config)
    ref = committed_ref(store, job_location(config)[1], step)
    with tempfile.TemporaryDirectory(prefix="tf-export-") as scratch:
        folder = _materialize(store, ref, Path(scratch), config, "export")
        # written beside `out` and renamed into place once complete: promotion takes an existing `out` as done, so
        # a killed or failed export must never leave a partial one there
        partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
        shutil.rmtree(partial, ignore_errors=True)
        try:
            result = run_offline(job_location(config), ["export", "--config", str(config_path), "--checkpoint",
                                                        str(folder), "--out", str(partial)], timeout_s,
                                 _single_thread_env())
            shutil.rmtree(out, ignore_errors=True)
            os.replace(partial, out)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        return result


def checkpoint_metrics(store: ObjectStore, job_prefix: str) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for ref in list_committed(store, job_prefix):
        metrics = dict(ref.metrics)
        with contextlib.suppress(KeyError, ValueError):
            metrics.update(json.loads(store.get_bytes(f"{ref.prefix}/{EVAL_FILE}")))
        out[ref.step] = metrics
    return out


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
