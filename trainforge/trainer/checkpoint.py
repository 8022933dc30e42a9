"""Worker-side checkpoints: async DCP save (the loop blocks only while it waits for staging), replicate in memory,
upload deduplicated chunks in the background, commit with the manifest last; verified, exact restore.

Save, on every rank:
1. `save()` waits for the previous save's local write (at most one in flight; the wait is counted as blocked),
   takes the state dict (references to the live tensors; non-parameter buffers, which a forward pass may change,
   are cloned now), captures the RNG state, and hands the rest to this checkpointer's writer thread: nothing is
   copied on the loop's thread. The writer thread copies the state into host buffers that are allocated once and
   reused by every later save (DCP's `DefaultStager` caches them per storage; pinned, and copied on a side stream
   after the compute stream's work, on GPUs), then writes it with DCP to the node-local staging folder on the
   checkpointer's own gloo group (ENVIRONMENT.md DCP trap 1). Forward and backward do not change parameters or
   optimizer state, so that copy overlaps them: the loop calls `wait_staging()` right before the weights change
   (trap 3; trainer/engine.py, torchtitan's maybe_wait_for_staging; callers that do not own the optimizer step,
   like script mode, get an optimizer pre-step hook that does it), and that wait — the time the loop is actually blocked — is recorded for the save it belongs to
   (`take_staged`).
2. This checkpointer's upload thread then keeps the rank's shard in host memory with a copy on a peer
   (checkpointing/replica.py), uploads the rank's files as content-addressed chunks (registry/dedup.py: chunks
   the previous committed checkpoint already holds are not sent again), and gathers every rank's file list on
   rank 0, which writes the manifest last with if-none-match: the commit.
Restore: after an in-segment restart (torchrun --max-restarts) from the peers' memory, read by DCP straight from
the replica bytes (checkpointing/memory_fs.py); otherwise from the newest committed checkpoint, chosen by its
manifest alone (rank 0 reads the manifest, nothing else), read straight from the store: each rank fetches only the
chunks under its DCP load plan's byte ranges, each chunk is fetched by one rank and sent to the others that need
it, and each is verified against the manifest's sha256 (checkpointing/store_reader.py); chunks of a node-local
staging copy whose sha256 matches are not fetched. A missing or corrupt chunk fails the load on every rank
together, before anything is copied into the model; `restore` then quarantines that commit and loads the one
before it. Nothing is unpickled (checkpointing/safe_dcp.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from trainforge.infra.storage import ObjectStore
from trainforge.infra.storage.base import ObjectExistsError
from trainforge.infra.storage.credentials import with_job_credentials
from trainforge.registry.dedup import ChunkWriter, UploadStats, default_codec, referenced_chunks
from trainforge.registry.fence import StaleAttemptError
from trainforge.registry.fence import commit as fence_commit
from trainforge.registry.manifest import (
    CheckpointRef,
    manifest_steps,
    materialize,
    newest_committed,
    quarantine,
    retire_quarantined,
    retire_stale_manifest,
    step_prefix,
    write_manifest,
)
from trainforge.trainer.checkpointing.deepspeed_format import is_deepspeed_checkpoint, load_deepspeed_weights
from trainforge.trainer.checkpointing.memory_fs import SafeMemoryReader
from trainforge.trainer.checkpointing.replica import MemoryReplica, replica_root
from trainforge.trainer.checkpointing.safe_dcp import SafeFileSystemReader, SafeLoadPlanner
from trainforge.trainer.checkpointing.store_reader import (
    RestoreReadError,
    StoreRangeReader,
    read_metadata_once,
)
from trainforge.trainer.distributed import DistContext

logger = logging.getLogger(__name__)

METADATA = ".metadata"
COMMIT_TIMEOUT_S = 1800.0  # uploads sit between the commit group's collectives


class CheckpointCorruptError(RuntimeError):
    """A checkpoint's bytes are missing or do not match its manifest; `problems` lists what was found."""

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems if problems is not None else [message]


def capture_rng() -> dict[str, torch.Tensor]:
    state = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["torch_cuda"])


