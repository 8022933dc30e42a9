"""Per-step training metrics measured in every rank: the step-time split, peak memory and MFU, aggregated on rank 0.

Step-time split (seconds, per rank; they add up to the step time):
- `data_wait_s`: time the DataFeed spent getting this step's batches (`DataFeed.last_wait_s`).
- `compute_s`: forward + backward minus what follows below.
- `exposed_comm_s`: communication the step waited on. DDP: a comm hook stamps each gradient bucket's all-reduce;
  once the last bucket is issued, backward compute is over, so the time from that stamp until backward returns
  is all-reduce the step waited for. The `fixed-order` reduction (trainer/parallel/ddp.py) blocks backward in its
  collectives instead: the time it blocked, summed over the buckets, is the exposed part. Plus the collectives outside backward (EP gradient sync, the loss all-reduce;
  these also absorb skew between ranks). FSDP/TP overlap inside backward is not separable on CPU: counted as compute.
- `bubble_s`: pipeline bubble, the schedule's idle share (p-1)/v / (m + (p-1)/v) of forward+backward (Narayanan et
  al. 2021); a formula applied to measured time, not a trace measurement (`trainforge profile` measures it).
- `optimizer_s`: clipping + optimizer step + everything else in the step.
- Checkpoint stall is not inside a step: the loop reports the blocked time of each save (`checkpoint_staged`).

MFU = model FLOPs per token (the planner's `ModelShape.model_flops_per_token`) x tokens per step / step time /
(world size x peak FLOP/s of one device). The peak is the catalog's datasheet value for the GPU type, or, on CPU,
the measured rate of a calibration matmul on this machine with this worker's thread count (cached per host).

Aggregation: each rank's numbers travel in one float64 vector through an all-gather on a private gloo group,
issued asynchronously after step s and collected after step s+1, so it never waits on a slow rank within a step;
rank 0 turns the gathered matrix into min/median/max per field and names the straggler (largest busy time).
Pure helpers (aggregate, mfu, bubble_fraction, device_peak_flops) are tested without torch.distributed.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from trainforge.contract.config import SegmentConfig
from trainforge.contract.events import MetricsMeta, RankMetrics, SegmentEvent

logger = logging.getLogger(__name__)

# What every rank reports each step; the order is the all-gather vector's layout.
RANK_FIELDS = ("step_time_s", "data_wait_s", "compute_s", "exposed_comm_s", "bubble_s", "optimizer_s",
               "peak_mem_bytes")
AGGREGATED = ("step_time_s", "data_wait_s", "compute_s", "exposed_comm_s", "busy_s", "peak_mem_bytes")


# ---- pure -----------------------------------------------------------------------------------------------------

def compute_mfu(flops_per_token: float, tokens_per_step: float, step_time_s: float, peak_flops: float,
                world_size: int) -> float:
    """Model FLOPs utilisation of one step over `world_size` devices of `peak_flops` each."""
    if step_time_s <= 0 or peak_flops <= 0 or world_size <= 0:
        return 0.0
    return flops_per_token * tokens_per_step / step_time_s / (peak_flops * world_size)


def bubble_fraction(layout: dict[str, Any], local_batch: int) -> float:
    """Idle share of a pipeline schedule: (p-1)/v over (m + (p-1)/v) slots; 0 without pipeline parallelism."""
    pp, vpp = int(layout.get("pp", 1)), int(layout.get("vpp", 1) or 1)
    if pp <= 1:
        return 0.0
    m = max(1, local_batch // max(1, int(layout.get("micro_batch_size", 1))))
    idle = (pp - 1) / vpp
    return idle / (m + idle)


def split_step(step_time_s: float, data_wait_s: float, fb_s: float, comm_tail_s: float, sync_s: float,
               bubble_frac: float) -> dict[str, float]:
    """The step-time split from the measured laps (see the module docstring). Parts are clamped at 0 and the
    optimizer/other part takes the remainder, so the parts add up to the step time."""
    tail = min(max(0.0, comm_tail_s), fb_s)
    bubble = (fb_s - tail) * bubble_frac
    compute = max(0.0, fb_s - tail - bubble)
    exposed = tail + max(0.0, sync_s)
    other = max(0.0, step_time_s - data_wait_s - compute - exposed - bubble)
    return {"data_wait_s": data_wait_s, "compute_s": compute, "exposed_comm_s": exposed, "bubble_s": bubble,
            "optimizer_s": other}


def aggregate(rows: Sequence[Sequence[float]], fields: Sequence[str] = RANK_FIELDS) -> dict[str, float]:
    """Per-rank rows (one per rank, in `fields` order) -> {field_min, field_median, field_max} for the aggregated
    fields, plus the straggler: the rank with the largest busy time (step time minus exposed communication, since
    fast ranks spend the slow rank's extra time waiting in collectives) and its ratio to the median of the others."""
    if not rows:
        return {}
    cols = {name: [float(r[i]) for r in rows] for i, name in enumerate(fields)}
    if "step_time_s" in cols and "exposed_comm_s" in cols:
        cols["busy_s"] = [s - c for s, c in zip(cols["step_time_s"], cols["exposed_comm_s"], strict=True)]
    out: dict[str, float] = {}
    for name in AGGREGATED:
        if name in cols:
            values = cols[name]
            out[f"{name}_min"] = min(values)
            out[f"{name}_median"] = statistics.median(values)
            out[f"{name}_max"] = max(values)
    busy = cols.get("busy_s")
    if busy:
        slowest = max(range(len(busy)), key=busy.__getitem__)
        # Against the *other* ranks: with 2 ranks the median of all is their mean, which halves a straggler's excess.
        others = [b for i, b in enumerate(busy) if i != slowest] or busy
        median = statistics.median(others)
        out["straggler_rank"] = float(slowest)
        out["straggler_ratio"] = busy[slowest] / median if median > 0 else 1.0
    return out


def gpu_type_from_name(device_name: str, memory_bytes: int = 0) -> str | None:
    """Map a CUDA device name to the planner's catalog key (None if the catalog has no entry)."""
    name = device_name.lower()
    if "h200" in name:
        return "h200"
    if "h100" in name:
        return "h100"
    if "a100" in name:
        return "a100-80gb" if memory_bytes > 50 * 2**30 else "a100-40gb"
    return None


def device_peak_flops(gpu_type: str | None, precision: str, cpu_peak: Callable[[], float]) -> tuple[float, str]:
    """Peak FLOP/s of one device and where it came from: the catalog for a known GPU, else a CPU calibration."""
    from trainforge.plan.hardware import GPU_CATALOG

    if gpu_type and gpu_type in GPU_CATALOG and gpu_type != "cpu":
        return GPU_CATALOG[gpu_type].peak_flops(precision), f"catalog:{gpu_type}"
    return cpu_peak(), "calibrated-cpu"


# ---- measurements (torch) ---------------------------------------------------------------------------------------

def peak_memory_bytes(device: Any) -> int:
    """High-water mark of this rank: CUDA's max allocated bytes, else the process's max RSS (Linux: KiB)."""
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def calibrate_cpu_peak(precision: str = "fp32", threads: int | None = None, cache_dir: Path | None = None,
                       size: int = 512, seconds: float = 0.3) -> float:
    """Measured matmul FLOP/s of this CPU with `threads` threads (the best of repeated n x n products), cached in
    `cache_dir/cpu-peak.json` per (cpu, threads, dtype) so each host measures once: the ranks of a host starting
    together take the cache's lock in turn, the first measures, the others read its figure. Without the lock every
    rank measured at once (6 x 0.3 s of CPU at each start on 2 cores, each figure taken on a contended CPU)."""
    import torch

    threads = threads or torch.get_num_threads()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    key = f"{platform.processor() or platform.machine()}|{os.cpu_count()}|t{threads}|{dtype}|n{size}"
    if cache_dir is None:
        return _measure_matmul(torch, dtype, size, seconds)
    cache = cache_dir / "cpu-peak.json"
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        lock = open(cache_dir / "cpu-peak.lock", "a")  # noqa: SIM115  (closed below, lock released with it)
    except OSError:  # a read-only home: what it holds, else measure and remember nothing
        known = _read_json(cache)
        return float(known[key]) if key in known else _measure_matmul(torch, dtype, size, seconds)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        known = _read_json(cache)
        if key in known:
            return float(known[key])
        best = _measure_matmul(torch, dtype, size, seconds)
        try:
            known[key] = best
            tmp = cache.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(known, indent=1))
            os.replace(tmp, cache)
        except OSError:
            pass
        return best


