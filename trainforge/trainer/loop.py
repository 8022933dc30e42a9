"""The managed training loop: the layout's parallelism (parallel/), AdamW, warmup + cosine LR, clipping, accumulation, exact resume.

Determinism: weights are initialised from the job seed on every rank, the global sample order is a pure function
of (seed, dataset version, position), and a checkpoint holds model, optimizer, step and each rank's RNG state, so a
resumed run continues bit for bit where the committed checkpoint left off.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from trainforge.contract.config import SegmentConfig
from trainforge.contract.events import (
    CheckpointCommitted,
    CheckpointCorrupt,
    CheckpointSkipped,
    CheckpointStaged,
    Metrics,
    SegmentEnd,
    SegmentStart,
)
from trainforge.datasets.catalog import load_version_dir
from trainforge.datasets.sampler import SampleOrder
from trainforge.datasets.stream import open_reader
from trainforge.events import AsyncEventWriter, event_sink, worker_sender
from trainforge.infra.storage import open_store
from trainforge.trainer.checkpoint import Checkpointer
from trainforge.trainer.distributed import DistContext
from trainforge.trainer.faults import FaultInjector
from trainforge.trainer.health import current_monitor
from trainforge.trainer.metrics import StepMeter
from trainforge.trainer.parallel.deepspeed_engine import train_deepspeed
from trainforge.trainer.parallel.parallelize import parallelize
from trainforge.trainer.schedule import lr_at

logger = logging.getLogger(__name__)


class UserCodeError(Exception):
    """The user's entrypoint could not be imported or built the model wrongly: retrying will not help."""


def load_entrypoint(entrypoint: str, code_dir: str) -> Any:
    module_name, _, func = entrypoint.partition(":")
    if code_dir and code_dir not in sys.path:
        sys.path.insert(0, code_dir)
    try:
        module = importlib.import_module(module_name)
        return getattr(module, func)
    except Exception as exc:
        raise UserCodeError(f"cannot load entrypoint {entrypoint!r}: {type(exc).__name__}: {exc}") from exc


def load_init_weights(model: torch.nn.Module, path: str) -> None:
    """Load a safetensors file of full (unsharded) weights; nothing is unpickled. Shape or name mismatches are the
    user's to fix (init_from names a model of another architecture)."""
    from safetensors.torch import load_file

    state = load_file(path)
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    wrong = sorted(k for k in set(own) & set(state) if own[k].shape != state[k].shape)
    if missing or unexpected or wrong:
        raise UserCodeError(f"init_from weights {path} do not fit the model: missing {missing[:5]}, unexpected "
                            f"{unexpected[:5]}, wrong shape {wrong[:5]}; init_from must name a model of the same "
                            "architecture (model section)")
    model.load_state_dict(state, strict=True)


