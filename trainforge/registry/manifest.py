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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainforge.infra.storage.base import ObjectNotFoundError, ObjectStore
from trainforge.infra.storage.layout import STEP_WIDTH
from trainforge.registry.fence import Fence, read_fence

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


QUARANTINE = "quarantine.json"
_QUARANTINE_KEY = re.compile(r"/checkpoints/step-(\d+)/quarantine\.json$")


def _scan_raw(store: ObjectStore, job_prefix: str) -> tuple[dict[int, str], set[int]]:
    """Manifest keys by step, and the quarantined steps, from one listing of the checkpoints folder."""
    manifests: dict[int, str] = {}
    quarantined: set[int] = set()
    for key in store.list(checkpoints_prefix(job_prefix) + "/"):
        if m := _MANIFEST_KEY.search("/" + key):
            manifests[int(m.group(1))] = key
        elif m := _QUARANTINE_KEY.search("/" + key):
            quarantined.add(int(m.group(1)))
    return manifests, quarantined


def job_fence(store: ObjectStore, job_prefix: str) -> Fence | None:
    """The job's fence (registry/fence.py), or None: no fence yet, or a store without conditional overwrites."""
    if not hasattr(store, "get_with_etag"):
        return None
    return read_fence(store, job_prefix)


def _scan(store: ObjectStore, job_prefix: str) -> tuple[dict[int, str], set[int], Fence | None]:
    """`_scan_raw` without the manifests the job's fence revoked (an older attempt's, landed after a newer
    attempt began: never a checkpoint), and the fence itself."""
    manifests, quarantined = _scan_raw(store, job_prefix)
    fence = job_fence(store, job_prefix)
    if fence is not None:
        manifests = {step: key for step, key in manifests.items() if fence.visible(step)}
    return manifests, quarantined, fence


def _accepted(fence: Fence | None, step: int, manifest: dict[str, Any] | None) -> bool:
    """A readable manifest the job's fence (if any) counts as committed."""
    return manifest is not None and (fence is None or fence.visible(step, manifest.get("segment_attempt")))


def manifest_steps(store: ObjectStore, job_prefix: str) -> set[int]:
    """Every step with a manifest object in the store, whatever the fence says (what the fence's advance needs)."""
    return set(_scan_raw(store, job_prefix)[0])


def list_committed(store: ObjectStore, job_prefix: str, *, include_quarantined: bool = False) -> list[CheckpointRef]:
    """Committed checkpoints (those with a readable manifest), oldest first. Folders without one are ignored, and
    so are quarantined ones (found corrupt) unless asked for."""
    manifests, quarantined, fence = _scan(store, job_prefix)
    refs = []
    for step, key in manifests.items():
        if step in quarantined and not include_quarantined:
            continue
        prefix = key.rsplit("/", 1)[0]
        manifest = read_manifest(store, prefix)
        if _accepted(fence, step, manifest):
            refs.append(CheckpointRef(step, prefix, manifest))
    return sorted(refs, key=lambda r: r.step)


def committed_steps(store: ObjectStore, job_prefix: str) -> list[int]:
    """The steps that have a manifest and are not quarantined, oldest first, from one listing (no manifest read)."""
    manifests, quarantined, _ = _scan(store, job_prefix)
    return sorted(set(manifests) - quarantined)


def newest_committed(store: ObjectStore, job_prefix: str, *, below: int | None = None) -> CheckpointRef | None:
    """The newest committed, unquarantined checkpoint (before step `below`) that the fence accepts, reading only
    its manifest (and those of newer unreadable or refused ones): what a resume chooses."""
    manifests, quarantined, fence = _scan(store, job_prefix)
    for step in sorted(set(manifests) - quarantined, reverse=True):
        if below is not None and step >= below:
            continue
        prefix = step_prefix(job_prefix, step)
        manifest = read_manifest(store, prefix)
        if _accepted(fence, step, manifest):
            return CheckpointRef(step, prefix, manifest)
    return None


def quarantined_steps(store: ObjectStore, job_prefix: str) -> set[int]:
    return _scan_raw(store, job_prefix)[1]


