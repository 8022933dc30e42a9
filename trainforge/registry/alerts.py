"""Alert rules over a job's live metrics (pure: no I/O; the flow's event pump feeds it and publishes what fires).

Rules are declarative (`AlertRule`: a kind, a threshold, a window); the defaults below apply to every job and a
JSON/YAML list in $TRAINFORGE_ALERT_RULES replaces them. Each rule fires once when its condition becomes true and
re-arms after it has been false again, so a long slow phase is one alert, not one per step.

Kinds:
- `loss_nan`: the loss is NaN or infinite.
- `loss_spike`: loss above `threshold` x the median of the previous `window` steps.
- `mfu_below_plan`: measured throughput below `threshold` x the planner's prediction (predicted step time over
  measured step time, the MFU ratio under one peak: on CPU the measured MFU uses a calibrated peak, the plan a
  nominal one, so the raw MFU numbers are not comparable), median over `window` steps.
- `throughput_drop`: tokens/s median over `window` below (1 - threshold) x the job's own baseline (the median of
  `window` steps after `warmup` steps).
- `data_wait`: data wait above `threshold` of step time, median over `window` steps.
- `straggler`: the slowest rank's busy time above `threshold` x the median rank's, median over `window` steps.
- `ecc_errors`: uncorrected ECC errors counted by NVML (`system/gpu_ecc_uncorrected` > threshold).
- `stalled`: no new step for `threshold` seconds while the job runs (`check_stalled`).
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainforge.contract.events import CheckpointStaged, Metrics, RankMetrics, SegmentEvent, System

STEP_KINDS = ("loss_nan", "loss_spike", "mfu_below_plan", "throughput_drop", "data_wait")
KINDS = ("loss_nan", "loss_spike", "mfu_below_plan", "throughput_drop", "data_wait", "straggler", "ecc_errors",
         "stalled")


@dataclass(frozen=True, slots=True)
class AlertRule:
    kind: str
    threshold: float = 0.0
    window: int = 5
    """Steps whose median is compared (smooths single noisy steps)."""
    warmup: int = 3
    """Steps ignored at the start of a segment (compilation, caches, first all-reduce)."""
    name: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown alert kind {self.kind!r}; known: {', '.join(KINDS)}")
        if self.window < 1:
            raise ValueError(f"alert {self.kind}: window must be >= 1, got {self.window}")

    @property
    def label(self) -> str:
        return self.name or self.kind


DEFAULT_RULES = (
    AlertRule("loss_nan", window=1, warmup=0),
    AlertRule("loss_spike", threshold=2.0, window=10),
    AlertRule("mfu_below_plan", threshold=0.5, window=5),
    AlertRule("throughput_drop", threshold=0.3, window=5),
    AlertRule("data_wait", threshold=0.2, window=5),
    AlertRule("straggler", threshold=1.3, window=5),
    AlertRule("ecc_errors", threshold=0.0, window=1, warmup=0),
    AlertRule("stalled", threshold=600.0, window=1, warmup=0),
)


def rules_from_list(items: list[Mapping[str, Any]]) -> tuple[AlertRule, ...]:
    return tuple(AlertRule(**dict(item)) for item in items)


def load_rules(env: Mapping[str, str] | None = None) -> tuple[AlertRule, ...]:
    """$TRAINFORGE_ALERT_RULES (a JSON or YAML file holding a list of rules) or the defaults."""
    path = (env if env is not None else os.environ).get("TRAINFORGE_ALERT_RULES")
    if not path:
        return DEFAULT_RULES
    import yaml

    items = yaml.safe_load(Path(path).read_text())
    if not isinstance(items, list):
        raise ValueError(f"{path}: alert rules must be a list of {{kind, threshold, window, warmup}}")
    return rules_from_list(items)


@dataclass(frozen=True, slots=True)
class Alert:
    rule: str
    kind: str
    step: int
    value: float
    threshold: float
    message: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class AlertEngine:
    """Feed it each step's metrics (`observe`); it returns the alerts that fired on that step."""

    rules: tuple[AlertRule, ...] = DEFAULT_RULES
    predicted_step_time_s: float | None = None
    history: dict[str, deque[float]] = field(default_factory=dict)
    baseline_tps: float | None = None
    active: set[str] = field(default_factory=set)
    steps_seen: int = 0

    def _series(self, key: str, n: int = 64) -> deque[float]:
        return self.history.setdefault(key, deque(maxlen=n))

    def observe(self, step: int, values: Mapping[str, float]) -> list[Alert]:
        """A step's trainer metrics (rank 0's `metrics` event)."""
        self.steps_seen += 1
        return self._evaluate(step, values, STEP_KINDS)

    def observe_ranks(self, step: int, values: Mapping[str, float]) -> list[Alert]:
        """A step's cross-rank aggregate (`rank_metrics`)."""
        return self._evaluate(step, values, ("straggler",))

    def observe_system(self, step: int, values: Mapping[str, float]) -> list[Alert]:
        """A telemetry sample (`system/...` metrics)."""
        return self._evaluate(step, values, ("ecc_errors",))

    def _evaluate(self, step: int, values: Mapping[str, float], kinds: tuple[str, ...]) -> list[Alert]:
        prev_loss = list(self._series("loss"))
        for key in ("loss", "tokens_per_s", "step_time_s", "data_wait_s", "straggler_ratio"):
            if key in values and isinstance(values[key], int | float) and math.isfinite(values[key]):
                self._series(key).append(float(values[key]))
        fired = []
        for rule in self.rules:
            if rule.kind not in kinds:
                continue
            verdict = self._check(rule, values, prev_loss)
            if verdict is None:
                self.active.discard(rule.label)
                continue
            value, message = verdict
            if rule.label not in self.active:
                self.active.add(rule.label)
                fired.append(Alert(rule.label, rule.kind, step, value, rule.threshold, message))
        return fired

    def _window(self, key: str, rule: AlertRule) -> float | None:
        series = self._series(key)
        if self.steps_seen <= rule.warmup or len(series) < rule.window:
            return None
        return statistics.median(list(series)[-rule.window:])

    def _check(self, rule: AlertRule, v: Mapping[str, float], prev_loss: list[float]) -> tuple[float, str] | None:
        k = rule.kind
        if k == "loss_nan":
            loss = v.get("loss")
            if loss is not None and not math.isfinite(loss):
                return float("nan"), f"loss is {loss}"
        elif k == "loss_spike":
            loss = v.get("loss")
            if loss is None or not math.isfinite(loss) or self.steps_seen <= rule.warmup:
                return None
            if len(prev_loss) >= rule.window:
                ref = statistics.median(prev_loss[-rule.window:])
                if ref > 0 and loss > rule.threshold * ref:
                    return loss, f"loss {loss:.4g} > {rule.threshold:g} x recent median {ref:.4g}"
        elif k == "mfu_below_plan":
            step_time = self._window("step_time_s", rule)
            if step_time and self.predicted_step_time_s:
                ratio = self.predicted_step_time_s / step_time
                if ratio < rule.threshold:
                    return ratio, (f"throughput at {ratio:.0%} of the plan (step {step_time:.3g} s vs predicted "
                                   f"{self.predicted_step_time_s:.3g} s)")
        elif k == "throughput_drop":
            return self._throughput(rule)
        elif k == "data_wait":
            wait, step_time = self._window("data_wait_s", rule), self._window("step_time_s", rule)
            if wait is not None and step_time and wait / step_time > rule.threshold:
                return wait / step_time, f"data wait {wait / step_time:.0%} of step time"
        elif k == "straggler":
            ratio = self._window("straggler_ratio", rule)
            if ratio is not None and ratio > rule.threshold:
                rank = v.get("straggler_rank")
                who = f"rank {int(rank)}" if rank is not None else "a rank"
                return ratio, f"{who} is {ratio:.2f}x the median rank's busy time"
        elif k == "ecc_errors":
            ecc = v.get("system/gpu_ecc_uncorrected")
            if ecc is not None and ecc > rule.threshold:
                return float(ecc), f"{ecc:g} uncorrected ECC errors"
        return None

    def _throughput(self, rule: AlertRule) -> tuple[float, str] | None:
        series = list(self._series("tokens_per_s"))
        if self.baseline_tps is None:
            # Baseline: the first full window after warm-up.
            if self.steps_seen >= rule.warmup + rule.window and len(series) >= rule.window:
                self.baseline_tps = statistics.median(series[-rule.window:])
            return None
        current = statistics.median(series[-rule.window:])
        if current < (1 - rule.threshold) * self.baseline_tps:
            drop = 1 - current / self.baseline_tps
            return drop, f"tokens/s {current:,.0f} is {drop:.0%} below the job's baseline {self.baseline_tps:,.0f}"
        return None

    def check_stalled(self, step: int, seconds_since_progress: float) -> list[Alert]:
        out = []
        for rule in self.rules:
            if rule.kind != "stalled":
                continue
            if seconds_since_progress > rule.threshold:
                if rule.label not in self.active:
                    self.active.add(rule.label)
                    out.append(Alert(rule.label, rule.kind, step, seconds_since_progress, rule.threshold,
                                     f"no step for {seconds_since_progress:.0f} s"))
            else:
                self.active.discard(rule.label)
        return out


