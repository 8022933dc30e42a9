"""Plain data parallelism: DDP over the mesh's data-parallel group; accumulation skips the all-reduce
(`no_sync`) on all but the last micro-batch.

The gradient sum's order. DDP reduces the first iteration with its buckets laid out in parameter order and rebuilds
them in gradient-ready order after it, so every (re)start runs one step on a layout the steps after it do not use.
A ring all-reduce's summation order for an element follows its offset in the bucket: with more than two replicas
the resumed run's first step differs from the uninterrupted run's by a few ulps, and so does everything after it.
`fixed-order` (the default) sums every element in rank order whatever the layout: an all-to-all hands each rank
one slice of every replica's bucket, the rank adds the slices rank 0, 1, 2, ... in turn, and an all-gather returns
the sums. That is the same bytes per rank as the ring all-reduce (a reduce-scatter and an all-gather), and a resume
is bitwise the run it continues at its data-parallel degree, whatever it is. `fast` is torch's all-reduce.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel as DDP

REDUCTIONS = ("fixed-order", "fast")


class GradientReduction:
    """DDP's comm hook: the bucket's reduction (`fixed-order` or `fast`), and a callback when a bucket is issued
    (trainer/metrics.py stamps it to measure the communication left after backward)."""

    def __init__(self, group: dist.ProcessGroup, order: str = "fixed-order"):
        if order not in REDUCTIONS:
            raise ValueError(f"gradient reduction {order!r}: use one of {', '.join(REDUCTIONS)}")
        self.group, self.order = group, order
        self.size = dist.get_world_size(group)
        # Two addends sum alike in either order: with 2 replicas (or `fast`) torch's all-reduce is the reduction.
        self.exact = order == "fixed-order" and self.size > 2
        self.on_issue: Callable[[], None] | None = None
        self.blocked_s = 0.0
        """Seconds backward waited in the `fixed-order` collectives (issued in the hook, they block it), for the
        step-time split (trainer/metrics.py reads and resets it)."""

    def hook(self, state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects any annotation but GradBucket
        if self.on_issue is not None:
            self.on_issue()
        if not self.exact:
            return default_hooks.allreduce_hook(self.group, bucket)
        t0 = time.perf_counter()
        try:
            return fixed_order_allreduce(self.group, self.size, bucket.buffer())
        finally:
            self.blocked_s += time.perf_counter() - t0


def fixed_order_allreduce(group: dist.ProcessGroup, n: int, buffer: torch.Tensor) -> torch.futures.Future[Any]:
    """The mean of `buffer` over the group's ranks, each element summed in rank order (see the module's doc). As
    torch's all-reduce hook, each rank's share is divided by n before the sum.

    The two collectives are issued here, in the hook, one after the other, not the second from the first's
    completion callback: that callback runs on a worker thread of the process group, and a collective issued and
    waited on there deadlocked 6 gloo ranks (another bucket's collective held the other worker thread, in another
    order on each rank). In the hook the collectives go out in DDP's bucket order, the same on every rank. On CPU
    this gives up overlapping the reduction with the rest of the backward (bench/ddp_reduction.py measures it);
    under NCCL a collective only orders the streams and the host goes on."""
    flat = buffer.div_(n)
    pad = (-flat.numel()) % n
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    chunk = flat.numel() // n
    received = torch.empty_like(flat)
    dist.all_to_all_single(received, flat, group=group)
    parts = received.view(n, chunk)
    total = parts[0].clone()
    for i in range(1, n):  # rank order, one addend at a time: the order no layout changes
        total.add_(parts[i])
    gathered = torch.empty_like(flat)
    dist.all_gather_into_tensor(gathered, total, group=group)
    buffer.copy_(gathered[:buffer.numel()])
    done: torch.futures.Future[Any] = torch.futures.Future()
    done.set_result(buffer)
    return done


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, device_ids: list[int] | None = None,
              reduction: str = "fixed-order") -> tuple[DDP, GradientReduction]:
    group = dp_mesh.get_group()
    ddp = DDP(model, process_group=group, device_ids=device_ids)
    hook = GradientReduction(group, reduction)
    ddp.register_comm_hook(None, hook.hook)  # a bound method: DDP logs the hook's __qualname__
    return ddp, hook
