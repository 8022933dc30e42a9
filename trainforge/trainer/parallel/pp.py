"""Pipeline parallelism with torch.distributed.pipelining: split by layer count, GPipe / 1F1B / interleaved 1F1B.

The model is cut into pp * vpp chunks of consecutive layers (`split_layers`, balanced by count; the planner's
per-layer cost is uniform for a homogeneous decoder). Chunk c runs on pp rank c % pp (the "looped" placement of
interleaved 1F1B, Narayanan et al. 2021), so rank r holds chunks r, r + pp, ... A model opts in by providing
`pipeline_chunk(layer_ids, first, last)` (a stage sharing its modules) and `keep_only(...)` (drop the rest), so the
rank's model keeps the full model's parameter names for the optimizer and the checkpoint.
Bubble fraction of 1F1B/GPipe: (p - 1) / (m + p - 1); interleaved divides the bubble by v.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

# The schedules' class names in torch.distributed.pipelining, imported only when a job pipelines: the module pulls in
# torch._dynamo, about 1 s of CPU in every worker (a quarter of a worker's imports) that a pp=1 job never uses.
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B"}


def split_layers(num_layers: int, num_chunks: int) -> list[range]:
    """Consecutive layer ranges, sizes differing by at most one (earlier chunks get the extra layers)."""
    if num_chunks > num_layers:
        raise ValueError(f"{num_chunks} pipeline chunks exceed layers ({num_layers})")
    base, extra = divmod(num_layers, num_chunks)
    out, start = [], 0
    for c in range(num_chunks):
        size = base + (1 if c < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Idle fraction of a 1F1B/GPipe pipeline: (p-1)/(m+p-1); interleaving shrinks the bubble v times."""
    bubble = (p - 1) / v
    return bubble / (m + bubble)


@dataclass
class Pipeline:
    schedule: Any
    chunks: list[nn.Module]
    has_first: bool
    has_last: bool


def build_pipeline_chunks(model: nn.Module, pp_rank: int, pp: int, vpp: int) -> tuple[list[nn.Module], list[int]]:
    """This rank's chunks (sharing modules with `model`, which is pruned to them) and their stage indices."""
    if not hasattr(model, "pipeline_chunk"):
        raise ValueError(f"{type(model).__name__} does not support pipeline parallelism (no pipeline_chunk method)")
    layer_keys = list(model.layers.keys())  # type: ignore[union-attr]
    ranges = split_layers(len(layer_keys), pp * vpp)
    n_stages = pp * vpp
    stage_ids = [pp_rank + i * pp for i in range(vpp)]
    chunks = [model.pipeline_chunk([layer_keys[i] for i in ranges[s]], s == 0, s == n_stages - 1)  # type: ignore
              for s in stage_ids]
    owned = {layer_keys[i] for s in stage_ids for i in ranges[s]}
    model.keep_only(owned, 0 in stage_ids, n_stages - 1 in stage_ids)  # type: ignore[operator]
    return chunks, stage_ids


def build_schedule(chunks: list[nn.Module], stage_ids: list[int], pp_mesh: DeviceMesh, *, schedule: str,
                   n_microbatches: int, loss_fn: Callable[..., torch.Tensor], device: torch.device) -> Pipeline:
    pp = pp_mesh.size()
    n_stages = pp * len(chunks)
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r} is not one of {sorted(SCHEDULES)}")
    if len(chunks) > 1 and schedule != "interleaved-1f1b":
        raise ValueError(f"{len(chunks)} virtual stages need the interleaved-1f1b schedule, not {schedule}")
    from torch.distributed import pipelining

    group = pp_mesh.get_group()
    stages = [pipelining.PipelineStage(c, s, n_stages, device, group=group)
              for c, s in zip(chunks, stage_ids, strict=True)]
    cls = getattr(pipelining, SCHEDULES[schedule])
    sched = cls(stages if cls is pipelining.ScheduleInterleaved1F1B else stages[0], n_microbatches=n_microbatches,
                loss_fn=loss_fn)
    return Pipeline(sched, chunks, 0 in stage_ids, n_stages - 1 in stage_ids)