def build_model(cfg: SegmentConfig) -> torch.nn.Module:
    factory = load_entrypoint(cfg.entrypoint, cfg.code_dir)
    model = factory({**cfg.model_args(), "max_seq_len": cfg.training.seq_len})
    if not isinstance(model, torch.nn.Module):
        raise UserCodeError(f"entrypoint {cfg.entrypoint!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model


@dataclass
class StepBatches:
    inputs: list[torch.Tensor]
    targets: list[torch.Tensor]


class DataFeed:
    """This rank's micro-batches for each step, from the deterministic global order.

    Without online preprocessing (the default) the shards are read here, synchronously. With the spec's
    `dataset.num_workers` > 0, each step's batch (indices -> tokens -> `dataset.transforms`) is made ahead of
    time by DataLoader worker processes (`datasets.pipeline.StepLoader`, bounded queue), pipelined with training;
    the batches are the same bytes in the same order either way. `last_wait_s` is the time the step waited.
    """

    def __init__(self, cfg: SegmentConfig, dp_rank: int, dp_degree: int):
        from trainforge.datasets.pipeline import StepSource

        dset = cfg.dataset
        ds = load_version_dir(Path(dset.path), dset.ref)
        if ds.version != dset.require_pinned():
            raise RuntimeError(f"dataset at {dset.path} is version {ds.version}, expected {dset.version}")
        skip = frozenset(cfg.skip_samples)
        self.global_batch = cfg.training.global_batch_size
        self.micro = cfg.layout.micro_batch_size
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.seq_len = cfg.training.seq_len
        self.last_wait_s = 0.0  # time the last step() spent getting data (data-wait)
        self.num_workers = dset.num_workers
        self.total_steps = cfg.total_steps
        self.order = SampleOrder(ds.manifest.num_samples, dset.eval_fraction, ds.version, cfg.training.seed,
                                 skip=skip)
        self.source: StepSource | None = None
        self._loader: Any = None
        self._next_step: int | None = None
        if self.num_workers or dset.transforms:
            self.source = StepSource(dset.path, dset.ref, dset.eval_fraction, cfg.training.seed,
                                     self.global_batch, dp_rank, dp_degree, transforms=dset.transforms,
                                     skip=tuple(sorted(skip)))
        if self.num_workers == 0:  # the workers open their own readers; the training process opens none
            self.reader = open_reader(ds.path, ds.manifest)  # local shards, or streamed through the cache tiers

    def _rows(self, step: int) -> Any:
        if self.num_workers:
            if self._loader is None or self._next_step != step:  # first step, or a jump: (re)start the workers
                from trainforge.datasets.pipeline import StepLoader

                self.close()
                self._loader = iter(StepLoader(self.source, step, max(self.total_steps, step + 1),  # type: ignore[arg-type]
                                               num_workers=self.num_workers, prefetch=2))
            got, rows = next(self._loader)
            if got != step:
                raise RuntimeError(f"data pipeline returned step {got} for step {step}")
            self._next_step = step + 1
            return rows
        if self.source is not None:
            return self.source(step)  # transforms, in this process
        idx = self.order.rank_slice(step, self.global_batch, self.dp_rank, self.dp_degree)
        self.reader.prefetch(self.order.rank_slice(step + 1, self.global_batch, self.dp_rank, self.dp_degree))
        return self.reader.get(idx)

    def step(self, step: int) -> StepBatches:
        t0 = time.perf_counter()
        tokens = torch.from_numpy(self._rows(step))[:, : self.seq_len + 1]
        self.last_wait_s = time.perf_counter() - t0
        chunks = tokens.split(self.micro)
        return StepBatches([c[:, :-1] for c in chunks], [c[:, 1:] for c in chunks])

    def close(self) -> None:
        """Stop the preprocessing workers (if any); a later step() starts them again."""
        loader, self._loader, self._next_step = self._loader, None, None
        if loader is not None:
            loader.close()  # the generator's exit drops the DataLoader iterator, which joins its workers

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def _autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if precision == "fp16" and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.float16)
    return contextlib.nullcontext()


