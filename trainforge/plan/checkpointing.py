"""Checkpoint size and the optimal checkpoint interval (Young 1974; Daly 2006).

The cluster fails, on average, every M = node MTBF / nodes seconds. Writing a checkpoint blocks training for d
seconds. Young's first-order optimum is tau = sqrt(2*d*M); Daly's higher-order estimate (FGCS 22(3), eq. 37) is
tau = sqrt(2*d*M) * (1 + sqrt(d/(2M))/3 + d/(18M)) - d for d < 2M, else M. Each failure loses on average half an
interval plus the restart; the overhead is d/tau of the time spent writing plus (tau/2 + restart)/M lost to rework.

The requirements bound the work one failure may cost: a single node failure in a 1,000-GPU job must not lose more
than 10 minutes of training progress. A failure just before the next checkpoint commits loses the whole interval
plus the write, so the interval is capped at `max_lost_work_s - d` when Daly's optimum is longer (on a large
fleet with a long node MTBF it is: 25 min for a 1,024-GPU 70B job at 50,000 h), at a small overhead cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainforge.plan.model import ModelShape

DAY = 86_400.0
MAX_LOST_WORK_S = 600.0
"""The most training progress one failure may cost (the requirements' 10 minutes)."""


def checkpoint_bytes(model: ModelShape, precision: str = "bf16") -> dict[str, int]:
    """Bytes of a full training checkpoint (weights + optimizer state) and of the exported weights."""
    n = model.total_params
    weights = n * (4 if precision == "fp32" else 2)
    # Mixed precision saves the fp32 master copy with Adam's m and v; the 16-bit weights are derived from it.
    optimizer = n * 12 if precision != "fp32" else n * 8
    training = (n * 4 if precision == "fp32" else 0) + optimizer
    return {"training_checkpoint": training, "weights_export": weights, "parameters": n}


def daly_interval(write_s: float, mtbf_s: float) -> float:
    if write_s >= 2 * mtbf_s:
        return mtbf_s
    r = write_s / (2 * mtbf_s)
    return math.sqrt(2 * write_s * mtbf_s) * (1 + math.sqrt(r) / 3 + r / 9) - write_s


def young_interval(write_s: float, mtbf_s: float) -> float:
    return math.sqrt(2 * write_s * mtbf_s)


@dataclass(frozen=True, slots=True)
class CheckpointPlan:
    checkpoint_bytes: int
    write_s: float
    cluster_mtbf_s: float
    interval_s: float
    young_interval_s: float
    interval_steps: int
    failures_per_day: float
    lost_work_per_failure_s: float
    overhead_fraction: float
    """Share of wall time spent writing checkpoints plus redoing lost work."""
    daly_interval_s: float = 0.0
    """Daly's optimum before the lost-work cap (equal to interval_s when the cap does not bind)."""
    commit_s: float = 0.0
    """Seconds from a save's start to its commit (the full write; async saves run it behind training)."""

    @property
    def capped(self) -> bool:
        return self.interval_s < self.daly_interval_s

    @property
    def worst_lost_work_s(self) -> float:
        """A failure just before the next checkpoint commits loses the interval plus the write."""
        return self.interval_s + self.commit_s

    @property
    def lost_hours_per_day(self) -> float:
        return self.overhead_fraction * 24


def plan_checkpoints(model: ModelShape, *, nodes: int, node_mtbf_hours: float, step_time_s: float,
                     precision: str = "bf16", write_bytes_per_s: float | None = None,
                     per_node_write_bytes_per_s: float = 2e9, storage_bytes_per_s: float = 100e9,
                     restart_s: float = 300.0, async_stall_fraction: float = 1.0,
                     max_lost_work_s: float | None = MAX_LOST_WORK_S) -> CheckpointPlan:
    """Young/Daly interval for a job on `nodes` nodes. The write bandwidth is the smaller of every node writing its
    shard at `per_node_write_bytes_per_s` and the storage system's aggregate rate, unless given.
    `async_stall_fraction` < 1 models asynchronous saves that block training only while staging to host memory.
    `max_lost_work_s` caps the interval so that one failure never costs more than that (None: pure Daly)."""
    size = checkpoint_bytes(model, precision)["training_checkpoint"]
    rate = write_bytes_per_s or min(storage_bytes_per_s, nodes * per_node_write_bytes_per_s)
    write = size / rate * async_stall_fraction
    mtbf = node_mtbf_hours * 3600 / max(1, nodes)
    daly = daly_interval(write, mtbf)
    # The full (unstalled) write decides when a save commits; with async saves it runs behind training.
    commit_s = size / rate
    tau = daly if max_lost_work_s is None else max(step_time_s, min(daly, max_lost_work_s - commit_s))
    lost = tau / 2 + restart_s
    overhead = write / (tau + write) + lost / mtbf
    # Under the cap, round down: a rounded-up step count would overshoot the bound it enforces.
    steps = max(1, math.floor(tau / step_time_s) if tau < daly else round(tau / step_time_s))
    return CheckpointPlan(size, write, mtbf, tau, young_interval(write, mtbf), steps, DAY / mtbf, lost,
                          min(1.0, overhead), daly, commit_s)
