"""The declarative health policy of a segment (heartbeats, hangs, divergence, stragglers, preemption).

Part of the segment contract: the control plane derives it (tasks/segment.py `health_policy`), puts it in the
attempt's `SegmentConfig`, and every worker reads it from there (trainer/health.py re-exports it). Pure stdlib:
importable without torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

ENV_VAR = "TRAINFORGE_HEALTH"
"""JSON object of HealthPolicy overrides (tests and drills shorten the timeouts with it)."""


@dataclass(frozen=True, kw_only=True)
class HealthPolicy:
    heartbeat_interval_s: float = 0.5
    """How often every rank writes its heartbeat (from a thread: it keeps beating while the main thread waits)."""
    heartbeat_timeout_s: float = 5.0
    """A rank whose heartbeat is older than this is dead (SIGSTOP, lost node, frozen host)."""
    hang_timeout_s: float | None = None
    """No step progress on any rank for this long = a hang. None = max(hang_floor_s, hang_factor x median step)."""
    hang_floor_s: float = 15.0
    hang_factor: float = 10.0
    startup_timeout_s: float = 300.0
    """Budget for the time before the first step (imports, rendezvous, checkpoint restore)."""
    collective_timeout_s: float = 120.0
    """Process-group timeout: a stuck collective raises after this (derived from the plan's step time)."""
    divergence_action: str = "rollback"
    """`rollback`: resume from the last good checkpoint with the offending batch's samples skipped; `stop`."""
    max_rollbacks: int = 3
    """Divergence rollbacks per job before it stops with a report."""
    spike_window: int = 32
    spike_min_window: int = 16
    spike_z: float = 10.0
    """Robust z-score (median / MAD over the last spike_window losses) above which a loss is a spike..."""
    spike_min_rel: float = 0.5
    """... and only when it is also this much above the window's median (small batches make noisy losses)."""
    straggler_ratio: float = 1.5
    straggler_min_excess_s: float = 0.05
    straggler_patience: int = 5
    """A rank slower than ratio x the median of ranks (and by min_excess) for this many steps is a straggler."""
    straggler_action: str = "report"
    """`report`, or `evict`: end the segment at the next committed checkpoint and re-provision without it."""
    preemption_grace_s: float = 30.0
    """Time a termination notice leaves for the emergency checkpoint (torchrun's own stop grace is 30 s)."""

    def __post_init__(self) -> None:
        if self.divergence_action not in ("rollback", "stop"):
            raise ValueError(f"divergence_action must be 'rollback' or 'stop', got {self.divergence_action!r}")
        if self.straggler_action not in ("report", "evict"):
            raise ValueError(f"straggler_action must be 'report' or 'evict', got {self.straggler_action!r}")
        if self.heartbeat_timeout_s <= 2 * self.heartbeat_interval_s:
            raise ValueError(f"heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed twice "
                             f"heartbeat_interval_s ({self.heartbeat_interval_s})")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> HealthPolicy:
        known = {f.name for f in fields(cls)}
        unknown = set(data or {}) - known
        if unknown:
            raise ValueError(f"unknown health policy fields {sorted(unknown)}; known: {sorted(known)}")
        return cls(**(data or {}))

    def with_env(self, env: dict[str, str] | None = None) -> HealthPolicy:
        text = (env if env is not None else os.environ).get(ENV_VAR)
        return replace(self, **json.loads(text)) if text else self

    def hang_timeout(self, median_step_s: float | None) -> float:
        if self.hang_timeout_s is not None:
            return self.hang_timeout_s
        return max(self.hang_floor_s, self.hang_factor * (median_step_s or 0.0))
