"""What differs between the native engine and DeepSpeed, behind one `Engine` protocol; `loop.train` runs either.

An engine owns the wrapped model, its optimizer and its checkpoint state (the platform's Checkpointer; DeepSpeed
writes its own format into it). The loop drives a step as: `forward_backward` (gradients; the last save's host copy
may still run: forward and backward change no parameter), `wait_for_staging` (explicit, right before the weights
change: torchtitan's maybe_wait_for_staging), `step(lr)` (the optimizer step; returns the gradient norm),
`global_loss`. `forward_backward`, `finish_gradients` and `global_loss` are the names StepMeter times.
The distributed test harness (tests/distributed/harness.py) drives the same engines against the single-process
reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import torch

from trainforge.contract.config import SegmentConfig
from trainforge.contract.events import SegmentEvent
from trainforge.infra.storage import open_store
from trainforge.registry.manifest import CheckpointRef
from trainforge.trainer.checkpoint import Checkpointer
from trainforge.trainer.checkpointing.deepspeed_format import DS_TAG
from trainforge.trainer.distributed import DistContext
from trainforge.trainer.parallel.deepspeed_engine import (
    build_deepspeed,
    deepspeed_backward,
    load_deepspeed,
    save_deepspeed,
)
from trainforge.trainer.parallel.parallelize import ParallelModel, autocast, parallelize
from trainforge.trainer.segment import commit_reporter

Publish = Callable[[SegmentEvent], None]


class Engine(Protocol):
    model: torch.nn.Module  # the module whose parameters train (faults poison it)
    dp_rank: int
    dp_degree: int
    ckpt: Checkpointer | None

    def restore(self, ref: CheckpointRef) -> int: ...  # returns the step resumed from
    def forward_backward(self, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> float: ...
    def finish_gradients(self) -> None: ...
    def wait_for_staging(self) -> None: ...
    def step(self, lr: float) -> float | None: ...
    def global_loss(self, local_loss: float) -> float: ...
    def save(self, step: int, fields: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class StepHook(Protocol):
    """Called at the start of every step (before data): the chaos harness's fault injection (trainer/faults.py)."""

    def before_step(self, step: int, engine: Engine) -> None: ...


def _checkpointer(cfg: SegmentConfig, ctx: DistContext, publish: Publish, **kw: Any) -> Checkpointer:
    store = open_store(cfg.storage_url).scoped(cfg.storage_prefix)
    return Checkpointer(ctx, store, cfg.storage_prefix, Path(cfg.staging_dir), commit_reporter(publish), **kw)


