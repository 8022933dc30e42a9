"""Worker for test_ddp_reduction.py (under torchrun, gloo): one backward on the same weights and batch in each of two
iterations of DDP (the first on DDP's initial bucket layout, the second on the one it rebuilds), for each gradient
reduction; rank 0 writes the bucket layouts and whether the reduced gradients are bitwise the rank-order mean."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

from trainforge.trainer.parallel.ddp import GradientReduction


class Recording(GradientReduction):
    """The reduction, recording each bucket's parameters (their index in the model) in the order DDP lays them out."""

    def __init__(self, group: dist.ProcessGroup, order: str, index: dict[int, int]):
        super().__init__(group, order)
        self.index, self.buckets = index, []  # type: list[list[int]]

    def hook(self, state, bucket):  # type: ignore[no-untyped-def]
        self.buckets.append([self.index[id(p)] for p in bucket.parameters()])
        return super().hook(state, bucket)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 4))


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    # Magnitudes differ by rank so that the order of the sum shows in the last bits.
    return torch.randn(32, 16, generator=g) * (1 + 3 * rank), torch.randn(32, 4, generator=g)


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    x, y = batch(rank)

    plain = model()
    nn.functional.mse_loss(plain(x), y).backward()
    local = [p.grad.clone() for p in plain.parameters()]
    expected = []
    for g in local:  # the rank-order mean, as the fixed-order reduction computes it: g0/n + g1/n + ... in turn
        parts = [torch.empty_like(g) for _ in range(n)]
        dist.all_gather(parts, g / n)
        total = parts[0].clone()
        for part in parts[1:]:
            total.add_(part)
        expected.append(total)

    result: dict[str, object] = {}
    for order in ("fixed-order", "fast"):
        m = model()
        ddp = DDP(m, process_group=mesh.get_group())
        hook = Recording(mesh.get_group(), order, {id(p): i for i, p in enumerate(m.parameters())})
        ddp.register_comm_hook(None, hook.hook)
        grads, layouts = [], []
        for _ in range(2):
            m.zero_grad(set_to_none=True)
            hook.buckets = []
            nn.functional.mse_loss(ddp(x), y).backward()
            grads.append([p.grad.clone() for p in m.parameters()])
            layouts.append(hook.buckets)
        result[order] = {
            "layouts": layouts,
            "same_each_iteration": all(torch.equal(a, b) for a, b in zip(grads[0], grads[1], strict=True)),
            "rank_order_mean": all(torch.equal(a, e) for a, e in zip(grads[1], expected, strict=True))
            and all(torch.equal(a, e) for a, e in zip(grads[0], expected, strict=True)),
        }
    if rank == 0:
        out.write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
