"""Hand-built SegmentConfigs for tests that run the trainer without the flow (its typed parts, small defaults)."""

from __future__ import annotations

from typing import Any

from trainforge.contract.config import SegmentConfig

TINY_MODEL = {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn_hidden": 64, "vocab": 260}


def segment_config(*, run_dir: str = "/nonexistent", dataset: dict[str, Any] | None = None,
                   training: dict[str, Any] | None = None, layout: dict[str, Any] | None = None,
                   model: dict[str, Any] | None = None, code: dict[str, Any] | None = None,
                   total_steps: int = 1, **fields: Any) -> SegmentConfig:
    """A valid config; `training` needs no max_steps (total_steps gives it), `code` defaults to the reference
    model's entrypoint, every other field is SegmentConfig's own (validated: a typo fails the test)."""
    doc: dict[str, Any] = {
        "job_id": "j", "team": "t", "name": "n", "run_dir": run_dir, "storage_url": "file:///nonexistent",
        "storage_prefix": "teams/t/jobs/j", "staging_dir": "/nonexistent", "code_dir": "",
        "code": {"entrypoint": "trainforge.trainer.models.llama:build_model", **(code or {})},
        "model": {"name": fields.get("name", "n"), **TINY_MODEL, **(model or {})},
        "layout": {"dp": 1, **(layout or {})},
        "training": {"global_batch_size": 8, "seq_len": 16, "max_steps": total_steps, **(training or {})},
        "total_steps": total_steps, "checkpoint_interval": 1,
        "dataset": {"ref": "main", "version": "unpinned", **(dataset or {})},
    }
    return SegmentConfig.model_validate(doc | fields)
