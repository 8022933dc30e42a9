"""Plain data parallelism: DDP over the mesh's data-parallel group; accumulation skips the all-reduce
(`no_sync`) on all but the last micro-batch.

Resumption is bit for bit only if every step reduces each gradient element in the same order. DDP's buckets are
laid out in parameter order for the first iteration and rebuilt in gradient-ready order after it, and the collective
sums an element in an order that depends on its position in the bucket: so a gang resumed at step k reduced step
k+1 with the first layout where the uninterrupted run used the rebuilt one, and with more than two data-parallel
ranks (where a + b + c is not c + a + b in floating point) the weights drifted by a few ulps (seen on 6 gloo ranks,
resumed across hosts: tests/integration/test_many_hosts.py). The rebuild is skipped when DDP looks for unused
parameters, so every iteration of every attempt uses the same layout; the price is one traversal of the autograd
graph per step in C++ (a small fraction of a millisecond per hundred parameters)."""

from __future__ import annotations

import warnings

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel as DDP

# Said once per worker when every parameter was used, which is expected here (the flag is set for the layout's sake).
warnings.filterwarnings("ignore", message=r"find_unused_parameters=True was specified in DDP constructor")


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, device_ids: list[int] | None = None) -> DDP:
    return DDP(model, process_group=dp_mesh.get_group(), device_ids=device_ids, find_unused_parameters=True)
