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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainforge.contract.config import SegmentConfig
from trainforge.contract.events import CheckpointCorrupt, Metrics, SegmentEnd, SegmentStart
from trainforge.datasets.catalog import load_version_dir
from trainforge.events import AsyncEventWriter, event_sink, worker_sender
from trainforge.trainer.distributed import DistContext
from trainforge.trainer.engine import StepHook, build_engine
from trainforge.trainer.faults import step_hooks_from_env
from trainforge.trainer.health import DivergenceError, current_monitor
from trainforge.trainer.metrics import StepMeter
from trainforge.trainer.schedule import lr_at
from trainforge.trainer.segment import (
    checkpoint_due,
    end_reason,
    manifest_fields,
    report_skipped,
    report_staged,
    segment_end,
)

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
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        state = load_file(path)
    except (SafetensorError, OSError) as exc:  # a pickle (.pt/.bin) lands here too: never handed to an unpickler
        raise UserCodeError(f"init_from weights {path} are not a readable safetensors file ({exc}); export the "
                            "model with safetensors (`trainforge promote` registers model.safetensors)") from None
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

    def __init__(self, cfg: SegmentConfig, dp_rank: int, dp_degree: int, anchor: dict[str, int] | None = None):
        from trainforge.datasets.pipeline import StepSource
        from trainforge.datasets.training_data import open_training_data

        dset = cfg.dataset
        skip = frozenset(cfg.skip_samples)
        self.global_batch = cfg.training.global_batch_size
        self.micro = cfg.layout.micro_batch_size
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.seq_len = cfg.training.seq_len
        self.last_wait_s = 0.0  # time the last step() spent getting data (data-wait)
        self.num_workers = dset.num_workers
        self.total_steps = cfg.total_steps
        self.source: StepSource | None = None
        self._loader: Any = None
        self._next_step: int | None = None
        if self.num_workers or dset.transforms:
            self.source = StepSource(dset.path, dset.ref, dset.eval_fraction, cfg.training.seed,
                                     self.global_batch, dp_rank, dp_degree, transforms=dset.transforms,
                                     skip=tuple(sorted(skip)), seq_len=self.seq_len, tokenizer=dset.tokenizer,
                                     anchor=anchor)
        self.order: Any = None
        if self.num_workers == 0 or dset.in_place:
            # Local shards, streamed shards, or an s3:// prefix read in place; a version other than the pinned one
            # is refused. With preprocessing workers, they open their own readers and this process opens none,
            # except for an in-place prefix: its order (lazy: counts, no reads the workers have not made) gives
            # the anchor each checkpoint records.
            from trainforge.datasets.chunk_order import Anchor

            self.data = open_training_data(dset.path, dset.ref, eval_fraction=dset.eval_fraction,
                                           seed=cfg.training.seed, seq_len=self.seq_len, skip=skip,
                                           tokenizer_name=dset.tokenizer, expect_version=dset.require_pinned(),
                                           anchor=Anchor.from_dict(anchor) if anchor else None)
            self.order, self.reader = self.data.order, self.data.reader
        else:
            version = load_version_dir(Path(dset.path), dset.ref).version
            if version != dset.require_pinned():
                raise RuntimeError(f"dataset at {dset.path} is version {version}, expected {dset.version}")

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

    def anchor(self, step: int) -> dict[str, int] | None:
        """Where the data resumes after `step` steps, for the checkpoint (in-place datasets; None for shards,
        whose position alone resumes them)."""
        if self.order is None or not hasattr(self.order, "anchor"):
            return None
        return self.order.anchor(step * self.global_batch).to_dict()

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


def commit_before_rollback(engine: Any, monitor: Any) -> None:
    """A divergence stops a healthy gang in step (every rank raises at the same step: `end_step` agrees on it), and
    the checkpoints still uploading hold states from before it: let them commit before the rank exits, so the
    rollback resumes from the newest of them. Exiting at once threw away the save in flight: on a loaded host its
    upload outlasted the steps to the divergence and the rollback went a whole interval further back. A commit
    that fails is the checkpointer's to log; the divergence is still what ends the segment."""
    monitor.set_phase("closing")  # the wait is a final commit (the start-up / closing budget), not a hang
    try:
        engine.close()
    except Exception:
        logger.warning("a checkpoint in flight did not commit before the divergence rollback", exc_info=True)


