"""DeepSpeed ZeRO as the alternative engine (`parallelism.engine: deepspeed`).

The config is generated from the spec (`deepspeed_config`, pure); `build_deepspeed` hands the model and a torch
AdamW to `deepspeed.initialize`. ZeRO stage from the layout's sharding: none -> 1 (optimizer states sharded),
shard-grad-op -> 2, full-shard -> 3 (an explicit `zero_stage` in the layout wins). DeepSpeed runs the micro-batch
accumulation itself (`engine.backward` scales by 1/accumulation, `engine.step` steps on the boundary). On CPU it
uses gloo (its CPU accelerator without oneCCL). Checkpoints: DeepSpeed's partitioned optimizer is not a
torch.optim.Optimizer, so the platform's DCP checkpointer cannot save it; this engine does not checkpoint yet.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from trainforge.trainer.parallel.parallelize import cross_entropy

logger = logging.getLogger(__name__)
ZERO_STAGE = {"none": 1, "shard-grad-op": 2, "full-shard": 3, "hybrid-shard": 3}


def deepspeed_config(layout: dict[str, Any], training: dict[str, Any], world_size: int) -> dict[str, Any]:
    micro = layout.get("micro_batch_size", 1)
    accumulation = training["global_batch_size"] // (world_size * micro)
    cfg: dict[str, Any] = {
        "train_batch_size": training["global_batch_size"],
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "zero_optimization": {"stage": layout.get("zero_stage", ZERO_STAGE[layout.get("sharding", "none")])},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if training.get("grad_clip"):
        cfg["gradient_clipping"] = training["grad_clip"]
    if training.get("precision") == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def build_deepspeed(model: torch.nn.Module, layout: dict[str, Any], training: dict[str, Any],
                    world_size: int) -> Any:
    try:
        import deepspeed
    except ImportError as exc:  # an optional backend: name what to install
        raise ImportError("parallelism.engine: deepspeed needs the deepspeed package (pip install deepspeed)") from exc
    deepspeed.init_distributed(dist_backend="gloo" if not torch.cuda.is_available() else "nccl")
    opt = training["optimizer"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt["lr"], betas=tuple(opt["betas"]), eps=opt["eps"],
                                  weight_decay=opt["weight_decay"])
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                      config=deepspeed_config(layout, training, world_size))
    return engine


def deepspeed_step(engine: Any, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> float:
    """One optimizer step over this rank's micro-batches; returns the mean loss."""
    total = 0.0
    for x, y in zip(inputs, targets, strict=True):
        loss = cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        total += float(loss.detach()) / len(inputs)
    return total


def train_deepspeed(cfg: Any, ctx: Any, model: torch.nn.Module, events: Any) -> dict[str, Any]:
    from trainforge.trainer.loop import DataFeed, lr_at

    tr, opt, sched = cfg.training, cfg.training["optimizer"], cfg.training["lr_schedule"]
    engine = build_deepspeed(model.to(ctx.device), cfg.layout, tr, ctx.world_size)
    logger.warning("deepspeed engine: checkpoints are not written (DCP cannot save DeepSpeed's optimizer)")
    feed = DataFeed(cfg, dp_rank=ctx.rank, dp_degree=ctx.world_size)
    events.emit("segment_start", step=0, world_size=ctx.world_size, resumed_from=None)
    loss = float("nan")
    for step in range(cfg.total_steps):
        t0 = time.perf_counter()
        for group in engine.optimizer.param_groups:
            group["lr"] = lr_at(step, cfg.total_steps, opt["lr"], sched["warmup_steps"], sched["decay"],
                                sched["min_lr_ratio"])
        b = feed.step(step)
        loss = ctx.all_reduce_mean(deepspeed_step(engine, b.inputs, b.targets))
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {step + 1}")
        events.emit("metrics", step=step + 1, loss=loss, step_time_s=time.perf_counter() - t0)
    events.emit("segment_end", step=cfg.total_steps, reason="finished")
    del engine, model
    return {"step": cfg.total_steps, "reason": "finished", "loss": loss}
