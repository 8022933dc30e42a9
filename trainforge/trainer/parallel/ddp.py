"""Plain data parallelism: DDP over the mesh's data-parallel group; accumulation skips the all-reduce
(`no_sync`) on all but the last micro-batch."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel as DDP


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, device_ids: list[int] | None = None) -> DDP:
    return DDP(model, process_group=dp_mesh.get_group(), device_ids=device_ids)