def train(cfg: SegmentConfig, ctx: DistContext, hooks: Sequence[StepHook] | None = None) -> dict[str, Any]:
    """Train one segment: from the last committed checkpoint (or step 0) to the end or the segment limit.
    `hooks` run at the start of each step; None installs the chaos harness's from $TRAINFORGE_FAULT (faults.py)."""
    tr = cfg.training
    events = event_sink(cfg.run_dir, ctx.is_main, worker_sender(cfg.job_id, ctx.rank))
    monitor = current_monitor()  # heartbeats, divergence policy, termination notice (trainer/health.py)
    hooks = step_hooks_from_env(cfg.run_dir, ctx.rank) if hooks is None else hooks
    torch.manual_seed(tr.seed)
    model = build_model(cfg).to(ctx.device)
    if cfg.init_weights:
        # Fine-tuning (spec init_from): the parent's weights; this job's own committed checkpoint, if any, wins below.
        load_init_weights(model, cfg.init_weights)
    engine = build_engine(cfg, ctx, model, events.publish)
    # The newest committed checkpoint that loads (a corrupt one is quarantined and the one before it loaded).
    ref, skipped = engine.ckpt.restore(engine.restore) if engine.ckpt is not None else (None, [])
    for bad_step, problems in skipped:
        events.publish(CheckpointCorrupt(step=bad_step, problems=problems))
    start = 0 if ref is None else ref.step
    events.publish(SegmentStart(step=start, world_size=ctx.world_size, resumed_from=ref.step if ref else None))
    monitor.attach(ctx, start)
    anchor = (ref.manifest.get("sampler") or {}).get("anchor") if ref is not None else None
    feed = DataFeed(cfg, dp_rank=engine.dp_rank, dp_degree=engine.dp_degree, anchor=anchor)
    live = AsyncEventWriter(events)  # per-step metrics: written off the step's critical path
    meter = StepMeter(cfg, ctx, engine, emit=live.publish, start_step=start)  # step-time split, memory, MFU, ranks
    end, opt, sched = segment_end(cfg, start), tr.optimizer, tr.lr_schedule
    last_loss, preempted = float("nan"), False
    for step in range(start, end):
        monitor.begin_step(step)
        for hook in hooks:
            hook.before_step(step, engine)
        t0 = time.perf_counter()
        batches = feed.step(step)
        monitor.local_done()
        lr = lr_at(step, cfg.total_steps, opt.lr, sched.warmup_steps, sched.decay, sched.min_lr_ratio)
        local_loss = engine.forward_backward(batches.inputs, batches.targets)
        engine.wait_for_staging()  # the last save's host copy overlapped forward/backward; the weights change next
        grad_norm = engine.step(lr)
        report_staged(engine.ckpt, events.publish)
        last_loss = engine.global_loss(local_loss)
        dt = time.perf_counter() - t0
        live.publish(Metrics(step=step + 1, loss=last_loss, grad_norm=grad_norm, lr=lr, step_time_s=dt,
                             tokens_per_s=tr.global_batch_size * tr.seq_len / dt,
                             samples_per_s=tr.global_batch_size / dt, **meter.end_step(step + 1, dt, feed.last_wait_s)))
        try:
            preempted = monitor.end_step(step, last_loss, grad_norm, dt)  # raises on divergence (policy)
        except DivergenceError:
            commit_before_rollback(engine, monitor)
            raise
        if checkpoint_due(cfg, step + 1, end) or preempted:
            engine.save(step + 1, manifest_fields(cfg, ctx.world_size, step + 1, last_loss, feed.anchor(step + 1)))
            report_staged(engine.ckpt, events.publish)  # a synchronous save is complete here
        if preempted:  # termination notice: the emergency checkpoint commits in close(), then the segment ends
            end = step + 1
            break
    monitor.set_phase("closing")
    engine.close()  # waits for the last save's copy and commit
    report_staged(engine.ckpt, events.publish)
    report_skipped(engine.ckpt, events.publish)
    meter.close()
    live.close()
    reason = end_reason(cfg, end, preempted)
    events.publish(SegmentEnd(step=end, reason=reason))
    del engine, model
    return {"step": end, "reason": reason, "loss": last_loss}