def _freeze_buffers(model_sd: dict[str, Any], model: torch.nn.Module) -> None:
    """Clone, in place in `model_sd`, every tensor that is not a parameter (buffers: BatchNorm statistics, say).
    Forward passes may update buffers while the host copy runs in the background; parameters change only in
    `optimizer.step()`, which waits for it. Buffers are small, so the clone costs little."""
    params = {getattr(p, "_local_tensor", p).data_ptr() for p in model.parameters()}
    for key, value in model_sd.items():
        if isinstance(value, torch.Tensor) and getattr(value, "_local_tensor", value).data_ptr() not in params:
            model_sd[key] = value.detach().clone()


def _rank_files(rank: int) -> list[str]:
    return [f"__{rank}_0.distcp", f"rng-rank{rank:05d}.safetensors", *([METADATA] if rank == 0 else [])]


class Checkpointer:
    def __init__(self, ctx: DistContext, store: ObjectStore, job_prefix: str, staging_dir: Path,
                 on_commit: Callable[[int, str, dict[str, Any]], None], *, async_save: bool = True,
                 replicate: bool = True, compress: bool = False, guard_optimizer: bool = True):
        self.ctx = ctx
        # The managed loop calls wait_staging() itself right before its optimizer step (trainer/engine.py), so it
        # passes guard_optimizer=False. A caller that does not own that call (script mode: the user's loop steps
        # the optimizer) keeps the guard: an optimizer pre-step hook that waits for the copy.
        self.guard_optimizer = guard_optimizer
        self.store = with_job_credentials(store)
        self.job_prefix = job_prefix
        self.staging = staging_dir
        self.on_commit = on_commit
        self.async_save = async_save
        self.codec = default_codec(compress)
        self.distributed = ctx.world_size > 1 and dist.is_initialized()
        # Own groups (trap 1): DCP's background writes and the upload thread's collectives never share the
        # default group with the training collectives, nor each other.
        timeout = timedelta(seconds=COMMIT_TIMEOUT_S)
        self._pg = dist.new_group(backend="gloo", timeout=timeout) if self.distributed else None
        self._pg_commit = dist.new_group(backend="gloo", timeout=timeout) if self.distributed else None
        cuda = ctx.device.type == "cuda"
        # Staging buffers are allocated on the first save and reused by every later one (the stager caches a host
        # copy per source storage): fresh 100s of MB per save would be page faults on every checkpoint. Pinned on
        # GPUs for fast device-to-host copies. The stager runs synchronously inside the writer thread below.
        self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                    use_async_staging=False, use_non_blocking_copy=False))
        self._copy_stream = torch.cuda.Stream(device=ctx.device) if cuda else None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-stage-write")
        self._staging: tuple[int, Future[None]] | None = None  # (step, staged) of the save whose copy may run
        self._writing: Future[Any] | None = None
        self._uploader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-upload")
        self._puts = ThreadPoolExecutor(max_workers=4, thread_name_prefix="ckpt-put")
        self._pending: list[tuple[int, Future[None]]] = []
        self.skipped: list[tuple[int, str]] = []
        """Checkpoints that failed to commit but were superseded by a later committed one (reported, not fatal)."""
        self._hooked: set[int] = set()
        self._lock = threading.Lock()
        self._known: set[str] = set()  # chunks of the last committed checkpoint (safe to reference again)
        self.stats: dict[str, Any] = {"staging_wait_s": 0.0, "inflight_wait_s": 0.0, "saves": [], "restored_from": None}
        self._unreported_wait = 0.0
        self._records: dict[int, dict[str, Any]] = {}  # async saves whose staging wait is not counted yet
        self._staged: list[tuple[int, float]] = []  # (step, blocked_s) ready for take_staged
        self._memory: tuple[int, dict[str, torch.Tensor]] | None = None  # a restore's replica bytes, until loaded
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size))
        self.restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        # The segment attempt this gang is: every commit is conditional on the job's fence naming it.
        self.attempt = int(os.environ.get("TRAINFORGE_SEGMENT_ATTEMPT", "0"))
        self.replica = (MemoryReplica(replica_root(job_prefix) / f"attempt-{os.environ.get('TRAINFORGE_SEGMENT_ATTEMPT', '0')}",
                                      ctx.rank, ctx.world_size, local_world, self._pg_commit) if replicate else None)
        if self.replica is not None and self.restart_count == 0 and ctx.local_rank == 0:
            shutil.rmtree(replica_root(job_prefix), ignore_errors=True)  # a new gang: object storage is the truth
        self._barrier()

    # ------------------------------------------------------------------ helpers

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self._pg_commit)

    def _folder(self, step: int) -> Path:
        return self.staging / f"step-{step:010d}"

    def _hook(self, optimizer: torch.optim.Optimizer) -> None:
        if id(optimizer) in self._hooked:
            return
        self._hooked.add(id(optimizer))

        def before_step(*_: Any) -> None:  # a pre-hook must return None
            self.wait_staging()

        optimizer.register_step_pre_hook(before_step)

    def wait_staging(self) -> float:
        """Block until the last save's host copy is complete; the loop must call it before anything changes the
        parameters or optimizer state, `optimizer.step()` included (its pre-hook calls it when guard_optimizer). Returns the seconds
        waited, which are added to that save's blocked time."""
        pending, self._staging = self._staging, None
        if pending is None:
            return 0.0
        step, fut = pending
        t0 = time.perf_counter()
        try:
            fut.result()
        finally:
            waited = time.perf_counter() - t0
            self.stats["staging_wait_s"] += waited
            self._unreported_wait += waited
            record = self._records.get(step)
            if record is not None:
                record["staging_wait_s"] += waited
                record["blocked_s"] += waited
                self._staged.append((step, record["blocked_s"]))
        return waited

    def take_staged(self) -> list[tuple[int, float]]:
        """(step, seconds the loop was blocked by that save) for each save whose host copy has completed since the
        last call: the save call itself (including any wait for the previous save's write) plus the wait for the
        copy before the next optimizer step. The loop reports each as a `checkpoint_staged` event."""
        out, self._staged = self._staged, []
        for step, _ in out:
            self._records.pop(step, None)
        return out

    # ------------------------------------------------------------------ save

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             manifest_fields: dict[str, Any]) -> float:
        """Hand the checkpoint to the writer thread and return; it is staged, written, replicated, uploaded and
        committed in the background. Returns the seconds this call blocked plus the staging waits since the previous
        call (callers that report per save use `take_staged` instead)."""
        t0 = time.perf_counter()
        if self.guard_optimizer:
            self._hook(optimizer)
        self.wait_staging()
        if self._writing is not None:  # at most one save in flight; the wait counts as blocked
            t1 = time.perf_counter()
            with contextlib.suppress(Exception):  # a failed write is reported by its commit (upload thread)
                self._writing.result()
            self.stats["inflight_wait_s"] += time.perf_counter() - t1
        folder = self._folder(step)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        _freeze_buffers(model_sd, model)
        state = {"model": model_sd, "optim": optim_sd}
        rng = capture_rng()
        record = {"step": step, "blocked_s": 0.0, "staging_wait_s": 0.0}
        self.stats["saves"].append(record)
        if self.async_save:
            staged: Future[None] = Future()
            event = None
            if self._copy_stream is not None:  # the copy stream starts after the step's kernels already queued
                event = torch.cuda.Event()
                event.record()
            self._writing = self._writer.submit(self._stage_and_write, step, folder, state, rng, staged, event)
            self._staging = (step, staged)
            self._records[step] = record
        else:
            self._prepare_folder(folder)
            save_file(rng, str(folder / f"rng-rank{self.ctx.rank:05d}.safetensors"))
            dcp.save(state, storage_writer=self._dcp_writer(folder), process_group=self._pg)
            done: Future[Any] = Future()
            done.set_result(None)
            self._writing = done
        writing = self._writing
        self._pending.append((step, self._uploader.submit(self._replicate_upload_commit, step, folder,
                                                          manifest_fields, writing)))
        call = time.perf_counter() - t0
        record["blocked_s"] += call
        if not self.async_save:
            self._staged.append((step, record["blocked_s"]))
        blocked = call + self._unreported_wait
        self._unreported_wait = 0.0
        return blocked

    def _prepare_folder(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        for name in _rank_files(self.ctx.rank):  # leftovers of an attempt that died before committing
            (folder / name).unlink(missing_ok=True)

    @staticmethod
    def _dcp_writer(folder: Path) -> FileSystemWriter:
        return FileSystemWriter(str(folder), single_file_per_rank=True, sync_files=False)

    def _stage_and_write(self, step: int, folder: Path, state: dict[str, Any], rng: dict[str, torch.Tensor],
                         staged: Future[None], event: Any) -> None:
        """Writer thread: copy the state into the reused host buffers (the loop waits for `staged` before the next
        optimizer step), then write it with DCP to the node-local staging folder."""
        try:
            if self._copy_stream is not None:
                with torch.cuda.stream(self._copy_stream):
                    self._copy_stream.wait_event(event)
                    cpu_state = self._stager.stage(state)
                    self._copy_stream.synchronize()
            else:
                cpu_state = self._stager.stage(state)
        except BaseException as exc:
            staged.set_exception(exc)
            raise
        staged.set_result(None)
        del state  # the live tensors are no longer referenced from here
        self._prepare_folder(folder)
        save_file(rng, str(folder / f"rng-rank{self.ctx.rank:05d}.safetensors"))
        dcp.save(cpu_state, storage_writer=self._dcp_writer(folder), process_group=self._pg)

    def commit_files(self, step: int, names: list[str], manifest_fields: dict[str, Any]) -> None:
        """Commit files another engine already wrote into `step_folder(step)` (this rank's `names`, relative paths;
        e.g. DeepSpeed's own checkpoint): uploaded, gathered and committed in the background exactly like `save`'s
        DCP files (same chunks, manifest last, create-only). Every rank calls it for the same step."""
        done: Future[Any] = Future()
        done.set_result(None)
        self._pending.append((step, self._uploader.submit(self._replicate_upload_commit, step, self._folder(step),
                                                          manifest_fields, done, names)))

    def step_folder(self, step: int) -> Path:
        return self._folder(step)

    def _replicate_upload_commit(self, step: int, folder: Path, fields: dict[str, Any], writing: Future[Any],
                                 rank_files: list[str] | None = None) -> None:
        entries: list[dict[str, Any]] = []
        stats = UploadStats()
        error = None
        try:
            writing.result()  # this rank's files are on local disk (DCP's finish step ran on every rank)
            wanted = _rank_files(self.ctx.rank) if rank_files is None else rank_files
            names = [n for n in wanted if (folder / n).is_file()]
            if self.replica is not None:
                self.replica.put(step, folder, names)
            entries = self._upload(folder, names, stats)
        except Exception as exc:  # every rank still joins the gather, so no peer hangs
            logger.exception("checkpoint step %d: background save failed on rank %d", step, self.ctx.rank)
            error = f"rank {self.ctx.rank}: {type(exc).__name__}: {exc}"
        parts = self._gather((entries, error, stats.__dict__))
        committed = False
        if self.ctx.is_main:
            errors = [e for _, e, _ in parts if e]
            if not errors:
                total = UploadStats()
                for _, _, s in parts:
                    total.add(UploadStats(**s))
                files = sorted((f for fs, _, _ in parts for f in fs), key=lambda f: f["name"])
                manifest = {"segment_attempt": self.attempt, **fields, "step": step, "files": files,
                            "committed_at": time.time(), "dedup": total.__dict__, "codec": self.codec}
                prefix = step_prefix(self.job_prefix, step)
                try:
                    if retire_quarantined(self.store, prefix):
                        logger.warning("checkpoint step %d: replacing a commit that was quarantined as corrupt", step)
                    fence_commit(self.store, self.job_prefix, step, self.attempt,
                                 lambda: self._write_manifest(prefix, manifest),
                                 manifest_steps=lambda: manifest_steps(self.store, self.job_prefix),
                                 before_write=_fence_pause(step))
                    committed = True
                except StaleAttemptError as exc:  # a newer attempt owns the job: this gang's commits are refused
                    logger.error("checkpoint step %d: commit refused, attempt %d is stale: %s", step, self.attempt, exc)
                    errors = [f"rank 0 commit refused: {exc}"]
                except Exception as exc:  # still reach the broadcast below: peers wait in it
                    logger.exception("checkpoint step %d: commit failed", step)
                    errors = [f"rank 0 commit: {type(exc).__name__}: {exc}"]
                if committed:
                    # The checkpoint exists now: reported before the broadcast, which raises when a peer died
                    # after handing over its files (its node lost mid-commit). A report that never arrives (this
                    # rank killed first) is found in the store by the control plane when the segment ends.
                    try:
                        self.on_commit(step, prefix, manifest)
                    except Exception:  # still reach the broadcast below: peers wait in it
                        logger.exception("checkpoint step %d: committed, but reporting the commit failed", step)
        committed = self._broadcast(committed)
        if committed:
            self._known = referenced_chunks(entries)
            self._prune_staging(keep=step)
        else:
            self._known = set()
            raise RuntimeError(f"checkpoint step {step} was not committed: {errors if self.ctx.is_main else error}")

    def _write_manifest(self, prefix: str, manifest: dict[str, Any]) -> None:
        """The manifest, last (create-only), once the fence accepted the step for this attempt. A manifest there
        from another attempt (one the fence revoked) is moved aside first."""
        try:
            write_manifest(self.store, prefix, manifest)
        except ObjectExistsError:
            if not retire_stale_manifest(self.store, prefix, self.attempt):
                raise
            write_manifest(self.store, prefix, manifest)

    def _upload(self, folder: Path, names: list[str], stats: UploadStats) -> list[dict[str, Any]]:
        futures: list[Future[None]] = []
        writer = ChunkWriter(self.store, self.job_prefix, self.codec, known=set(self._known),
                             put=lambda key, body: futures.append(self._puts.submit(self.store.put_bytes, key, body)))
        entries = [writer.write_file(folder / n, n, stats) for n in names]
        for f in futures:
            f.result()
        return entries

    def _gather(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.ctx.world_size
        dist.all_gather_object(out, obj, group=self._pg_commit)
        return out

    def _broadcast(self, value: Any) -> Any:
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self._pg_commit)
        return box[0]

    def _prune_staging(self, keep: int) -> None:
        """Keep the newest committed step on local disk (fast restarts on this node); drop older ones."""
        if self.ctx.local_rank != 0:
            return
        for old in self.staging.glob("step-*"):
            try:
                if int(old.name.removeprefix("step-")) < keep:
                    shutil.rmtree(old, ignore_errors=True)
            except ValueError:
                continue

    def wait(self) -> None:
        """Block until every background commit finished. A failed commit that a later checkpoint superseded (an
        object-store outage during one upload, say) is reported in `skipped`, not raised: nothing is lost, and
        no resume ever reads it. A failure of the newest commit is raised: the segment's end state isn't durable."""
        with contextlib.suppress(Exception):  # a failed copy is reported by that step's commit, below
            self.wait_staging()
        failures: list[tuple[int, BaseException]] = []
        try:
            for step, fut in self._pending:
                try:
                    fut.result()
                except Exception as exc:
                    failures.append((step, exc))
                    continue
                for failed_step, exc in failures:
                    logger.warning("checkpoint step %d was not committed (%s); step %d supersedes it",
                                   failed_step, exc, step)
                    self.skipped.append((failed_step, f"{type(exc).__name__}: {exc}"))
                failures.clear()
        finally:
            self._pending.clear()
        if failures:
            raise failures[0][1]

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._writer.shutdown(wait=True)
            self._uploader.shutdown(wait=True)
            self._puts.shutdown(wait=True)
            self._stager.close()
            if self.replica is not None:
                self.replica.clear()

    # --------------------------------------------------------------- restore

    def latest(self) -> tuple[CheckpointRef | None, list[tuple[int, list[str]]]]:
        """The checkpoint to resume from (peers' memory after an in-segment restart, else the newest committed one,
        by its manifest: no checkpoint byte is read to choose it), and the corrupt ones skipped on the way (none
        here: a corrupt chunk is found while loading; `restore` handles it)."""
        if self.replica is not None and self.restart_count > 0:
            ref = self._from_memory()
            if ref is not None:
                return ref, []
        ref = self._newest_committed(below=None)
        if ref is not None:
            self.stats["restored_from"] = "object_store"
        return ref, []

    def _newest_committed(self, below: int | None) -> CheckpointRef | None:
        """The newest committed, unquarantined checkpoint (before step `below`): rank 0 lists the job's checkpoints
        and reads manifests only, then broadcasts the choice."""
        found = newest_committed(self.store, self.job_prefix, below=below) if self.ctx.is_main else None
        return self._broadcast(found)

    def restore(self, load: Callable[[CheckpointRef], Any]) -> tuple[CheckpointRef | None, list[tuple[int, list[str]]]]:
        """Load the newest checkpoint that loads, with `load(ref)` (every rank calls this together). A checkpoint
        found corrupt while loading (every rank raises CheckpointCorruptError together, nothing loaded yet) is
        quarantined by rank 0 and the one before it is tried. Returns the checkpoint loaded (None: a fresh start)
        and the corrupt ones skipped, with their problems."""
        ref, skipped = self.latest()
        while ref is not None:
            try:
                load(ref)
                return ref, skipped
            except CheckpointCorruptError as exc:
                if ref.manifest.get("source") == "memory":
                    raise
                logger.warning("checkpoint step %d is corrupt, resuming from the one before it: %s", ref.step,
                               "; ".join(exc.problems[:5]))
                if self.ctx.is_main:
                    quarantine(self.store, ref, exc.problems)
                skipped.append((ref.step, exc.problems))
                self._barrier()
                ref = self._newest_committed(below=ref.step)
                if ref is not None:
                    self.stats["restored_from"] = "object_store"
        self.stats["restored_from"] = None
        return None, skipped

    def _from_memory(self) -> CheckpointRef | None:
        """The newest step every shard of which some rank holds in memory; its files' bytes (every shard, on every
        rank) stay in memory for `load`, which reads them without writing a folder."""
        assert self.replica is not None
        step, holders = self.replica.newest_complete()
        if step is None:
            return None
        self._memory = (step, self.replica.fetch_all(step, holders))
        self.stats["restored_from"] = "memory"
        logger.info("restoring step %d from in-memory replicas (restart %d)", step, self.restart_count)
        return CheckpointRef(step, step_prefix(self.job_prefix, step), {"step": step, "source": "memory", "files": []})

    def _memory_files(self, ref: CheckpointRef) -> dict[str, torch.Tensor]:
        if self._memory is None or self._memory[0] != ref.step:
            raise CheckpointCorruptError(f"checkpoint step {ref.step}: its in-memory replica was already loaded or "
                                         "released; call latest() again")
        return self._memory[1]

    def local_folder(self, ref: CheckpointRef) -> Path:
        """The node-local folder holding `ref`'s files: from memory replicas, or every file sha256-verified against
        the manifest (rank 0 verified its node's copy in `latest`; each other node's local rank 0 does it here)."""
        if ref.manifest.get("source") == "memory":  # for readers that need files: write the replica bytes out
            folder = self.staging / "memory" / f"step-{ref.step:010d}"
            if self.ctx.local_rank == 0:
                shutil.rmtree(folder, ignore_errors=True)
                for name, data in self._memory_files(ref).items():
                    (folder / name).parent.mkdir(parents=True, exist_ok=True)
                    (folder / name).write_bytes(memoryview(data.numpy()))
            self._barrier()
            return folder
        folder = self._folder(ref.step)
        problems: list[str] = []
        error = ""
        if self.ctx.local_rank == 0:  # one copy per node, each file verified (files already there are not read)
            try:
                problems = materialize(self.store, ref, folder)
            except Exception as exc:  # a store failure: still reach the gather below, peers wait in it
                error = f"{type(exc).__name__}: {exc}"
        outcomes = self._gather((problems, error))
        errors = [e for _, e in outcomes if e]
        if errors:  # the store failed, not the checkpoint: nothing to quarantine
            raise RuntimeError(f"checkpoint step {ref.step}: reading it failed: {'; '.join(errors)}")
        everyone = [p for ps, _ in outcomes for p in ps]
        if everyone:
            raise CheckpointCorruptError(f"checkpoint step {ref.step}: {'; '.join(everyone)}", everyone)
        self._known = referenced_chunks(ref.files)
        return folder

    def load(self, ref: CheckpointRef, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        t0 = time.perf_counter()
        rng_name = f"rng-rank{self.ctx.rank:05d}.safetensors"
        rng: dict[str, torch.Tensor] | None = None
        if ref.manifest.get("source") == "memory":  # straight from the replica bytes: no folder, no file writes
            files = self._memory_files(ref)
            reader: SafeFileSystemReader = SafeMemoryReader(files)
            if rng_name in files:
                rng = load_safetensors(files[rng_name].numpy().tobytes())
        elif any("chunks" not in f for f in ref.files):  # a checkpoint from before content-defined chunks
            folder = self.local_folder(ref)
            reader = SafeFileSystemReader(str(folder))
            if (folder / rng_name).is_file():
                rng = load_file(str(folder / rng_name))
        else:
            try:
                metadata = read_metadata_once(self.store, self.job_prefix, ref.files, group=self._pg,
                                              is_reader=self.ctx.is_main)
            except RestoreReadError as exc:
                raise _restore_error(ref, exc) from None
            reader = StoreRangeReader(self.store, self.job_prefix, ref.files, metadata, group=self._pg,
                                      extra_files=[rng_name], local_copy=self._folder(ref.step))
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        try:
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), process_group=self._pg)
        except BaseException:  # DCP wraps every rank's failure in a CheckpointException (a BaseException)
            failure = getattr(reader, "failure", None)
            if failure is not None:  # the same on every rank: raised before anything was copied into the model
                raise _restore_error(ref, failure) from None
            raise
        if isinstance(reader, StoreRangeReader):
            if rng_name in reader.extra:
                rng = load_safetensors(reader.extra[rng_name])
            self._known = referenced_chunks(ref.files)
            self.stats["restore_bytes"] = {"store": reader.fetched_bytes, "local": reader.local_bytes,
                                           "peers": reader.received_bytes}
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if rng is not None:
            restore_rng(rng)
        self._memory = None  # the mapped / received bytes are released
        self.stats["restore_s"] = time.perf_counter() - t0