def dumps(alerts: list[Alert]) -> str:
    return json.dumps([a.to_dict() for a in alerts])


class MetricsObserver:
    """Turns worker events into MLflow metric rows and runs the alert rules on them (the flow's pump owns one).

    metrics        -> every numeric field, plus `mfu_predicted` (the plan's) and `plan_attainment` (predicted
                      step time / measured: 1.0 = as planned)
    rank_metrics   -> `ranks/<field>_{min,median,max}`, `ranks/straggler_rank`, `ranks/straggler_ratio`
    system         -> `system/<field>` (MLflow's namespace for system metrics)
    checkpoint_staged -> `checkpoint_stall_s` (time the loop was blocked by the save)
    """

    def __init__(self, rules: tuple[AlertRule, ...] = DEFAULT_RULES, predicted: Mapping[str, Any] | None = None):
        predicted = predicted or {}
        self.predicted_mfu = predicted.get("mfu")
        self.predicted_step = predicted.get("step_time_s")
        self.engine = AlertEngine(rules, predicted_step_time_s=self.predicted_step)
        self.alerts: list[Alert] = []
        self.last_step = 0
        self.last_progress: float | None = None

    def rows(self, ev: SegmentEvent) -> list[tuple[int, dict[str, float]]]:
        if isinstance(ev, Metrics):
            values = ev.values()
            if self.predicted_mfu is not None:
                values["mfu_predicted"] = float(self.predicted_mfu)
            if self.predicted_step and values.get("step_time_s"):
                values["plan_attainment"] = self.predicted_step / values["step_time_s"]
            self.last_step, self.last_progress = ev.step, ev.time or None
            self.alerts += self.engine.observe(ev.step, values)
            return [(ev.step, values)]
        if isinstance(ev, RankMetrics):
            values = ev.values()
            self.alerts += self.engine.observe_ranks(ev.step, values)
            return [(ev.step, {f"ranks/{k}": v for k, v in values.items()})]
        if isinstance(ev, System):
            values = {f"system/{k}": v for k, v in ev.values().items()}
            self.alerts += self.engine.observe_system(ev.step, values)
            return [(ev.step, values)]
        if isinstance(ev, CheckpointStaged):
            return [(ev.step, {"checkpoint_stall_s": ev.blocked_s})]
        return []

    def check_stalled(self, now: float) -> None:
        if self.last_progress is not None:
            self.alerts += self.engine.check_stalled(self.last_step, now - self.last_progress)

    def take_alerts(self) -> list[Alert]:
        out, self.alerts = self.alerts, []
        return out
