"""Worker-side checkpoints: DCP save to node-local staging, upload and commit in the background, exact restore.

Save (every rank): `torch.distributed.checkpoint` writes model + optimizer shards into the staging folder, and each
rank writes its RNG state as safetensors. The loop blocks only for that local write. Rank 0 then uploads the files
to the object store in a background thread and writes the manifest last (if-none-match), which is the commit.
Restore: the newest committed checkpoint whose sha256s verify is read back (in place for a local store) with DCP;
nothing is unpickled (DCP metadata aside, tensors come through DCP's reader and RNG through safetensors).
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from trainforge.infra.storage import LocalObjectStore, ObjectStore
from trainforge.registry.manifest import CheckpointRef, latest_intact, step_prefix, write_manifest
from trainforge.trainer.distributed import DistContext

logger = logging.getLogger(__name__)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def capture_rng() -> dict[str, torch.Tensor]:
    state = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["torch_cuda"])


class Checkpointer:
    def __init__(self, ctx: DistContext, store: ObjectStore, job_prefix: str, staging_dir: Path,
                 on_commit: Callable[[int, str, dict[str, Any]], None]):
        self.ctx = ctx
        self.store = store
        self.job_prefix = job_prefix
        self.staging = staging_dir
        self.on_commit = on_commit
        self._uploader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-upload")
        self._pending: list[Future[None]] = []
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ save

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             manifest_fields: dict[str, Any]) -> float:
        """Write the checkpoint locally on every rank; commit it in the background. Returns seconds blocked."""
        t0 = time.perf_counter()
        folder = self.staging / f"step-{step:010d}"
        if self.ctx.is_main and folder.exists():
            shutil.rmtree(folder)  # leftovers of an attempt that died before committing
        self.ctx.barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder))
        save_file(capture_rng(), str(folder / f"rng-rank{self.ctx.rank:05d}.safetensors"))
        self.ctx.barrier()  # every rank's files are on local disk
        blocked = time.perf_counter() - t0
        if self.ctx.is_main:
            fut = self._uploader.submit(self._upload_and_commit, step, folder, manifest_fields)
            self._pending.append(fut)
        return blocked

    def _upload_and_commit(self, step: int, folder: Path, fields: dict[str, Any]) -> None:
        prefix = step_prefix(self.job_prefix, step)
        files = []
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            name = path.relative_to(folder).as_posix()
            self.store.put_file(f"{prefix}/{name}", path)
            files.append({"name": name, "bytes": path.stat().st_size, "sha256": _sha256_file(path)})
        manifest = {**fields, "step": step, "files": files, "committed_at": time.time()}
        write_manifest(self.store, prefix, manifest)
        shutil.rmtree(folder, ignore_errors=True)
        self.on_commit(step, prefix, manifest)

    def wait(self) -> None:
        """Block until every background commit finished; re-raise the first failure."""
        for fut in self._pending:
            fut.result()
        self._pending.clear()

    def close(self) -> None:
        self.wait()
        self._uploader.shutdown(wait=True)

    # --------------------------------------------------------------- restore

    def latest(self) -> tuple[CheckpointRef | None, list[tuple[int, list[str]]]]:
        return latest_intact(self.store, self.job_prefix)

    def load(self, ref: CheckpointRef, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        folder = self._readable_folder(ref)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(folder))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        rng_file = folder / f"rng-rank{self.ctx.rank:05d}.safetensors"
        if rng_file.is_file():
            restore_rng(load_file(str(rng_file)))

    def _readable_folder(self, ref: CheckpointRef) -> Path:
        if isinstance(self.store, LocalObjectStore):
            return self.store.local_path(f"{ref.prefix}/manifest.json").parent
        folder = self.staging / "restore" / f"step-{ref.step:010d}"
        if self.ctx.is_main:
            for f in ref.files:
                self.store.get_file(f"{ref.prefix}/{f['name']}", folder / f["name"])
        self.ctx.barrier()
        return folder


def load_model_weights(folder: Path, model: torch.nn.Module) -> None:
    """Single-process read of a checkpoint's model weights (evaluation, export): no process group needed."""
    sd = model.state_dict()
    state = {"model": sd}
    dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    model.load_state_dict(state["model"])
