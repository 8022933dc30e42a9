"""Checkpoint manifests: a checkpoint exists only once its manifest is written, last, into the job's prefix.

The manifest lists every file with its size and sha256 plus the training state needed to resume exactly (step,
sampler position, RNG files, dataset version, code commit, config hash, metrics). Readers ignore a checkpoint
folder without a manifest, and `verify` detects a corrupt or incomplete one. Shared by the trainer (writes) and the
control plane (reads); depends only on the ObjectStore interface.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass
from typing import Any

from trainforge.infra.storage.base import ObjectNotFoundError, ObjectStore
from trainforge.infra.storage.layout import STEP_WIDTH

logger = logging.getLogger(__name__)

FORMAT = "trainforge-checkpoint/1"
MANIFEST = "manifest.json"
_MANIFEST_KEY = re.compile(r"/checkpoints/step-(\d+)/manifest\.json$")


def checkpoints_prefix(job_prefix: str) -> str:
    return f"{job_prefix}/checkpoints"


def step_prefix(job_prefix: str, step: int) -> str:
    """Same layout as trainforge.infra.storage.layout.checkpoint_prefix, from a job prefix."""
    return f"{checkpoints_prefix(job_prefix)}/step-{step:0{STEP_WIDTH}d}"


@dataclass(frozen=True, slots=True)
class CheckpointRef:
    step: int
    prefix: str
    manifest: dict[str, Any]

    @property
    def files(self) -> list[dict[str, Any]]:
        return self.manifest["files"]

    @property
    def metrics(self) -> dict[str, float]:
        return self.manifest.get("metrics", {})


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_manifest(store: ObjectStore, prefix: str, manifest: dict[str, Any]) -> None:
    """Commit a checkpoint: the manifest is created once (if-none-match) after every file it lists."""
    body = json.dumps({"format": FORMAT, **manifest}, indent=1, sort_keys=True).encode()
    store.put_bytes(f"{prefix}/{MANIFEST}", body, if_none_match=True)


def read_manifest(store: ObjectStore, prefix: str) -> dict[str, Any] | None:
    try:
        data = json.loads(store.get_bytes(f"{prefix}/{MANIFEST}"))
    except (ObjectNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == FORMAT else None


def list_committed(store: ObjectStore, job_prefix: str) -> list[CheckpointRef]:
    """Committed checkpoints (those with a readable manifest), oldest first. Folders without one are ignored."""
    refs = []
    for key in store.list(checkpoints_prefix(job_prefix) + "/"):
        m = _MANIFEST_KEY.search("/" + key)
        if not m:
            continue
        prefix = key.rsplit("/", 1)[0]
        manifest = read_manifest(store, prefix)
        if manifest is not None:
            refs.append(CheckpointRef(int(m.group(1)), prefix, manifest))
    return sorted(refs, key=lambda r: r.step)


def verify(store: ObjectStore, ref: CheckpointRef) -> list[str]:
    """Problems with a committed checkpoint's files (empty list = intact)."""
    problems = []
    for f in ref.files:
        key = f"{ref.prefix}/{f['name']}"
        try:
            data = store.get_bytes(key)
        except ObjectNotFoundError:
            problems.append(f"{f['name']}: missing")
            continue
        if len(data) != f["bytes"] or sha256_bytes(data) != f["sha256"]:
            problems.append(f"{f['name']}: sha256 mismatch")
    return problems


def latest_intact(store: ObjectStore, job_prefix: str) -> tuple[CheckpointRef | None, list[tuple[int, list[str]]]]:
    """The newest committed checkpoint whose files verify, and the corrupt ones skipped on the way."""
    skipped: list[tuple[int, list[str]]] = []
    for ref in reversed(list_committed(store, job_prefix)):
        problems = verify(store, ref)
        if not problems:
            return ref, skipped
        logger.warning("checkpoint step %d is corrupt, skipping it: %s", ref.step, "; ".join(problems))
        skipped.append((ref.step, problems))
    return None, skipped