def train(cfg: SegmentConfig, ctx: DistContext) -> dict[str, Any]:
    """Train one segment: from the last committed checkpoint (or step 0) to the end or the segment limit."""
    tr = cfg.training
    events = event_sink(cfg.run_dir, ctx.is_main, worker_sender(cfg.job_id, ctx.rank))
    faults = FaultInjector.from_env(cfg.run_dir, ctx.rank)
    monitor = current_monitor()  # heartbeats, divergence policy, termination notice (trainer/health.py)
    torch.manual_seed(tr.seed)
    model = build_model(cfg).to(ctx.device)
    if cfg.init_weights:
        # Fine-tuning (spec init_from): the parent's weights; this job's own committed checkpoint, if any, wins below.
        load_init_weights(model, cfg.init_weights)
    layout = cfg.layout
    if cfg.engine.kind == "deepspeed":
        # The engine gets the loop's data feed and manifest fields: it does not import the loop (no import cycle).
        return train_deepspeed(cfg, ctx, model, events, feed=DataFeed(cfg, dp_rank=ctx.rank, dp_degree=ctx.world_size),
                               manifest_fields=lambda step, loss: _manifest_fields(cfg, ctx, step, loss))
    # The parallel modules take the layout as a mapping (tests drive them with extra knobs: hsdp_shard_degree...).
    pm = parallelize(model, asdict(layout), world_size=ctx.world_size, rank=ctx.rank, device=ctx.device,
                     local_batch=tr.global_batch_size // layout.dp)
    pm.precision_ctx = lambda: _autocast(tr.precision.value, ctx.device)
    opt = tr.optimizer
    optimizer = torch.optim.AdamW(pm.model.parameters(), lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps,
                                  weight_decay=opt.weight_decay)
    store = open_store(cfg.storage_url).scoped(cfg.storage_prefix)

    def on_commit(step: int, prefix: str, manifest: dict[str, Any]) -> None:
        events.publish(CheckpointCommitted(step=step, prefix=prefix, metrics=manifest.get("metrics", {})))

    ckpt = Checkpointer(ctx, store, cfg.storage_prefix, Path(cfg.staging_dir), on_commit)
    start = 0
    ref, skipped = ckpt.latest()
    for bad_step, problems in skipped:
        events.publish(CheckpointCorrupt(step=bad_step, problems=problems))
    if ref is not None:
        ckpt.load(ref, pm.model, optimizer)
        start = ref.step
    events.publish(SegmentStart(step=start, world_size=ctx.world_size, resumed_from=ref.step if ref else None))
    monitor.attach(ctx, start)

    feed = DataFeed(cfg, dp_rank=pm.dp_rank, dp_degree=pm.dims.dp)
    live = AsyncEventWriter(events)  # per-step metrics: written off the step's critical path
    meter = StepMeter(cfg, ctx, pm, emit=live.publish, start_step=start)  # step-time split, memory, MFU, ranks
    total = cfg.total_steps
    end = total if cfg.segment_max_steps is None else min(total, start + cfg.segment_max_steps)
    sched = tr.lr_schedule
    tokens_per_step = tr.global_batch_size * tr.seq_len
    last_loss = float("nan")
    preempted = False
    nan_steps = {f.step for f in faults.faults if f.kind == "nan"}

    def report_staged() -> None:
        # A save blocks the loop in its call and, later, while the next optimizer.step() waits for the host copy
        # that overlaps forward/backward; each save's total is reported once its copy is complete.
        for staged_step, blocked_s in ckpt.take_staged():
            events.publish(CheckpointStaged(step=staged_step, blocked_s=blocked_s))

    for step in range(start, end):
        monitor.begin_step(step)
        if step in nan_steps:  # the fault writes a parameter outside optimizer.step(): the host copy must be done
            ckpt.wait_staging()
        faults.maybe_fire(step, pm.model)
        t0 = time.perf_counter()
        batches = feed.step(step)
        monitor.local_done()
        lr = lr_at(step, total, opt.lr, sched.warmup_steps, sched.decay, sched.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        local_loss = pm.forward_backward([x.to(ctx.device) for x in batches.inputs],
                                         [y.to(ctx.device) for y in batches.targets])
        pm.finish_gradients()
        grad_norm = pm.clip_grad_norm(tr.grad_clip)
        optimizer.step()  # its pre-hook waits for the last save's host copy
        report_staged()
        last_loss = pm.global_loss(local_loss)
        dt = time.perf_counter() - t0
        live.publish(Metrics(step=step + 1, loss=last_loss, grad_norm=grad_norm, lr=lr, step_time_s=dt,
                             tokens_per_s=tokens_per_step / dt, samples_per_s=tr.global_batch_size / dt,
                             **meter.end_step(step + 1, dt, feed.last_wait_s)))
        preempted = monitor.end_step(step, last_loss, grad_norm, dt)  # raises on divergence (policy)
        done = step + 1
        if done % cfg.checkpoint_interval == 0 or done == end or preempted:
            ckpt.save(done, pm.model, optimizer, _manifest_fields(cfg, ctx, done, last_loss))
            report_staged()  # a synchronous save is complete here
        if preempted:  # termination notice: the emergency checkpoint commits in close(), then the segment ends
            end = done
            break
    monitor.set_phase("closing")
    ckpt.close()
    report_staged()  # the last save's copy was waited for in close()
    for bad_step, why in ckpt.skipped:  # superseded by a later commit: reported, never resumed from
        events.publish(CheckpointSkipped(step=bad_step, reason=why))
    meter.close()
    live.close()
    reason = "preempted" if preempted else "finished" if end == total else "segment_max_steps"
    events.publish(SegmentEnd(step=end, reason=reason))
    del pm, model, optimizer
    return {"step": end, "reason": reason, "loss": last_loss}


def _manifest_fields(cfg: SegmentConfig, ctx: DistContext, step: int, loss: float) -> dict[str, Any]:
    return {
        "job_id": cfg.job_id,
        "team": cfg.team,
        "world_size": ctx.world_size,
        "layout": asdict(cfg.layout),
        "sampler": {"position": step * cfg.training.global_batch_size, "seed": cfg.training.seed,
                    "dataset_version": cfg.dataset.version, "skip": list(cfg.skip_samples)},
        "rng": {"files": [f"rng-rank{r:05d}.safetensors" for r in range(ctx.world_size)]},
        "metrics": {"train_loss": loss},
        "dataset": {"ref": cfg.dataset.ref, "version": cfg.dataset.version, "license": cfg.dataset.license},
        "code_commit": cfg.code_commit,
        "config_hash": cfg.config_hash,
        "model": cfg.model_args(),
    }
