"""The platform's services for a script-mode job (`code.mode: script`), as plain functions.

A user's own training script runs under the platform's torchrun with the distributed environment injected
(trainforge.infra.launch.script_environment). This module gives it what the managed loop gets, without a wrapper
class around the user's model or loop:

    from trainforge import runtime

    job = runtime.init()                                   # process group from the injected env (PyTorch)
    model = DDP(MyModel(job.model))                        # the script builds and wraps its own model
    opt = torch.optim.AdamW(model.parameters())
    start = runtime.load_checkpoint({"model": model, "optimizer": opt}) or 0
    for step, tokens in runtime.data_loader(start_step=start):    # this rank's rows of the global batch
        ...train on tokens...
        runtime.log_metrics(step + 1, loss=loss)            # events.jsonl -> MLflow, heartbeats, divergence
        if runtime.checkpoint_due(step + 1):
            runtime.save_checkpoint(step + 1, {"model": model, "optimizer": opt})
    runtime.finish()                                        # commits, segment_end, clean gloo shutdown

- Checkpoints are the platform's: DCP (async, any layout; loadable under another world size), committed with the
  manifest written last, deduplicated, sha256-verified, replicated in peers' memory for in-segment restarts,
  resumed from the newest intact commit (trainforge.trainer.checkpoint.Checkpointer).
- Data comes from the job's pinned dataset version in the platform's deterministic order: a pure function of
  (seed, dataset version, position), so a resumed segment continues on exactly the samples it would have seen.
  Rows are numpy int64 arrays of `seq_len + 1` tokens, so JAX and TensorFlow scripts use the loader too.
- Metrics go to the job's events file (rank 0 writes), which the flow streams to MLflow; every call also
  advances this rank's heartbeat so the segment supervisor sees progress (no progress = a hang).
- Segments: `data_loader` and `steps` stop at the segment's end (`fault_tolerance.segment_max_steps`);
  `finish` reports where the segment ended, and the flow starts the next one from the last commit.

The functions keep their state in this module (one job per process). For a JAX job `init()` starts
`jax.distributed` from the injected JAX_* variables instead of a torch process group; a TensorFlow job's strategy
reads TF_CONFIG itself. JAX and TensorFlow scripts use `data_loader`, `log_metrics` and `finish`; the checkpoint
functions are PyTorch-only (DCP), such scripts keep their own checkpoints.
"""

from __future__ import annotations

import gc
import math
import numbers
import os
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainforge.contract.config import ENV_VAR, SegmentConfig
from trainforge.contract.events import (
    CheckpointCorrupt,
    Metrics,
    SegmentEnd,
    SegmentStart,
)
from trainforge.trainer import segment as cadence


class RuntimeUsageError(ValueError):
    """The script called the runtime wrongly (before init, with a bad state dict, ...): the user's to fix. A
    ValueError, so the worker's failure report classifies it as `user` (not retried as an infrastructure fault)."""


@dataclass(frozen=True, slots=True)
class Job:
    """What a script needs to know about its job (read-only)."""

    job_id: str
    rank: int
    world_size: int
    local_rank: int
    framework: str
    total_steps: int
    """The spec's training.max_steps (optimizer steps over the whole job)."""
    checkpoint_interval: int
    segment_max_steps: int | None
    global_batch_size: int
    seq_len: int
    seed: int
    training: dict[str, Any]
    """The spec's training section (optimizer, lr_schedule, precision, ...)."""
    model: dict[str, Any]
    """The spec's model numbers as the planner resolved them (layers, hidden, heads, vocab, ...)."""
    layout: dict[str, Any]
    """The plan's layout (dp, micro_batch_size, ...): the script applies it itself."""
    run_dir: str
    device: Any = None
    """torch.device of this rank (None with process_group=False)."""


@dataclass
class _State:
    cfg: SegmentConfig
    job: Job
    events: Any
    metrics: Any
    ctx: Any = None
    ckpt: Any = None
    start: int | None = None
    last_step: int = 0
    last_loss: float | None = None
    last_log: float | None = None
    attached: bool = False
    finished: bool = False


