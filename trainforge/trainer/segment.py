"""The segment's cadence and checkpoint reports, shared by the managed loop (trainer/loop.py) and script mode's
runtime (trainforge/runtime.py). Pure: no torch import (a JAX script's runtime imports it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from trainforge.contract.config import SegmentConfig
from trainforge.contract.events import CheckpointCommitted, CheckpointSkipped, CheckpointStaged, SegmentEvent

Publish = Callable[[SegmentEvent], None]


def segment_end(cfg: SegmentConfig, start: int) -> int:
    """The step (exclusive) the segment that starts at `start` ends at: the job's end, or the segment limit
    (fault_tolerance.segment_max_steps)."""
    total = cfg.total_steps
    return total if cfg.segment_max_steps is None else min(total, start + cfg.segment_max_steps)


def checkpoint_due(cfg: SegmentConfig, done: int, end: int) -> bool:
    """A checkpoint after `done` optimizer steps: every checkpoint interval, and at the segment's end (so the next
    segment resumes exactly there)."""
    return done % cfg.checkpoint_interval == 0 or done == end


def end_reason(cfg: SegmentConfig, end: int, preempted: bool = False) -> str:
    return "preempted" if preempted else "finished" if end >= cfg.total_steps else "segment_max_steps"


def manifest_fields(cfg: SegmentConfig, world_size: int, step: int, loss: float | None,
                    anchor: dict[str, int] | None = None, **extra: Any) -> dict[str, Any]:
    """The platform's fields of a checkpoint manifest after `step` steps (the sampler position resumes the data;
    `anchor`, for a dataset read in place, says where the group holding that position starts, so a resume counts
    samples from there: datasets/chunk_order.py)."""
    return {
        "job_id": cfg.job_id,
        "team": cfg.team,
        # the segment attempt that commits it: the control plane books, from the store, a commit of its attempt
        # whose report never reached it (tasks/supervisor.py `report_unreported_commits`)
        "segment_attempt": cfg.attempt,
        "world_size": world_size,
        "layout": asdict(cfg.layout),
        **extra,
        "sampler": {"position": step * cfg.training.global_batch_size, "seed": cfg.training.seed,
                    "dataset_version": cfg.dataset.version, "skip": list(cfg.skip_samples),
                    **({"anchor": anchor} if anchor else {})},
        "rng": {"files": [f"rng-rank{r:05d}.safetensors" for r in range(world_size)]},
        "metrics": {} if loss is None else {"train_loss": loss},
        "dataset": {"ref": cfg.dataset.ref, "version": cfg.dataset.version, "license": cfg.dataset.license},
        "code_commit": cfg.code_commit,
        "config_hash": cfg.config_hash,
        "model": cfg.model_args(),
    }


def commit_reporter(publish: Publish) -> Callable[[int, str, dict[str, Any]], None]:
    """The Checkpointer's on_commit: one `checkpoint_committed` event per commit."""
    def on_commit(step: int, prefix: str, manifest: dict[str, Any]) -> None:
        publish(CheckpointCommitted(step=step, prefix=prefix, metrics=manifest.get("metrics", {})))

    return on_commit


def report_staged(ckpt: Any, publish: Publish) -> None:
    """One `checkpoint_staged` per save whose host copy has completed: the seconds the loop was blocked by it (the
    save call plus the wait for its copy). `ckpt` is a trainer.checkpoint.Checkpointer, or None."""
    for staged_step, blocked_s in ckpt.take_staged() if ckpt is not None else ():
        publish(CheckpointStaged(step=staged_step, blocked_s=blocked_s))


def report_skipped(ckpt: Any, publish: Publish) -> None:
    """Checkpoints superseded by a later commit (after the Checkpointer's close()): reported, never resumed from."""
    for bad_step, why in ckpt.skipped if ckpt is not None else ():
        publish(CheckpointSkipped(step=bad_step, reason=why))
