"""The learning-rate schedule: a pure function of the step, shared by every engine's loop (native and DeepSpeed),
so a resumed segment continues the LR exactly."""

from __future__ import annotations

import math


def lr_at(step: int, total: int, peak: float, warmup: int, decay: str, min_ratio: float) -> float:
    """LR for optimizer step `step` (0-based): linear warm-up, then cosine/linear decay to min_ratio * peak."""
    if warmup and step < warmup:
        return peak * (step + 1) / warmup
    if decay == "constant":
        return peak
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if decay == "linear":
        return peak * (1 - (1 - min_ratio) * progress)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