_STATE: _State | None = None


def _state() -> _State:
    if _STATE is None:
        raise RuntimeUsageError("trainforge.runtime.init() must be called first (once, on every rank)")
    return _STATE


def _config() -> SegmentConfig:
    path = os.environ.get(ENV_VAR)
    if not path:
        raise RuntimeUsageError(f"${ENV_VAR} is not set: trainforge.runtime works inside a platform job; submit the "
                                "script with `code.mode: script` (trainforge submit SPEC) instead of running it "
                                "directly")
    from trainforge.trainer.inputs import localize

    return localize(SegmentConfig.load(path))  # fetched already by the worker: this finds the node's copies


def init(*, process_group: bool | None = None, timeout_s: float | None = None) -> Job:
    """Read the job, start the process group from the injected environment (PyTorch: gloo on CPU, NCCL + gloo
    on GPUs, with the platform's per-restart store and collective timeout), and set up checkpoints and events.
    Every rank calls it once, before any other function here. `process_group` (default: True for PyTorch and JAX,
    False for TensorFlow, whose strategy reads TF_CONFIG) starts the framework's distributed runtime: a torch
    process group, or `jax.distributed.initialize` from the injected JAX_* variables. A PyTorch script that already
    called `dist.init_process_group` keeps its group."""
    global _STATE
    if _STATE is not None and not _STATE.finished:
        return _STATE.job
    from trainforge.events import AsyncEventWriter, event_sink, worker_sender
    from trainforge.trainer.health import current_monitor

    cfg = _config()
    framework = cfg.code.framework
    if process_group is None:
        # TensorFlow: the script's MultiWorkerMirroredStrategy reads TF_CONFIG itself, when the script creates it.
        process_group = framework in ("pytorch", "jax")
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    ctx = ckpt = device = None
    events = event_sink(cfg.run_dir, rank == 0, worker_sender(cfg.job_id, rank))
    if process_group and framework == "jax":
        _init_jax()
    elif process_group:
        from trainforge.infra.storage import open_store
        from trainforge.trainer.checkpoint import Checkpointer
        from trainforge.trainer.distributed import DistContext

        policy = cfg.health.with_env()
        ctx = DistContext.from_env(timeout_s or min(cfg.collective_timeout_s, policy.collective_timeout_s))
        rank, world, local_rank, device = ctx.rank, ctx.world_size, ctx.local_rank, ctx.device
        store = open_store(cfg.storage_url).scoped(cfg.storage_prefix)
        # The script's own loop steps the optimizer: the Checkpointer's pre-step hook (guard_optimizer, the
        # default) makes that step wait for the last save's host copy, as loop.train's explicit call does.
        ckpt = Checkpointer(ctx, store, cfg.storage_prefix, Path(cfg.staging_dir),
                            cadence.commit_reporter(events.publish))
    tr = cfg.training
    # Job's dict fields are the script's public view (JSON-shaped, as documented); the config itself is typed.
    job = Job(job_id=cfg.job_id, rank=rank, world_size=world, local_rank=local_rank, framework=framework,
              total_steps=cfg.total_steps, checkpoint_interval=cfg.checkpoint_interval,
              segment_max_steps=cfg.segment_max_steps, global_batch_size=tr.global_batch_size,
              seq_len=tr.seq_len, seed=tr.seed, training=tr.model_dump(mode="json"), model=cfg.model_args(),
              layout=asdict(cfg.layout), run_dir=cfg.run_dir, device=device)
    _STATE = _State(cfg=cfg, job=job, events=events, metrics=AsyncEventWriter(events), ctx=ctx, ckpt=ckpt)
    current_monitor().set_phase("starting")
    return job