def retire_quarantined(store: ObjectStore, prefix: str) -> bool:
    """A step saved again after its earlier commit was found corrupt (a resume from an older checkpoint replays
    it): keep the evidence under new names and free the manifest name, so the create-only commit can succeed."""
    import time

    qkey, mkey = f"{prefix}/{QUARANTINE}", f"{prefix}/{MANIFEST}"
    if not store.exists(qkey):
        return False
    stamp = f"{time.time():.0f}"
    if store.exists(mkey):
        store.put_bytes(f"{prefix}/manifest.corrupt-{stamp}.json", store.get_bytes(mkey))
        store.delete(mkey)
    store.put_bytes(f"{prefix}/quarantine.retired-{stamp}.json", store.get_bytes(qkey))
    store.delete(qkey)
    return True


def retire_stale_manifest(store: ObjectStore, prefix: str, attempt: int) -> bool:
    """Move aside a manifest at `prefix` written by another attempt than `attempt` (one the fence revoked: an
    older attempt's, landed after a newer one began), so this attempt's create-only commit of the step succeeds.
    Returns whether one was moved. The caller holds the fence's acceptance of the step for `attempt`."""
    import time

    existing = read_manifest(store, prefix)
    if existing is None or existing.get("segment_attempt") in (None, attempt):
        return False
    mkey = f"{prefix}/{MANIFEST}"
    store.put_bytes(f"{prefix}/manifest.stale-{time.time():.0f}.json", store.get_bytes(mkey))
    store.delete(mkey)
    logger.warning("%s: moved aside the manifest of attempt %s, which the fence never accepted", prefix,
                   existing.get("segment_attempt"))
    return True


def quarantine(store: ObjectStore, ref: CheckpointRef, problems: list[str]) -> None:
    """Mark a committed checkpoint corrupt: listings skip it from now on; the files stay for inspection until
    retention collects them."""
    import time

    body = json.dumps({"step": ref.step, "problems": problems, "at": time.time()}).encode()
    store.put_bytes(f"{ref.prefix}/{QUARANTINE}", body)
    logger.warning("checkpoint step %d quarantined: %s", ref.step, "; ".join(problems))


def verify(store: ObjectStore, ref: CheckpointRef) -> list[str]:
    """Problems with a committed checkpoint's files (empty list = intact): every byte is read and hashed."""
    from trainforge.registry.dedup import file_problem

    return [p for f in ref.files if (p := file_problem(store, ref.prefix, f)) is not None]


def materialize(store: ObjectStore, ref: CheckpointRef, folder: Path, names: set[str] | None = None,
                before_each: Callable[[], None] | None = None) -> list[str]:
    """Write the checkpoint's files (or those named) into a local folder, verifying each; the problems found.
    Files already there with the right size and sha256 (a node-local staging copy) are not downloaded again.
    `before_each` runs before each file (it raises to stop: a job winding down, registry/offline.py)."""
    from trainforge.registry.dedup import file_problem

    folder.mkdir(parents=True, exist_ok=True)
    problems = []
    for f in ref.files:
        if names is not None and f["name"] not in names:
            continue
        if before_each is not None:
            before_each()
        dest = folder / f["name"]
        if dest.is_file() and dest.stat().st_size == f["bytes"] and sha256_file(dest) == f["sha256"]:
            continue
        if (p := file_problem(store, ref.prefix, f, dest)) is not None:
            problems.append(p)
    return problems


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def latest_intact(store: ObjectStore, job_prefix: str, *, folder: Path | None = None,
                  quarantine_corrupt: bool = True) -> tuple[CheckpointRef | None, list[tuple[int, list[str]]]]:
    """The newest committed checkpoint whose files verify, and the corrupt ones skipped (and quarantined) on the
    way. With `folder`, the verified files are also materialized there (one read of the bytes, not two)."""
    skipped: list[tuple[int, list[str]]] = []
    for ref in reversed(list_committed(store, job_prefix)):
        problems = verify(store, ref) if folder is None else materialize(store, ref, folder / ref_dirname(ref))
        if not problems:
            return ref, skipped
        logger.warning("checkpoint step %d is corrupt, skipping it: %s", ref.step, "; ".join(problems))
        if quarantine_corrupt:
            quarantine(store, ref, problems)
        skipped.append((ref.step, problems))
    return None, skipped


def ref_dirname(ref: CheckpointRef) -> str:
    return f"step-{ref.step:0{STEP_WIDTH}d}"
