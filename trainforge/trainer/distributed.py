"""Process-group set-up from torchrun's environment, and the clean shutdown gloo needs.

Traps handled here (measured on this hardware, see shared/ENVIRONMENT.md):
- a short collective timeout so a hang becomes a failure, not a 30-minute stall;
- the agent's store prefixed per restart attempt, so restarted workers reconnect cleanly;
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
            # The agent's store outlives a restart attempt: prefix every key with the attempt so restarted workers
            # never read the dead attempt's addresses (measured: plain env:// hangs or fails in gloo connect after a
            # torchrun restart; this is clean). The short timeout turns a hang into a failure.
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                 timeout=timedelta(seconds=timeout_s))
            dist.init_process_group(backend, store=dist.PrefixStore(f"attempt_{attempt}", base), rank=rank,
                                    world_size=world, timeout=timedelta(seconds=timeout_s))
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