def _read_json(path: Path) -> dict[str, Any]:
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _measure_matmul(torch: Any, dtype: Any, size: int, seconds: float) -> float:
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)  # warm-up
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        torch.mm(a, b)
        dt = time.perf_counter() - t0
        best = max(best, 2.0 * size**3 / dt)
    return best


class CommTimer:
    """Stamps when each DDP gradient bucket is issued, through the model's comm hook (trainer/parallel/ddp.py)."""

    def __init__(self) -> None:
        self.last_issue = 0.0
        self.reduction: Any = None

    def install(self, reduction: Any) -> None:
        self.reduction = reduction
        reduction.on_issue = self._issued

    def _issued(self) -> None:
        self.last_issue = time.perf_counter()

    def exposed_s(self, backward_end: float) -> float:
        """The step's gradient communication that backward waited for, and a fresh count for the next step: the
        time the fixed-order reduction blocked backward in its collectives, else the time from the last bucket's
        issue to backward's end (torch's all-reduce overlaps the rest)."""
        blocked = self.reduction.blocked_s if self.reduction is not None else 0.0
        tail = blocked or (max(0.0, backward_end - self.last_issue) if self.last_issue else 0.0)
        if self.reduction is not None:
            self.reduction.blocked_s = 0.0
        self.last_issue = 0.0
        return tail


