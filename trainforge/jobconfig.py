"""The resolved job config a worker receives (a JSON file named by $TRAINFORGE_JOB_CONFIG).

The shared contract between the control plane, which writes it (trainforge.tasks), and the trainer, which only
reads it. It carries no secrets (those come as environment variables) and no topology: rank and world size come
from torchrun's environment.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ENV_VAR = "TRAINFORGE_JOB_CONFIG"


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    job_id: str
    team: str
    name: str
    run_dir: str
    """Job folder on this host: events.jsonl, per-rank logs, failure reports."""
    storage_url: str
    """Object store root (file:///... or s3://bucket)."""
    storage_prefix: str
    """The job's prefix in the store: teams/{team}/jobs/{job}."""
    staging_dir: str
    """Node-local staging folder for checkpoints before upload."""
    entrypoint: str
    code_dir: str
    model: dict[str, Any]
    layout: dict[str, Any]
    training: dict[str, Any]
    total_steps: int
    dataset: dict[str, Any]
    checkpoint_interval: int
    segment_max_steps: int | None = None
    collective_timeout_s: float = 120.0
    code_commit: str = "unknown"
    config_hash: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def load(cls, path: str | Path) -> WorkerConfig:
        return cls(**json.loads(Path(path).read_text()))
