"""The DeepSpeed engine's checkpoint format: which files of a step folder are DeepSpeed's, and how one process
reads its weights back (evaluation, export).

It sits below both `trainer/checkpoint.py` (which reads any checkpoint's weights, DCP or DeepSpeed) and
`trainer/parallel/deepspeed_engine.py` (which writes them), so neither imports the other's module to know the
format. `deepspeed` itself is imported only when a DeepSpeed checkpoint is consolidated.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

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

    state = get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=DS_TAG)
    own = model.state_dict()
    model.load_state_dict({k: v.to(own[k].dtype) if k in own else v for k, v in state.items()}, strict=True)
