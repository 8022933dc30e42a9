"""The device mesh: one `DeviceMesh` for the whole job, with named axes. Process groups are created only here.

Rank order matches the scheduler's topology mapping (trainforge.infra.scheduler): TP innermost (consecutive ranks,
one node, NVLink), then PP, then the data-parallel axes outermost. So for dp=2, pp=2, tp=2 rank 5 is
(dp=1, pp=0, tp=1). Expert parallelism borrows data-parallel ranks (torchtitan's convention): with ep > 1 the dp
axis is split into (dp_mod_ep, ep), consecutive dp ranks forming one expert group.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainforge.plan.support import check_supported


class MeshAxis(StrEnum):
    DP_REPLICATE = "dp_replicate"
    """Data-parallel replicas (DDP, or the replicate side of HSDP)."""
    DP_SHARD = "dp_shard"
    """Data-parallel ranks that shard parameters/gradients/optimizer states (FSDP)."""
    DP_MOD_EP = "dp_mod_ep"
    """With expert parallelism: replicas of the same expert shard."""
    EP = "ep"
    """Expert parallelism: ranks that hold different experts and exchange tokens with all-to-all."""
    PP = "pp"
    TP = "tp"
    DP = "dp"
    """Flattened: every data-parallel axis together (batch split, loss averaging, dense gradient reduction)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelDims:
    """Degrees of every mesh axis, derived from the plan's layout. Pure: validated without any process group."""

    dp_replicate: int
    dp_shard: int
    ep: int
    pp: int
    tp: int
    world_size: int

    def __post_init__(self) -> None:
        dp = self.dp_replicate * self.dp_shard
        if dp * self.pp * self.tp != self.world_size:
            raise ValueError(f"dp_replicate({self.dp_replicate}) * dp_shard({self.dp_shard}) * pp({self.pp}) * "
                             f"tp({self.tp}) != world_size({self.world_size})")
        if dp % self.ep:
            raise ValueError(f"ep ({self.ep}) must divide dp ({dp}): expert parallelism borrows data-parallel ranks")
        # The planner and `validate` reject these layouts from the same rules (plan/support.py), before allocation.
        check_supported(tp=self.tp, pp=self.pp, ep=self.ep, fsdp=self.dp_shard > 1)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @classmethod
    def from_layout(cls, layout: dict[str, Any], world_size: int, local_world_size: int | None = None) -> ParallelDims:
        dp, tp, pp, ep = layout["dp"], layout.get("tp", 1), layout.get("pp", 1), layout.get("ep", 1)
        sharding = layout.get("sharding", "none")
        check_supported(engine="native", sharding=sharding)
        if sharding in ("shard-grad-op", "full-shard"):
            replicate, shard = 1, dp
        elif sharding == "hybrid-shard":
            # Shard over the data-parallel ranks of one node, replicate across nodes (the planner's rule).
            local = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
            shard = math.gcd(dp, max(1, local // (tp * pp)))
            if "hsdp_shard_degree" in layout:
                shard = layout["hsdp_shard_degree"]
            replicate = dp // shard
        else:
            replicate, shard = dp, 1
        return cls(dp_replicate=replicate, dp_shard=shard, ep=ep, pp=pp, tp=tp, world_size=world_size)

    def mesh_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """Outermost first. Size-1 axes are kept so every name always exists."""
        if self.ep > 1:
            return ((self.dp // self.ep, self.ep, self.pp, self.tp),
                    (MeshAxis.DP_MOD_EP, MeshAxis.EP, MeshAxis.PP, MeshAxis.TP))
        return ((self.dp_replicate, self.dp_shard, self.pp, self.tp),
                (MeshAxis.DP_REPLICATE, MeshAxis.DP_SHARD, MeshAxis.PP, MeshAxis.TP))

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each axis (pure: the same row-major order init_device_mesh uses)."""
        shape, names = self.mesh_shape()
        out: dict[str, int] = {}
        for size, name in zip(reversed(shape), reversed(names), strict=True):
            out[str(name)] = rank % size
            rank //= size
        first, second = names[0], names[1]
        out[MeshAxis.DP] = out[first] * shape[1] + out[second]
        return out


def build_mesh(dims: ParallelDims, device_type: str = "cpu") -> DeviceMesh:
    """The job's mesh with a flattened `dp` axis. Every process group of the job is created here."""
    shape, names = dims.mesh_shape()
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=tuple(str(n) for n in names))
    mesh[(str(names[0]), str(names[1]))]._flatten(MeshAxis.DP)
    return mesh
