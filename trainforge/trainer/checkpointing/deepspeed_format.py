"""The DeepSpeed engine's checkpoint format: which files of a step folder are DeepSpeed's, and how one process
reads its weights back (evaluation, export).

It sits below both `trainer/checkpoint.py` (which reads any checkpoint's weights, DCP or DeepSpeed) and
`trainer/parallel/deepspeed_engine.py` (which writes them), so neither imports the other's module to know the
format. `deepspeed` itself is imported only when a DeepSpeed checkpoint is consolidated.

Nothing DeepSpeed reads is unpickled with the full machinery: DeepSpeed's files are torch pickles and DeepSpeed
calls `torch.load(..., weights_only=False)` (its checkpoint engine and `zero_to_fp32`), so a crafted file in a
checkpoint path could run code on load. `safe_deepspeed_load()` makes every `torch.load` DeepSpeed makes inside
it a `weights_only=True` load (torch's restricted unpickler: tensors and plain containers) that also accepts the
few plain classes DeepSpeed stores (`DEEPSPEED_GLOBALS`); anything else is refused with `UnsafeCheckpointError`.
"""

from __future__ import annotations

import contextlib
import importlib
import pickle
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from trainforge.trainer.checkpointing.safe_dcp import UnsafeCheckpointError

DS_TAG = "ds"  # DeepSpeed's checkpoint tag: its files live in `<step folder>/ds/`


def deepspeed_rank_files(folder: Path, rank: int) -> list[str]:
    """The files of DeepSpeed's checkpoint in `folder` that `rank` wrote (relative names), plus its RNG file.
    Each rank writes its ZeRO partition (`[bf16_]zero_pp_rank_{r}_mp_rank_XX_*`); the model states
    (`mp_rank_XX_model_states.pt`) come from rank 0 under ZeRO-1/2 (under ZeRO-3 they are per rank and matched
    above). DeepSpeed's recovery scripts (zero_to_fp32.py) are not part of the checkpoint."""
    own = re.compile(rf"^(?:bf16_)?zero_pp_rank_{rank}_mp_rank_\d+_.*\.pt$")
    rank0 = re.compile(r"^mp_rank_\d+_model_states\.pt$")
    ds = folder / DS_TAG
    names = sorted(f"{DS_TAG}/{p.name}" for p in ds.iterdir() if p.is_file()
                   and (own.match(p.name) or (rank == 0 and rank0.match(p.name)))) if ds.is_dir() else []
    return [*names, f"rng-rank{rank:05d}.safetensors"]


def is_deepspeed_checkpoint(folder: Path) -> bool:
    return (folder / DS_TAG).is_dir() and any((folder / DS_TAG).glob("*model_states.pt"))


def load_deepspeed_weights(folder: Path, model: torch.nn.Module) -> None:
    """Single-process: consolidate a DeepSpeed checkpoint's ZeRO partitions into a plain fp32 state dict and load
    it strictly (evaluation, export). `folder` must be a materialized, sha256-verified committed checkpoint."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

    with safe_deepspeed_load():
        state = get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=DS_TAG)
    # DeepSpeed names the ZeRO partitions by the engine model's parameter names, which carry the activation
    # checkpoint wrapper's prefix when recomputation was on; the wrapper's own state dicts drop it.
    state = {k.replace(_CHECKPOINT_PREFIX, ""): v for k, v in state.items()}
    own = model.state_dict()
    model.load_state_dict({k: v.to(own[k].dtype) if k in own else v for k, v in state.items()}, strict=True)


# The classes DeepSpeed pickles into its checkpoint files besides tensors and plain containers (found with
# `torch.serialization.get_unsafe_globals_in_checkpoint` on the files tests/distributed/test_deepspeed_checkpoint.py
# writes). Plain data: enums, the loss scaler's attributes, the config namespace. Nothing with a `__reduce__` that
# calls out.
DEEPSPEED_GLOBALS: tuple[str, ...] = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)

_PATCH = threading.Lock()


def _resolve(name: str) -> Any:
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr)


@contextlib.contextmanager
def safe_deepspeed_load() -> Iterator[None]:
    """Inside: `torch.load` is restricted (weights_only + `DEEPSPEED_GLOBALS`) for whoever calls it — DeepSpeed looks
    `torch.load` up at call time in both of its readers, so swapping the attribute is the one hook that covers them.
    Held under a lock: one restore at a time per process (resume and consolidation are never concurrent)."""
    allowed = [_resolve(name) for name in DEEPSPEED_GLOBALS]
    original = torch.load

    def restricted(f: Any, map_location: Any = None, *args: Any, weights_only: Any = None, **kwargs: Any) -> Any:
        try:
            with torch.serialization.safe_globals(allowed):
                return original(f, map_location, *args, weights_only=True, **kwargs)
        except pickle.UnpicklingError as exc:
            first = str(exc).strip().splitlines()
            raise UnsafeCheckpointError(f"refused to unpickle {f}: not tensors or DeepSpeed's plain state "
                                        f"({first[-1] if first else exc})") from None

    with _PATCH:
        torch.load = restricted  # type: ignore[assignment]
        try:
            yield
        finally:
            torch.load = original  # type: ignore[assignment]