def _fence_pause(step: int) -> Callable[[], None] | None:
    """A test point ($TRAINFORGE_TEST_FENCE_PAUSE=STEP:FOLDER): rank 0 stops between reading the fence and its
    conditional write for checkpoint STEP, writes FOLDER/paused and waits (at most 300 s) for FOLDER/resume, so a
    test can start a newer attempt in between (tests/integration/test_fence.py)."""
    spec = os.environ.get("TRAINFORGE_TEST_FENCE_PAUSE", "")
    if not spec or int(spec.split(":", 1)[0]) != step:
        return None
    folder = Path(spec.split(":", 1)[1])

    def pause() -> None:
        (folder / "paused").write_text(str(os.getpid()))
        deadline = time.monotonic() + 300
        while not (folder / "resume").exists() and time.monotonic() < deadline:
            time.sleep(0.05)

    return pause


def _restore_error(ref: CheckpointRef, exc: RestoreReadError) -> Exception:
    """A checkpoint found corrupt (CheckpointCorruptError: `restore` moves to the one before it), or a store that
    failed while reading it (the checkpoint may be fine: nothing is quarantined)."""
    if exc.problems:
        return CheckpointCorruptError(f"checkpoint step {ref.step}: {exc}", exc.problems)
    return RuntimeError(f"checkpoint step {ref.step}: {exc}")


def load_model_weights(folder: Path, model: torch.nn.Module) -> None:
    """Single-process read of a checkpoint's model weights (evaluation, export): no process group needed.
    Works for any layout it was saved under (DDP, FSDP shards, TP): DCP reassembles the full tensors; a DeepSpeed
    engine's checkpoint is consolidated from its ZeRO partitions instead."""
    if is_deepspeed_checkpoint(folder):
        load_deepspeed_weights(folder, model)
        return
    sd = model.state_dict()
    state = {"model": sd}
    dcp.load(state, storage_reader=SafeFileSystemReader(str(folder)), planner=SafeLoadPlanner(), no_dist=True)
    model.load_state_dict(state["model"])
