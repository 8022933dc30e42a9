"""Compose the parallelisms from the plan's layout (torchtitan's pattern), and run a step on the result.

Order: pipeline split -> TP -> EP -> activation checkpointing -> FSDP (per chunk) or DDP. The model is built in
full from the seed on every rank first, so every layout starts from bit-identical weights (and equals the
single-process reference); the parallelisms then shard what exists.
Which data-parallel wrapper: DDP for pure data parallelism with sharding `none` (its bucketed all-reduce is the
fastest replica path); FSDP2 for every sharding strategy and whenever DP is combined with TP or PP (DDP does not
compose with DTensor parameters or pipeline stages); a manual reduction for EP + DP (ep.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel as loss_parallel_ctx
from torch.nn.parallel import DistributedDataParallel as DDP

from trainforge.trainer.parallel.activation_checkpointing import apply_ac
from trainforge.trainer.parallel.ddp import GradientReduction, apply_ddp
from trainforge.trainer.parallel.ep import apply_ep, sync_ep_grads
from trainforge.trainer.parallel.fsdp import FSDPConfig, apply_fsdp, fsdp_mesh
from trainforge.trainer.parallel.mesh import MeshAxis, ParallelDims, build_mesh
from trainforge.trainer.parallel.pp import Pipeline, build_pipeline_chunks, build_schedule
from trainforge.trainer.parallel.tp import apply_tp


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """The mixed-precision context of the spec's `training.precision` (ParallelModel.precision_ctx)."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if precision == "fp16" and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.float16)
    return contextlib.nullcontext()


def _item(t: torch.Tensor | float) -> float:
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return float(t.detach()) if isinstance(t, torch.Tensor) else float(t)


