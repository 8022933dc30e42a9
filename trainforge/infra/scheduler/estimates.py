"""Runtime estimates without an oracle: what the user gave (`max_runtime`, a limit the platform enforces, so never
exceeded) and what the platform learns (the runtimes of similar jobs that ended, per user and team and gang size).

Pure: the simulator feeds it each job's runtime as the job ends and asks it at each submit; backfill and the
standing reservations read the estimate as `JobRequest.max_runtime_s`. Wrong estimates cost utilization (a
reservation too early or too late) but never the starvation bound (docs/scheduler.md, "No gang starves").
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

Key = tuple[tuple[str, str | int], ...]


def _quantile(values: deque[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]


@dataclass(slots=True, kw_only=True)
class RuntimeHistory:
    default_s: float = 4 * 3600.0
    """With no history and no user limit (a new team's first jobs)."""
    window: int = 32
    """Runtimes kept per key (the most recent): habits change."""
    quantile: float = 0.9
    """Of the kept runtimes: an estimate rather long than short keeps backfilled jobs out of a reservation."""
    min_samples: int = 3
    """Fewer runtimes than this under a key: use the next, wider key."""
    _runs: dict[Key, deque[float]] = field(default_factory=dict)

    @staticmethod
    def size_class(num_gpus: int) -> int:
        """Jobs of sizes within one power of two are alike."""
        return max(1, num_gpus).bit_length()

    @staticmethod
    def scopes(team: str, user: str, num_gpus: int) -> list[dict[str, str | int]]:
        """From the most similar jobs to all jobs, as the fields a similar job shares with this one: the user's of
        this size class, the user's, the team's of this size, the team's, everyone's. (The live scheduler selects
        its database rows by the same fields.)"""
        size = RuntimeHistory.size_class(num_gpus)
        return [{"team": team, "user": user, "size_class": size}, {"team": team, "user": user},
                {"team": team, "size_class": size}, {"team": team}, {}]

    @staticmethod
    def keys(team: str, user: str, num_gpus: int) -> list[Key]:
        return [tuple(sorted(scope.items())) for scope in RuntimeHistory.scopes(team, user, num_gpus)]

    def estimate(self, *, team: str, user: str, num_gpus: int, max_runtime_s: float | None = None) -> float:
        learned = None
        for key in self.keys(team, user, num_gpus):
            runs = self._runs.get(key)
            if runs is not None and len(runs) >= self.min_samples:
                learned = _quantile(runs, self.quantile)
                break
        if max_runtime_s is not None:  # a limit: the job is stopped there, so it never runs longer
            return min(max_runtime_s, learned) if learned is not None else max_runtime_s
        return learned if learned is not None else self.default_s

    def observe(self, *, team: str, user: str, num_gpus: int, runtime_s: float) -> None:
        for key in self.keys(team, user, num_gpus):
            self._runs.setdefault(key, deque(maxlen=self.window)).append(runtime_s)