def _init_jax() -> None:
    """jax.distributed from the injected environment (infra/launch.jax_script_env): JAX reads only the coordinator
    address from the environment, so the process count and id are passed here."""
    import jax

    missing = [k for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID") if k not in os.environ]
    if missing:
        raise RuntimeUsageError(f"init(): {', '.join(missing)} not set; the platform injects them for "
                                "`code.framework: jax` jobs (check the spec's code.framework)")
    jax.distributed.initialize(coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
                               num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                               process_id=int(os.environ["JAX_PROCESS_ID"]))


# ------------------------------------------------------------------------------------------------ steps


def _begin(start: int, resumed_from: int | None) -> None:
    """The segment starts at `start`: reported once (the flow records resumes in lineage). The heartbeats stay in
    start-up until the first step is logged: a script's first step includes its compilation (jax.jit,
    tf.function, torch.compile), which the start-up budget covers and the per-step hang timeout would not."""
    st = _state()
    if st.start is not None:
        return
    st.start, st.last_step = start, start
    st.events.publish(SegmentStart(step=start, world_size=st.job.world_size, resumed_from=resumed_from,
                                   mode="script"))
    st.last_log = time.perf_counter()


def segment_end() -> int:
    """The step this segment ends at: the job's last step, or earlier with fault_tolerance.segment_max_steps."""
    st = _state()
    return cadence.segment_end(st.cfg, st.start if st.start is not None else 0)


def steps() -> range:
    """The optimizer steps (0-based) this segment runs: from the resumed checkpoint (or 0) to `segment_end()`."""
    st = _state()
    _begin(st.start if st.start is not None else 0, None)
    return range(st.start or 0, segment_end())


def checkpoint_due(step: int) -> bool:
    """True when `step` (optimizer steps done) should be checkpointed: every checkpoint.interval_steps, and at the
    segment's end (so the next segment resumes exactly there)."""
    st = _state()
    return cadence.checkpoint_due(st.cfg, step, segment_end())


# ------------------------------------------------------------------------------------------- checkpoints


def _model_and_optimizer(state: Mapping[str, Any], what: str) -> tuple[Any, Any]:
    import torch

    if not isinstance(state, Mapping) or set(state) != {"model", "optimizer"}:
        got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
        raise RuntimeUsageError(f"{what}(state): state must be {{'model': nn.Module, 'optimizer': Optimizer}}, got "
                                f"{got}; put everything else that must survive a restart in a function of the step")
    model, optimizer = state["model"], state["optimizer"]
    if not isinstance(model, torch.nn.Module):
        raise RuntimeUsageError(f"{what}(state): state['model'] is a {type(model).__name__}, not a torch.nn.Module")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise RuntimeUsageError(f"{what}(state): state['optimizer'] is a {type(optimizer).__name__}, not a "
                                "torch.optim.Optimizer")
    return model, optimizer


def _checkpointer(what: str) -> Any:
    st = _state()
    if st.ckpt is None:
        raise RuntimeUsageError(f"{what}: platform checkpoints are PyTorch (DCP) and need a torch process group "
                                f"from init(); this {st.job.framework} job has none (JAX/TensorFlow scripts keep "
                                "their own checkpoints, e.g. orbax / tf.train.Checkpoint)")
    return st.ckpt


def load_checkpoint(state: Mapping[str, Any]) -> int | None:
    """Restore model, optimizer and this rank's RNG from the job's newest intact committed checkpoint (after an
    in-segment restart: from the peers' memory). Returns its step, or None for a fresh job. Any layout the
    checkpoint was saved under loads (DCP reshards). Every rank calls it, before training."""
    st = _state()
    ckpt = _checkpointer("load_checkpoint")
    model, optimizer = _model_and_optimizer(state, "load_checkpoint")
    ref, skipped = ckpt.restore(lambda r: ckpt.load(r, model, optimizer))
    for bad_step, problems in skipped:
        st.events.publish(CheckpointCorrupt(step=bad_step, problems=problems))
    if ref is None:
        _begin(0, None)
        return None
    _begin(ref.step, ref.step)
    return int(ref.step)


def save_checkpoint(step: int, state: Mapping[str, Any]) -> float:
    """Checkpoint after `step` optimizer steps: staged asynchronously (the call blocks only while the state is
    copied), then written, uploaded and committed in the background; a `checkpoint` event follows the commit.
    Every rank calls it for the same step. Returns the seconds the caller was blocked."""
    st = _state()
    ckpt = _checkpointer("save_checkpoint")
    model, optimizer = _model_and_optimizer(state, "save_checkpoint")
    if st.start is None:
        _begin(0, None)
    cfg, job = st.cfg, st.job
    fields = cadence.manifest_fields(cfg, job.world_size, step, st.last_loss, mode="script", framework=job.framework)
    blocked = float(ckpt.save(step, model, optimizer, fields))
    st.last_step = max(st.last_step, step)
    return blocked


def wait_for_checkpoint_copy() -> float:
    """Block until the last save's host copy of the weights and optimizer state is complete. The optimizer's
    `step()` does this by itself (a pre-step hook); a script that changes parameters or optimizer state any other
    way right after a save (EMA weights, manual weight edits, loading other weights) calls it first. Returns the
    seconds waited."""
    return float(_checkpointer("wait_for_checkpoint_copy").wait_staging())


def _report_staged(st: _State) -> None:
    """One `checkpoint_staged` event per save whose host copy completed: the seconds the script was blocked by it
    (the save call plus the wait for the copy before the next optimizer step), as the managed loop reports."""
    cadence.report_staged(st.ckpt, st.events.publish)


# -------------------------------------------------------------------------------------------------- data


def data_loader(*, start_step: int | None = None, end_step: int | None = None, dp_rank: int | None = None,
                dp_degree: int | None = None, num_workers: int | None = None) -> Iterator[tuple[int, np.ndarray]]:
    """(step, rows) for each optimizer step from `start_step` (default: where the segment resumed) to `end_step`
    (default: the segment's end). `rows` is this data-parallel rank's contiguous share of the step's global batch:
    an int64 array [global_batch_size / dp_degree, seq_len + 1] (inputs are rows[:, :-1], targets rows[:, 1:]).
    dp_rank / dp_degree default to the rank and world size (pure data parallelism); a script with model
    parallelism passes its data-parallel coordinates. The order is the platform's deterministic sampler over the
    job's pinned dataset version (with the spec's transforms, in `dataset.num_workers` processes if set)."""
    from trainforge.datasets.catalog import load_version_dir
    from trainforge.datasets.pipeline import StepLoader, StepSource

    st = _state()
    cfg, job = st.cfg, st.job
    if start_step is None:
        start_step = st.start if st.start is not None else 0
    _begin(start_step, None)
    end = segment_end() if end_step is None else end_step
    dp_rank = job.rank if dp_rank is None else dp_rank
    dp_degree = job.world_size if dp_degree is None else dp_degree
    if not 0 <= dp_rank < dp_degree:
        raise RuntimeUsageError(f"data_loader: dp_rank {dp_rank} is not in [0, dp_degree={dp_degree})")
    if job.global_batch_size % dp_degree:
        raise RuntimeUsageError(f"data_loader: training.global_batch_size ({job.global_batch_size}) is not divisible "
                                f"by dp_degree ({dp_degree}); change the batch size in the spec or the degree")
    dset = cfg.dataset
    ds = load_version_dir(Path(dset.path), dset.ref)
    if ds.version != dset.require_pinned():  # the pinned version is what the run records; never train on another
        raise RuntimeError(f"dataset at {dset.path} is version {ds.version}, the job pinned {dset.version}")
    source = StepSource(dset.path, dset.ref, dset.eval_fraction, job.seed, job.global_batch_size, dp_rank,
                        dp_degree, transforms=dset.transforms, skip=cfg.skip_samples, seq_len=job.seq_len,
                        tokenizer=dset.tokenizer)
    workers = dset.num_workers if num_workers is None else num_workers
    width = job.seq_len + 1
    for step, rows in StepLoader(source, start_step, end, num_workers=workers):
        yield step, np.asarray(rows[:, :width], dtype=np.int64)


# ----------------------------------------------------------------------------------------------- metrics


def _number(name: str, value: Any) -> float:
    item = getattr(value, "item", None)
    if callable(item) and not isinstance(value, numbers.Real):  # torch / numpy / jax scalars and 1-element arrays
        try:
            value = item()
        except (ValueError, RuntimeError) as exc:
            raise RuntimeUsageError(f"log_metrics: {name} is not a scalar ({exc})") from None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RuntimeUsageError(f"log_metrics: {name}={value!r} is not a number; log scalars only")
    return float(value)


def log_metrics(step: int, **metrics: Any) -> None:
    """Record scalar metrics for `step` (optimizer steps done): rank 0 appends them to the job's events file
    (streamed to MLflow by the flow, checked by the alert rules); on every rank the call is this rank's step
    progress for the supervisor's hang detection, and a `loss` goes through the divergence policy (NaN/Inf or a
    spike stops the segment; with `rollback` the next segment skips the batch's samples). Call it once per step
    on every rank, with the same (all-reduced) loss on each."""
    from trainforge.trainer.health import current_monitor

    st = _state()
    values = {k: _number(k, v) for k, v in metrics.items()}
    if st.start is None:
        _begin(max(0, step - 1), None)
    now = time.perf_counter()
    dt = now - (st.last_log or now)
    st.last_log = now
    values.setdefault("step_time_s", dt)
    st.metrics.publish(Metrics.of(step, values))
    _report_staged(st)
    st.last_step = max(st.last_step, step)
    monitor = current_monitor()
    if not st.attached:
        # From here the supervisor measures step progress. No process-group handle: the monitor's per-step
        # agreement would be a collective inside log_metrics, which a script may call on some ranks only.
        monitor.attach(None, st.start or 0)
        st.attached = True
    if "loss" in values:
        st.last_loss = values["loss"]
        # Divergence policy on this rank (no collective: see _begin); raises DivergenceError, which the worker
        # reports as `divergence` for the flow's rollback.
        monitor.end_step(step - 1, values["loss"], values.get("grad_norm"), dt)
    else:
        monitor.begin_step(step)


# --------------------------------------------------------------------------------------------------- end


def finish(step: int | None = None) -> dict[str, Any]:
    """End the segment: wait until every checkpoint is committed (raises if the last one failed), report
    `segment_end` (the flow starts the next segment, or finishes the job, from it), and shut the process group
    down cleanly. Call it on every rank after the model is out of scope (e.g. after the function that trained
    returned): gloo aborts at exit if a DDP/FSDP model outlives its process group. `step` defaults to the
    highest step logged or checkpointed."""
    global _STATE
    from trainforge.trainer.health import current_monitor

    st = _state()
    if st.finished:
        raise RuntimeUsageError("finish() was already called")
    monitor = current_monitor()
    monitor.set_phase("closing")
    end = st.last_step if step is None else step
    if st.ckpt is not None:
        st.ckpt.close()
        _report_staged(st)
        cadence.report_skipped(st.ckpt, st.events.publish)
    st.metrics.close()
    reason = cadence.end_reason(st.cfg, end)
    st.events.publish(SegmentEnd(step=end, reason=reason, mode="script"))
    st.finished = True
    monitor.close("done")
    if st.job.framework == "jax" and "jax" in sys.modules:
        import jax

        if jax.process_count() > 1:
            jax.distributed.shutdown()  # a barrier across processes: nobody exits while a peer still computes
    if st.ctx is not None:
        from trainforge.trainer.distributed import shutdown

        st.ckpt = None
        gc.collect()
        shutdown(st.ctx)
    _STATE = None
    return {"step": end, "reason": reason, "loss": st.last_loss if st.last_loss is not None else math.nan}
