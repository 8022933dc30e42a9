"""Process-group set-up from torchrun's environment, and the clean shutdown gloo needs.

Traps handled here (measured on this hardware, see shared/ENVIRONMENT.md):
- a short collective timeout so a hang becomes a failure, not a 30-minute stall;
- the static rendezvous (agent store, fresh per attempt), not c10d, so restarts reconnect cleanly;
- destroy the process group only after the wrapped model is gone (gc + barrier), else gloo aborts at exit.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, timeout_s: float) -> DistContext:
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if torch.cuda.is_available():
            torch.cuda.set_device(local)
            device, backend = torch.device("cuda", local), "cpu:gloo,cuda:nccl"
        else:
            device, backend = torch.device("cpu"), "gloo"
        if world > 1 and not dist.is_initialized():
            # env:// under torchrun uses the agent's store, which torch recreates per restart attempt, so a
            # restarted worker never reads a dead attempt's addresses.
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
        return cls(rank, world, local, device, backend)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def all_reduce_mean(self, value: float) -> float:
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item()) / self.world_size


def shutdown(ctx: DistContext) -> None:
    gc.collect()
    if dist.is_initialized():
        try:
            ctx.barrier()
        finally:
            dist.destroy_process_group()