class RankGather:
    """Asynchronous all-gather of each rank's metric vector on a private gloo group (None when world_size is 1)."""

    def __init__(self, world_size: int, width: int):
        import torch
        import torch.distributed as dist

        self.world, self.width = world_size, width
        self.group = dist.new_group(backend="gloo") if world_size > 1 else None
        self.pending: tuple[int, Any, list[Any]] | None = None
        self._torch, self._dist = torch, dist

    def submit(self, step: int, values: Sequence[float]) -> None:
        local = self._torch.tensor(list(values), dtype=self._torch.float64)
        if self.group is None:
            self.pending = (step, None, [local])
            return
        out = [self._torch.empty(self.width, dtype=self._torch.float64) for _ in range(self.world)]
        work = self._dist.all_gather(out, local, group=self.group, async_op=True)
        self.pending = (step, work, out)

    def collect(self) -> tuple[int, list[list[float]]] | None:
        if self.pending is None:
            return None
        step, work, out = self.pending
        self.pending = None
        if work is not None:
            work.wait()
        return step, [t.tolist() for t in out]


class StepMeter:
    """Instruments a ParallelModel (wraps forward_backward / finish_gradients / global_loss with timers, installs
    the DDP comm hook) and turns each step into the extra fields of its `metrics` event. Every rank runs it;
    `end_step` returns rank 0's fields (other ranks' return value is unused)."""

    def __init__(self, cfg: SegmentConfig, ctx: Any, pm: Any, *, emit: Callable[[SegmentEvent], None], start_step: int = 0):
        from trainforge.home import home

        tr = cfg.training
        self.ctx, self.emit = ctx, emit
        self.flops_per_token = cfg.model.model_flops_per_token(tr.seq_len)
        self.tokens_per_step = tr.global_batch_size * tr.seq_len
        self.bubble_frac = bubble_fraction(asdict(cfg.layout), tr.global_batch_size // max(1, cfg.layout.dp))
        gpu_type = None
        if ctx.device.type == "cuda":
            import torch

            props = torch.cuda.get_device_properties(ctx.device)
            gpu_type = gpu_type_from_name(props.name, props.total_memory)
        self.peak_flops, self.peak_source = device_peak_flops(
            gpu_type, tr.precision.value, lambda: calibrate_cpu_peak(tr.precision.value, cache_dir=home() / "calibration"))
        self.last_step = start_step
        self._start_side_threads(cfg, ctx, start_step)
        self.laps = {"fb": 0.0, "sync": 0.0}
        self.comm = CommTimer()
        self._fb_end = 0.0
        self._instrument(pm)
        self.gather = RankGather(ctx.world_size, len(RANK_FIELDS))
        emit(MetricsMeta(step=start_step, peak_flops=self.peak_flops, peak_source=self.peak_source,
                         flops_per_token=self.flops_per_token, world_size=ctx.world_size,
                         bubble_fraction=self.bubble_frac))

    def _start_side_threads(self, cfg: SegmentConfig, ctx: Any, start_step: int) -> None:
        from trainforge.trainer import telemetry
        from trainforge.trainer.profiling import StepProfiler, parse_window

        window = parse_window(cfg.profile_steps or os.environ.get("TRAINFORGE_PROFILE_STEPS"))
        self.profiler = StepProfiler(cfg.run_dir, ctx.rank, window, start_step, self.peak_flops,
                                     self.flops_per_token * self.tokens_per_step / ctx.world_size, self.bubble_frac,
                                     config=cfg)
        self.telemetry = telemetry.maybe_start(self.emit, lambda: self.last_step, job_id=cfg.job_id,
                                               local_rank=ctx.local_rank, node=int(os.environ.get("GROUP_RANK", "0")))

    def _instrument(self, pm: Any) -> None:
        reduction = getattr(pm, "reduction", None)  # the native engine's DDP hook; none under FSDP or DeepSpeed
        if reduction is not None:
            self.comm.install(reduction)
        pm.forward_backward = self._timed(pm.forward_backward, "fb")
        pm.finish_gradients = self._timed(pm.finish_gradients, "sync")
        pm.global_loss = self._timed(pm.global_loss, "sync")

    def _timed(self, fn: Callable[..., Any], lap: str) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                t1 = time.perf_counter()
                self.laps[lap] += t1 - t0
                if lap == "fb":
                    self._fb_end = t1

        return wrapper

    def end_step(self, step: int, step_time_s: float, data_wait_s: float) -> dict[str, float]:
        """Fields for the `metrics` event of `step` (1-based), and the rank aggregate of the previous step."""
        tail = self.comm.exposed_s(self._fb_end)
        split = split_step(step_time_s, data_wait_s, self.laps["fb"], tail, self.laps["sync"], self.bubble_frac)
        self.laps = {"fb": 0.0, "sync": 0.0}
        mem = peak_memory_bytes(self.ctx.device)
        local = {"step_time_s": step_time_s, **split, "peak_mem_bytes": float(mem)}
        self._publish(self.gather.collect())
        self.gather.submit(step, [local[f] for f in RANK_FIELDS])
        self.last_step = step
        self.profiler.after_step(step, step_time_s)
        mfu = compute_mfu(self.flops_per_token, self.tokens_per_step, step_time_s, self.peak_flops,
                          self.ctx.world_size)
        return {**split, "peak_mem_bytes": float(mem), "mfu": mfu}

    def _publish(self, gathered: tuple[int, list[list[float]]] | None) -> None:
        if gathered is None or not self.ctx.is_main:
            return
        step, rows = gathered
        self.emit(RankMetrics(step=step, **aggregate(rows)))

    def close(self) -> None:
        """Collect the last step's aggregate (every rank must call it: it completes a collective)."""
        self._publish(self.gather.collect())
        self.profiler.close()
        if self.telemetry is not None:
            self.telemetry.close()
