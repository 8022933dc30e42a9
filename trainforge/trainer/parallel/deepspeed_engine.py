"""DeepSpeed ZeRO as the alternative engine (`parallelism.engine: deepspeed`).

The config is generated from the spec (`deepspeed_config`, pure); `build_deepspeed` hands the model and a torch
AdamW to `deepspeed.initialize`. ZeRO stage from the layout's sharding (plan/support.py DEEPSPEED_ZERO_STAGE, the
planner's memory and traffic model of each): none -> 0 (replicated, gradients all-reduced, as DDP), shard-optimizer
-> 1 (optimizer states sharded), shard-grad-op -> 2, full-shard -> 3 (an explicit `zero_stage` in the layout wins).
DeepSpeed runs the micro-batch accumulation itself (`engine.backward` scales by 1/accumulation, `engine.step` steps
on the boundary). On CPU it uses gloo (its CPU accelerator without oneCCL).

Checkpoints: DeepSpeed's partitioned optimizer is not a torch.optim.Optimizer that DCP can save, so every rank
writes DeepSpeed's own checkpoint (`engine.save_checkpoint(step_folder, tag="ds")`: model states, each rank's
ZeRO partition of the fp32 master weights and optimizer state) plus its RNG state into the node-local staging
folder, and the platform's Checkpointer commits those files (`commit_files`: deduplicated chunks, sha256 per file,
manifest last, create-only) like its own. Resume takes the newest committed checkpoint whose files all verify
against the manifest (`Checkpointer.latest` / `local_folder`), drops any file in the folder that the manifest does
not list, and only then calls `engine.load_checkpoint(load_module_strict=True)`: DeepSpeed's files are torch
pickles, loaded only from the job's own verified checkpoint and through `safe_deepspeed_load` (an allow-list). The LR is a pure function of the step and the data
order of (seed, position), so model, ZeRO partitions, LR and data position all continue exactly.
Evaluation/export consolidate the ZeRO partitions with `get_fp32_state_dict_from_zero_checkpoint`
(`load_deepspeed_weights`, in `trainer/checkpointing/deepspeed_format.py` with the rest of the format).
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from trainforge.plan.support import DEEPSPEED_ZERO_STAGE, check_supported
from trainforge.trainer.checkpoint import CheckpointCorruptError, capture_rng, restore_rng
from trainforge.trainer.checkpointing.deepspeed_format import (
    DS_TAG,
    deepspeed_rank_files,
    safe_deepspeed_load,
)
from trainforge.trainer.parallel.activation_checkpointing import apply_ac
from trainforge.trainer.parallel.parallelize import cross_entropy

logger = logging.getLogger(__name__)


def deepspeed_config(layout: dict[str, Any], training: dict[str, Any], world_size: int) -> dict[str, Any]:
    sharding = layout.get("sharding", "none")
    # The planner and `validate` refuse these from the same rules before allocation (plan/support.py).
    check_supported(engine="deepspeed", sharding=sharding, tp=layout.get("tp", 1), pp=layout.get("pp", 1),
                    ep=layout.get("ep", 1))
    micro = layout.get("micro_batch_size", 1)
    accumulation = training["global_batch_size"] // (world_size * micro)
    cfg: dict[str, Any] = {
        "train_batch_size": training["global_batch_size"],
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "zero_optimization": {"stage": layout.get("zero_stage", DEEPSPEED_ZERO_STAGE[sharding])},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if training.get("grad_clip"):
        cfg["gradient_clipping"] = training["grad_clip"]
    if training.get("precision") == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _private_extensions_dir() -> None:
    """DeepSpeed JIT-compiles the C++ ops a config asks for (CPU Adam, async I/O, ...) into torch's extensions
    cache, ~/.cache/torch_extensions by default, keyed by op name only. The build file names this interpreter's
    include paths, so two environments sharing that cache (a CI clone's venv and a developer's) rebuild the op
    at every switch (minutes on 2 cores), serialised on a lock file that a killed build leaves behind for every
    later job to wait on forever. One folder per Python environment ends both; a TORCH_EXTENSIONS_DIR the user
    set wins."""
    if "TORCH_EXTENSIONS_DIR" not in os.environ:
        key = hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
        os.environ["TORCH_EXTENSIONS_DIR"] = str(Path.home() / ".cache" / "torch_extensions" / f"env-{key}")


def _no_shm_collective() -> None:
    """On CPU, DeepSpeed's torch backend JIT-compiles a C++ shared-memory collective at `init_distributed`
    (deepspeed/comm/torch.py `build_shm_op`) that only its `inference_all_reduce` calls: training's collectives are
    torch.distributed's (gloo here). The compile takes about a minute of both cores on a fresh environment, inside
    the gang's start (it ate the rendezvous wait of whichever job came first), and every later process still pays
    a build check to load it. Training never reaches it, so on CPU the backend is built without it; inference
    all-reduce then falls back to torch.distributed as it does where the op is missing. On GPUs the accelerator
    has no such op: nothing changes there."""
    if torch.cuda.is_available():
        return
    # By module path: the attribute `deepspeed.comm.torch` is torch itself (deepspeed/comm imports it).
    backend = importlib.import_module("deepspeed.comm.torch")
    if hasattr(backend, "build_shm_op"):
        backend.build_shm_op = lambda: None


def build_deepspeed(model: torch.nn.Module, layout: dict[str, Any], training: dict[str, Any],
                    world_size: int) -> Any:
    from trainforge._optional import require

    deepspeed = require("deepspeed", purpose="parallelism.engine: deepspeed")
    _private_extensions_dir()
    _no_shm_collective()
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    # Recomputation as the native engine applies it (the planner sized the layout's memory with it).
    apply_ac(model, layout.get("activation_checkpointing", "none"))
    opt = training["optimizer"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt["lr"], betas=tuple(opt["betas"]), eps=opt["eps"],
                                  weight_decay=opt["weight_decay"])
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                      config=deepspeed_config(layout, training, world_size))
    return engine


def deepspeed_backward(engine: Any, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> float:
    """Forward and backward over this rank's micro-batches; returns their mean loss. DeepSpeed counts micro-batches
    in `engine.step()`, which steps the optimizer on the accumulation boundary: it is called here after every
    micro-batch but the last; the caller's `engine.step()` is the boundary's (trainer/engine.py DeepSpeedEngine)."""
    total = 0.0
    for i, (x, y) in enumerate(zip(inputs, targets, strict=True)):
        loss = cross_entropy(engine(x), y)
        engine.backward(loss)
        if i < len(inputs) - 1:
            engine.step()
        total += float(loss.detach()) / len(inputs)
    return total


def save_deepspeed(engine: Any, ckpt: Any, step: int, fields: dict[str, Any]) -> float:
    """DeepSpeed writes its checkpoint for `step` into the node-local staging folder (every rank, synchronously);
    the Checkpointer uploads and commits it in the background. Returns the seconds the loop was blocked."""
    t0 = time.perf_counter()
    folder = ckpt.step_folder(step)
    folder.mkdir(parents=True, exist_ok=True)
    for name in deepspeed_rank_files(folder, ckpt.ctx.rank):  # leftovers of an attempt that died uncommitted
        (folder / name).unlink(missing_ok=True)
    save_file(capture_rng(), str(folder / f"rng-rank{ckpt.ctx.rank:05d}.safetensors"))
    engine.save_checkpoint(str(folder), tag=DS_TAG, save_latest=False)  # ends with a barrier on every rank
    ckpt.commit_files(step, deepspeed_rank_files(folder, ckpt.ctx.rank), fields)
    return time.perf_counter() - t0


def load_deepspeed(engine: Any, ckpt: Any, ref: Any) -> None:
    """Restore model, ZeRO partitions (fp32 master weights + optimizer state), DeepSpeed's step counters and this
    rank's RNG from a committed checkpoint. Only files the manifest lists (and that were sha256-verified) are
    loaded: DeepSpeed's checkpoint files are pickles."""
    if ref.manifest.get("engine") != "deepspeed" or ref.manifest.get("source") == "memory":
        raise CheckpointCorruptError(f"checkpoint step {ref.step} was not written by the deepspeed engine "
                                     f"(engine {ref.manifest.get('engine', 'native')!r}); it cannot resume here")
    folder = ckpt.local_folder(ref)  # every listed file sha256-verified against the manifest on this node
    listed = {f["name"] for f in ref.files}
    if ckpt.ctx.local_rank == 0 and (folder / DS_TAG).is_dir():
        for p in (folder / DS_TAG).iterdir():  # DeepSpeed globs its folder: nothing unverified may be there
            if f"{DS_TAG}/{p.name}" not in listed:
                p.unlink()
    if dist.is_initialized():
        dist.barrier()
    with safe_deepspeed_load():  # DeepSpeed's files are pickles: restricted unpickling (deepspeed_format.py)
        path, _ = engine.load_checkpoint(str(folder), tag=DS_TAG, load_module_strict=True,
                                         load_optimizer_states=True, load_lr_scheduler_states=True)
    if path is None:
        raise CheckpointCorruptError(f"checkpoint step {ref.step}: DeepSpeed found no checkpoint in {folder}")
    rng_file = folder / f"rng-rank{ckpt.ctx.rank:05d}.safetensors"
    if rng_file.is_file():
        restore_rng(load_file(str(rng_file)))
