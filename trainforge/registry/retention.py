"""Checkpoint retention: a pure policy over (step, metrics, protected) -> the steps to keep.

Keep the newest `keep_last`, the best `keep_best.count` by a metric, every step that is a multiple of `keep_every`,
and anything protected (promoted to the registry, or the newest, which a resume may need). Everything else may be
deleted. The newest committed checkpoint is never deleted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    keep_last: int = 3
    keep_best_metric: str | None = None
    keep_best_mode: str = "min"
    keep_best_count: int = 1
    keep_every: int | None = None


def steps_to_keep(policy: RetentionPolicy, checkpoints: Mapping[int, Mapping[str, float]],
                  protected: Iterable[int] = ()) -> set[int]:
    steps = sorted(checkpoints)
    if not steps:
        return set()
    keep = set(steps[-max(1, policy.keep_last):]) | {steps[-1]}
    keep |= set(protected) & set(steps)
    if policy.keep_every:
        keep |= {s for s in steps if s % policy.keep_every == 0}
    if policy.keep_best_metric:
        scored = [(m[policy.keep_best_metric], s) for s, m in checkpoints.items()
                  if isinstance(m.get(policy.keep_best_metric), int | float)
                  and math.isfinite(m[policy.keep_best_metric])]
        scored.sort(reverse=policy.keep_best_mode == "max")
        keep |= {s for _, s in scored[: policy.keep_best_count]}
    return keep