class NativeEngine:
    """DDP / FSDP / TP / PP / EP (parallel/parallelize.py) with torch AdamW and the platform's async DCP checkpoints."""

    def __init__(self, pm: ParallelModel, optimizer: torch.optim.Optimizer, ckpt: Checkpointer | None,
                 grad_clip: float | None, device: torch.device):
        self.pm, self.optimizer, self.ckpt, self.grad_clip, self.device = pm, optimizer, ckpt, grad_clip, device
        self.model, self.dp_rank, self.dp_degree = pm.model, pm.dp_rank, pm.dims.dp
        self.reduction = pm.reduction

    @classmethod
    def build(cls, cfg: SegmentConfig, ctx: DistContext, model: torch.nn.Module, publish: Publish) -> NativeEngine:
        tr, layout = cfg.training, cfg.layout
        # The parallel modules take the layout as a mapping (tests drive them with extra knobs: hsdp_shard_degree...).
        pm = parallelize(model, {**asdict(layout), "gradient_reduction": tr.gradient_reduction,
                                 "precision": tr.precision.value},
                         world_size=ctx.world_size, rank=ctx.rank, device=ctx.device,
                         local_batch=tr.global_batch_size // layout.dp)
        pm.precision_ctx = lambda: autocast(tr.precision.value, ctx.device)
        opt = tr.optimizer
        optimizer = torch.optim.AdamW(pm.model.parameters(), lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps,
                                      weight_decay=opt.weight_decay)
        return cls(pm, optimizer, _checkpointer(cfg, ctx, publish, guard_optimizer=False), tr.grad_clip,
                   ctx.device)

    def restore(self, ref: CheckpointRef) -> int:
        assert self.ckpt is not None
        self.ckpt.load(ref, self.pm.model, self.optimizer)
        return ref.step

    def forward_backward(self, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        return self.pm.forward_backward([x.to(self.device) for x in inputs], [y.to(self.device) for y in targets])

    def finish_gradients(self) -> None:
        self.pm.finish_gradients()

    def wait_for_staging(self) -> None:
        if self.ckpt is not None:
            self.ckpt.wait_staging()

    def step(self, lr: float) -> float | None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.finish_gradients()
        grad_norm = self.pm.clip_grad_norm(self.grad_clip)
        self.optimizer.step()
        return grad_norm

    def global_loss(self, local_loss: float) -> float:
        return self.pm.global_loss(local_loss)

    def save(self, step: int, fields: dict[str, Any]) -> None:
        assert self.ckpt is not None
        self.ckpt.save(step, self.pm.model, self.optimizer, fields)

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()


class DeepSpeedEngine:
    """DeepSpeed ZeRO (parallel/deepspeed_engine.py). DeepSpeed runs the micro-batch accumulation itself: its
    `engine.step()` is called after every micro-batch and steps the optimizer on the boundary, so
    `forward_backward` makes every micro-batch's call but the last and `step(lr)` makes the last one. Its saves are
    synchronous (no in-memory replicas: a DeepSpeed checkpoint is loaded only after its sha256s match the
    manifest), so `wait_for_staging` has nothing to wait for."""

    def __init__(self, engine: Any, ckpt: Checkpointer | None, ctx: DistContext):
        self.engine, self.ckpt, self.ctx = engine, ckpt, ctx
        self.model, self.dp_rank, self.dp_degree = engine.module, ctx.rank, ctx.world_size
        self.zero_stage = engine.zero_optimization_stage()
        # ZeRO-0 in fp32 steps a plain torch optimizer and clips without keeping the norm that DeepSpeed's ZeRO and
        # 16-bit optimizers report (get_global_grad_norm() stays None): the engine measures it itself.
        self._measure_norm = (self.zero_stage == 0 and not engine.bfloat16_enabled()
                              and not engine.fp16_enabled())

    @classmethod
    def build(cls, cfg: SegmentConfig, ctx: DistContext, model: torch.nn.Module, publish: Publish) -> DeepSpeedEngine:
        # deepspeed_config reads the mappings its own tests and the harness give it; an explicit stage wins.
        layout = asdict(cfg.layout) | ({} if cfg.engine.zero_stage is None else {"zero_stage": cfg.engine.zero_stage})
        engine = build_deepspeed(model.to(ctx.device), layout, cfg.training.model_dump(mode="json"), ctx.world_size)
        return cls(engine, _checkpointer(cfg, ctx, publish, async_save=False, replicate=False), ctx)

    def restore(self, ref: CheckpointRef) -> int:
        load_deepspeed(self.engine, self.ckpt, ref)
        return ref.step

    def forward_backward(self, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> float:
        return deepspeed_backward(self.engine, [x.to(self.ctx.device) for x in inputs],
                                  [y.to(self.ctx.device) for y in targets])

    def finish_gradients(self) -> None:
        pass  # DeepSpeed reduces the gradients inside backward / step

    def wait_for_staging(self) -> None:
        pass

    def step(self, lr: float) -> float | None:
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr
        # measured before the step, which clears them: ZeRO-0's gradients are reduced in the boundary's backward and
        # whole on every rank
        measured = self._replicated_grad_norm() if self._measure_norm else None
        self.engine.step()  # the accumulation boundary: the optimizer step
        norm = measured if self._measure_norm else self.engine.get_global_grad_norm()  # before clipping
        return None if norm is None else float(norm)

    def _replicated_grad_norm(self) -> float | None:
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        return float(torch.nn.utils.get_total_norm(grads)) if grads else None

    def global_loss(self, local_loss: float) -> float:
        loss = self.ctx.all_reduce_mean(local_loss)
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} (deepspeed engine)")
        return loss

    def save(self, step: int, fields: dict[str, Any]) -> None:
        fields = {**fields, "engine": "deepspeed", "deepspeed": {"tag": DS_TAG, "zero_stage": self.zero_stage}}
        save_deepspeed(self.engine, self.ckpt, step, fields)

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()  # waits for the last commit


def build_engine(cfg: SegmentConfig, ctx: DistContext, model: torch.nn.Module, publish: Publish) -> Engine:
    if cfg.engine.kind == "deepspeed":
        return DeepSpeedEngine.build(cfg, ctx, model, publish)
    return NativeEngine.build(cfg, ctx, model, publish)