@dataclass
class ParallelModel:
    """The parallelized model and how to run forward/backward, reduce gradients and clip on it."""

    model: nn.Module
    """What the optimizer and the checkpointer see (DDP/FSDP-wrapped; for PP only this rank's part)."""
    dims: ParallelDims
    coords: dict[str, int]
    mesh: DeviceMesh | None
    kind: str
    """`single`, `ddp`, `fsdp`, `ep` or `none` (TP/PP without data parallelism): the data-parallel path taken."""
    pipeline: Pipeline | None = None
    loss_parallel: bool = False
    sharding: str = "none"
    """The layout's sharding: how FSDP2 accumulates over a step's micro-batches (`_sync`)."""
    precision_ctx: Any = field(default=contextlib.nullcontext)
    reduction: GradientReduction | None = None
    """DDP's comm hook (kind `ddp` only): the gradient sum's order (parallel/ddp.py)."""

    @property
    def dp_rank(self) -> int:
        return self.coords[MeshAxis.DP]

    @property
    def core(self) -> nn.Module:
        return self.model.module if isinstance(self.model, DDP) else self.model

    def _loss_ctx(self) -> contextlib.AbstractContextManager[Any]:
        return loss_parallel_ctx() if self.loss_parallel else contextlib.nullcontext()

    def _sync(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        if isinstance(self.model, DDP) and not last:
            return self.model.no_sync()  # accumulate locally: one all-reduce per optimizer step
        if not isinstance(self.model, FSDPModule):
            return contextlib.nullcontext()
        # What each sharding keeps across micro-batches is what plan/comm.py and plan/memory.py charge for it.
        if self.sharding == "hybrid-shard":
            # Reduce-scatter inside the node every micro-batch (as full-shard does), all-reduce across the replicas
            # once per step.
            self.model.set_requires_all_reduce(last)
        elif self.sharding == "shard-grad-op":
            # ZeRO-2: gradients reduce-scattered every micro-batch (turning sync off would keep them whole), weights
            # kept whole until the last backward (resharding would gather them again every micro-batch).
            self.model.set_reshard_after_backward(last)
        elif self.sharding == "none":  # replicated under FSDP (with TP or PP): one all-reduce per step
            self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def forward_backward(self, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> float:
        """Backward of the mean loss over this rank's micro-batches; returns that loss (0 off the last stage)."""
        if self.pipeline is not None:
            return self._pipeline_step(torch.cat(inputs), torch.cat(targets))
        n, total = len(inputs), 0.0
        aux_loss = getattr(self.core, "aux_loss", None)
        for i, (x, y) in enumerate(zip(inputs, targets, strict=True)):
            with self._sync(i == n - 1), self._loss_ctx():
                with self.precision_ctx():
                    logits = self.model(x)
                loss = cross_entropy(logits, y)
                if callable(aux_loss):
                    loss = loss + aux_loss()
                loss = loss / n
                loss.backward()
            total += _item(loss)
        return total

    def _pipeline_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        assert self.pipeline is not None
        p, losses = self.pipeline, []
        # The stages' forwards run inside step(): the same mixed precision as without a pipeline.
        with self._loss_ctx(), self.precision_ctx():
            if p.has_first:
                p.schedule.step(x, target=y if p.has_last else None, losses=losses)
            elif p.has_last:
                p.schedule.step(target=y, losses=losses)
            else:
                p.schedule.step()
        return sum(_item(v) for v in losses) / len(losses) if p.has_last else 0.0

    def finish_gradients(self) -> None:
        if self.kind == "ep":
            assert self.mesh is not None
            sync_ep_grads(self.core, self.mesh)

    def global_loss(self, local: float) -> float:
        """Mean over data-parallel ranks (TP ranks hold copies; only last pipeline stages hold a loss)."""
        if self.dims.world_size == 1:
            return local
        t = torch.tensor([local], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item()) / (self.dims.world_size // self.dims.pp)

    def clip_grad_norm(self, max_norm: float | None) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        grads = [p.grad for p in params]
        simple = self.dims.pp == 1 and not any(isinstance(g, DTensor) for g in grads)
        if simple and self.kind != "ep":  # the single-process / DDP path, bit for bit torch's
            if max_norm:
                return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
            return float(torch.nn.utils.get_total_norm(grads))
        total = self._global_norm(grads)
        if max_norm:
            coef = min(1.0, float(max_norm / (total + 1e-6)))
            for g in grads:
                (g._local_tensor if isinstance(g, DTensor) else g).mul_(coef)
        return float(total)

    def _global_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        groups: dict[Any, list[torch.Tensor]] = {}
        for g in grads:  # one norm per mesh: DTensors of different meshes do not mix
            groups.setdefault(id(g.device_mesh) if isinstance(g, DTensor) else None, []).append(g)
        sq = torch.zeros((), dtype=torch.float32)
        for group in groups.values():
            n = torch.nn.utils.get_total_norm(group)
            sq = sq + (n.full_tensor() if isinstance(n, DTensor) else n).float() ** 2
        if self.dims.pp > 1:
            assert self.mesh is not None
            dist.all_reduce(sq, group=self.mesh[MeshAxis.PP].get_group())
        return sq.sqrt()

    def chunks(self) -> Iterator[nn.Module]:
        yield from (self.pipeline.chunks if self.pipeline else [self.core])


def _fsdp_param_dtype(layout: dict[str, Any]) -> str | None:
    """bf16 training gathers its weights in bf16 (the fp32 shards stay the master copy, gradients are reduced in
    fp32): half the all-gather bytes of gathering the fp32 weights autocast would cast anyway, and the bytes the
    planner charges (plan/comm.py). fp16 keeps its fp32 weights (autocast, no loss scaling in FSDP's casts)."""
    return "bf16" if layout.get("precision") == "bf16" else None


def parallelize(model: nn.Module, layout: dict[str, Any], *, world_size: int, rank: int, device: torch.device,
                fsdp: FSDPConfig | None = None, local_batch: int | None = None) -> ParallelModel:
    """Apply the layout to a model built in full on this rank. `local_batch` (sequences per dp rank per step)
    sets the number of pipeline micro-batches."""
    dims = ParallelDims.from_layout(layout, world_size)
    coords = dims.coords(rank)
    if world_size == 1:
        apply_ac(model, layout.get("activation_checkpointing", "none"))
        return ParallelModel(model, dims, coords, None, kind="single")
    mesh = build_mesh(dims, device.type)
    sharding = layout.get("sharding", "none")
    parts, stage_ids = [model], []
    if dims.pp > 1:
        parts, stage_ids = build_pipeline_chunks(model, coords[MeshAxis.PP], dims.pp, layout.get("vpp", 1))
    # bf16 TP or PP without data parallelism still runs FSDP2, on a one-rank mesh, for its mixed precision: autocast
    # alone keeps the weights and so the residual stream fp32, and about 3/4 of the TP bytes were fp32 where the
    # planner charges bf16. On one rank FSDP2's gathers are local casts. (A single process and DDP still train
    # under autocast alone.)
    mixed_alone = dims.dp == 1 and (dims.tp > 1 or dims.pp > 1) and _fsdp_param_dtype(layout) is not None
    use_fsdp = dims.ep == 1 and (mixed_alone or dims.dp > 1 and (sharding != "none" or dims.tp > 1 or dims.pp > 1))
    loss_parallel = dims.tp > 1 and layout.get("loss_parallel", True)
    for part in parts:
        if dims.tp > 1:
            apply_tp(part, mesh[MeshAxis.TP], sequence_parallel=layout.get("sequence_parallel", True),
                     loss_parallel=loss_parallel)
        if dims.ep > 1:
            apply_ep(part, mesh)
        apply_ac(part, layout.get("activation_checkpointing", "none"))
        if use_fsdp:
            apply_fsdp(part, fsdp_mesh(mesh), fsdp or FSDPConfig(sharding=sharding,
                                                                 param_dtype=_fsdp_param_dtype(layout)),
                       part.layers.values())  # type: ignore[union-attr]
    kind = "fsdp" if use_fsdp else "ep" if dims.ep > 1 else "none" if dims.dp == 1 else "ddp"
    pm = ParallelModel(model, dims, coords, mesh, kind=kind, loss_parallel=loss_parallel,
                       sharding=sharding)
    if kind == "ddp":
        if dims.ep > 1 or dims.tp > 1:
            raise AssertionError("DDP is only used for pure data parallelism")
        pm.model, pm.reduction = apply_ddp(model, mesh[MeshAxis.DP], [device.index] if device.type == "cuda" else None,
                                           layout.get("gradient_reduction", "fixed-order"))
    if dims.pp > 1:
        # ep with pp never gets here: ParallelDims refuses it (plan/support.py).
        micro = layout.get("micro_batch_size", 1)
        n_micro = max(1, (local_batch or micro) // micro)
        pm.pipeline = build_schedule(parts, stage_ids, mesh[MeshAxis.PP], schedule=layout.get("schedule", "1f1b"),
                                     n_microbatches=n_micro, loss_fn=cross_entropy, device=device)
    return pm

