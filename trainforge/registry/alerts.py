"""Alert rules over a job's live metrics (pure: no I/O; the flow's event pump feeds it and publishes what fires).

Rules are declarative (`AlertRule`: a kind, a threshold, a window, how long the condition must persist); the
defaults below apply to every job and a JSON/YAML list in $TRAINFORGE_ALERT_RULES replaces them. Each rule fires
once when its condition has held for `persist` judged observations and re-arms after it has been false for as
many, so a long slow phase is one alert, not one per step (nor one per flap), and a blip is none.

Throughput (and MFU against the plan) and straggler are judged only on steady-state steps: a step is *excused* (neither judged nor counted in
the job's baseline) when it is among the first `warmup` steps of its segment, or when it overlaps a window in which
the platform itself works on this job: a checkpoint from its staging to its commit (events of the workers), the
flow's commit bookkeeping and evaluation of a checkpoint (`platform_started` / `platform_finished`, from the flow).
On a small machine those share the cores with training; an alert there would report the platform, not the job.

Kinds:
- `loss_nan`: the loss is NaN or infinite.
- `loss_spike`: loss above `threshold` x the median of the previous `window` steps.
- `mfu_below_plan`: measured throughput below `threshold` x the planner's prediction (predicted step time over
  measured step time, the MFU ratio under one peak: on CPU the measured MFU uses a calibrated peak, the plan a
  nominal one, so the raw MFU numbers are not comparable), median over the last `window` steady-state steps.
- `throughput_drop`: tokens/s median over the last `window` steady-state steps below (1 - threshold) x the job's
  own steady state (the median tokens/s of its steady-state steps so far, the last STEADY_HISTORY of them).
- `data_wait`: data wait above `threshold` of step time, median over `window` steps.
- `straggler`: over the last `window` steady-state steps, the rank most often slowest has a typical busy time
  (clipped geometric mean) above `threshold` x the other ranks' median (from the trainer's `straggler_rank` / `straggler_ratio`;
  `rank_excess` says how a step where another rank was slowest counts).
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

from trainforge.contract.events import (
    CheckpointCommitted,
    CheckpointSkipped,
    CheckpointStaged,
    Metrics,
    RankMetrics,
    SegmentEvent,
    SegmentStart,
    System,
)

STEP_KINDS = ("loss_nan", "loss_spike", "mfu_below_plan", "throughput_drop", "data_wait")
KINDS = ("loss_nan", "loss_spike", "mfu_below_plan", "throughput_drop", "data_wait", "straggler", "ecc_errors",
         "stalled")
STEADY_KINDS = ("mfu_below_plan", "throughput_drop", "straggler")
"""Judged on steady-state steps only (see the module docstring)."""
STEADY_HISTORY = 256
"""Steady-state steps the throughput baseline is the median of (a long phase at a new rate becomes the norm)."""
MAX_WINDOWS = 64
SERIES_LEN = 64  # the last values kept per rolling series (every rule's window fits in it)


@dataclass(frozen=True, slots=True)
class AlertRule:
    kind: str
    threshold: float = 0.0
    window: int = 5
    """Steps whose median is compared (smooths single noisy steps)."""
    warmup: int = 3
    """Steps ignored at the start of a segment (compilation, caches, first all-reduce)."""
    name: str = ""
    persist: int = 1
    """Judged observations in a row the condition must hold before the alert fires (a blip is not an alert). With
    an odd `window` the median condition holds for as many steps as a slow phase lasts, so a phase fires once it
    lasts `persist` steady-state steps."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown alert kind {self.kind!r}; known: {', '.join(KINDS)}")
        if self.window < 1:
            raise ValueError(f"alert {self.kind}: window must be >= 1, got {self.window}")
        if self.persist < 1:
            raise ValueError(f"alert {self.kind}: persist must be >= 1 (observations in a row), got {self.persist}")

    @property
    def label(self) -> str:
        return self.name or self.kind


DEFAULT_RULES = (
    AlertRule("loss_nan", window=1, warmup=0),
    AlertRule("loss_spike", threshold=2.0, window=10),
    AlertRule("mfu_below_plan", threshold=0.5, window=5, persist=8),
    AlertRule("throughput_drop", threshold=0.3, window=5, persist=8),
    AlertRule("data_wait", threshold=0.2, window=5),
    AlertRule("straggler", threshold=1.2, window=9, persist=8),
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


# ---------------------------------------------------------------------------------- pure judgements


def overlaps(windows: list[tuple[float, float | None]], start: float, end: float) -> bool:
    """Whether [start, end] overlaps any (begin, finish) window (finish None: still open)."""
    return any(begin < end and (finish is None or finish > start) for begin, finish in windows)


def steady_state(values: list[float]) -> float | None:
    """The job's own steady state of a series: the median of its steady-state values (None before any)."""
    return statistics.median(values) if values else None


def judge_throughput(recent: list[float], baseline: float | None, rule: AlertRule) -> tuple[float, str] | None:
    """(drop, message) when the median of the last `window` steady-state tokens/s is more than `threshold` below
    the job's steady state; None otherwise, or before a full window."""
    if baseline is None or baseline <= 0 or len(recent) < rule.window:
        return None
    current = statistics.median(recent[-rule.window:])
    if current >= (1 - rule.threshold) * baseline:
        return None
    drop = 1 - current / baseline
    return drop, f"tokens/s {current:,.0f} is {drop:.0%} below the job's steady state {baseline:,.0f}"


def rank_excess(pairs: list[tuple[int, float]], rank: int, world_size: int | None) -> list[float]:
    """Per step, rank `rank`'s busy time over the other ranks' median, from the steps' (straggler rank, ratio): the
    ratio where it was the slowest; where another rank was, 1/ratio with 2 ranks (exact: the two swap), else 1.0
    (not the slowest: counted as not slow). Unlike the slowest rank's ratio, which noise alone keeps above 1 (the
    slowest of several noisy ranks), this is about 1 for a rank that is only sometimes slowest."""
    out = []
    for who, ratio in pairs:
        if who == rank:
            out.append(ratio)
        else:
            out.append(1.0 / ratio if world_size == 2 and ratio > 0 else 1.0)
    return out


def judge_straggler(pairs: list[tuple[int, float]], world_size: int | None,
                    rule: AlertRule) -> tuple[float, str] | None:
    """(ratio, message) when, over the last `window` steady-state steps, the rank most often slowest has a typical
    busy time (`typical_ratio` of `rank_excess`) above `threshold` x the other ranks'; None otherwise, or before a
    full window."""
    if len(pairs) < rule.window:
        return None
    recent = pairs[-rule.window:]
    ranks = [who for who, _ in recent]
    candidate = max(set(ranks), key=lambda r: (ranks.count(r), -r))
    ratio = typical_ratio(rank_excess(recent, candidate, world_size))
    if ratio <= rule.threshold:
        return None
    return ratio, (f"rank {candidate} is {ratio:.2f}x the other ranks' busy time (over {rule.window} steady "
                   "steps)")


def typical_ratio(ratios: list[float], clip: float = 2.0) -> float:
    """The geometric mean of ratios, each clipped to [1/clip, clip]: a step where the rank was 2x slower and one
    where it was 2x faster cancel (a median would side with whichever came 5 times of 9), and one descheduled step
    (8x) weighs as much as a 2x one."""
    logs = [math.log(min(max(r, 1 / clip), clip)) for r in ratios if r > 0]
    return math.exp(sum(logs) / len(logs)) if logs else 1.0


@dataclass
class AlertEngine:
    """Feed it each step's metrics (`observe`); it returns the alerts that fired on that step. The flow tells it
    when the platform works on the job (`platform_started` / `platform_finished`); the observer does the same for
    the checkpoints it sees in the workers' events."""

    rules: tuple[AlertRule, ...] = DEFAULT_RULES
    predicted_step_time_s: float | None = None
    history: dict[str, deque[float]] = field(default_factory=dict)
    active: set[str] = field(default_factory=set)
    streak: dict[str, int] = field(default_factory=dict)
    """Per rule: judged observations in a row its condition held (it fires at `persist`)."""
    cleared: dict[str, int] = field(default_factory=dict)
    """Per rule: judged observations in a row its condition was false (a fired rule re-arms at `persist`)."""
    steps_seen: int = 0
    segment_steps: int = 0
    """Steps seen since the current segment started (its first `warmup` are not steady state)."""
    windows: dict[str, tuple[float, float | None]] = field(default_factory=dict)
    """Platform work on this job: key -> (start, end or None while it runs), wall-clock seconds."""
    excused_steps: dict[int, bool] = field(default_factory=dict)
    """Per step: whether its metrics were excused (its rank aggregate, a step later, follows the same verdict)."""
    world_size: int | None = None
    """The segment's world size (from its `segment_start`): how a rank's excess is read from the aggregates."""
    straggler_pairs: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=SERIES_LEN))
    """(straggler rank, ratio) of the steady-state steps."""
    coverage: dict[str, int] = field(default_factory=lambda: {"judged": 0, "excused": 0})
    """Steps the steady-state rules judged and excused (the job record keeps it: an alert-free job says how many
    of its steps were judged)."""

    def _series(self, key: str, n: int = SERIES_LEN) -> deque[float]:
        return self.history.setdefault(key, deque(maxlen=n))

    @property
    def baseline_tps(self) -> float | None:
        """The job's steady-state tokens/s so far (None before any steady-state step)."""
        return steady_state(list(self._series("steady/tokens_per_s", STEADY_HISTORY)))

    # -- platform windows and segments -------------------------------------------------------------------------
    def platform_started(self, key: str, at: float) -> None:
        self.windows[key] = (at, None)
        if len(self.windows) > MAX_WINDOWS:  # the oldest closed windows can no longer overlap a new step
            closed = sorted((v[1], k) for k, v in self.windows.items() if v[1] is not None)
            for _, old in closed[: len(self.windows) - MAX_WINDOWS]:
                del self.windows[old]

    def platform_finished(self, key: str, at: float) -> None:
        start = self.windows.get(key, (at, None))[0]
        self.windows[key] = (start, at)

    def segment_started(self, world_size: int | None = None) -> None:
        self.segment_steps = 0
        if world_size is not None and world_size != self.world_size:
            self.world_size = world_size
            self.straggler_pairs.clear()  # another gang: its ranks are other ranks

    def _warmup(self) -> int:
        return max((r.warmup for r in self.rules if r.kind in STEADY_KINDS), default=0)

    def excused(self, step: int, at: float | None, duration: float | None) -> bool:
        """Not steady state: within the segment's warm-up, or overlapping a platform window. A step's rank aggregate
        (judged after the step's own metrics) gets the verdict its metrics got."""
        if step in self.excused_steps:
            return self.excused_steps[step]
        if self.segment_steps <= self._warmup():
            return True
        if at is None:
            return False
        return overlaps(list(self.windows.values()), at - (duration or 0.0), at)

    # -- observations -----------------------------------------------------------------------------------------
    def observe(self, step: int, values: Mapping[str, float], at: float | None = None) -> list[Alert]:
        """A step's trainer metrics (rank 0's `metrics` event); `at`: when the step ended (the event's time)."""
        self.steps_seen += 1
        self.segment_steps += 1
        self.excused_steps.pop(step, None)  # a retried segment runs the step again
        excused = self.excused(step, at, values.get("step_time_s"))
        self.excused_steps[step] = excused
        self.coverage["excused" if excused else "judged"] += 1
        while len(self.excused_steps) > 2 * STEADY_HISTORY:
            del self.excused_steps[next(iter(self.excused_steps))]
        tps, step_time = values.get("tokens_per_s"), values.get("step_time_s")
        if not excused and isinstance(tps, int | float) and math.isfinite(tps):
            self._series("steady/tokens_per_s", STEADY_HISTORY).append(float(tps))
            self._series("recent/tokens_per_s").append(float(tps))
        if not excused and isinstance(step_time, int | float) and math.isfinite(step_time):
            self._series("recent/step_time_s").append(float(step_time))
        return self._evaluate(step, values, STEP_KINDS, judged=not excused)

    def observe_ranks(self, step: int, values: Mapping[str, float], at: float | None = None) -> list[Alert]:
        """A step's cross-rank aggregate (`rank_metrics`)."""
        excused = self.excused(step, at, None)
        ratio, rank = values.get("straggler_ratio"), values.get("straggler_rank")
        if not excused and isinstance(ratio, int | float) and math.isfinite(ratio) and rank is not None:
            self.straggler_pairs.append((int(rank), float(ratio)))
        return self._evaluate(step, values, ("straggler",), judged=not excused)

    def observe_system(self, step: int, values: Mapping[str, float]) -> list[Alert]:
        """A telemetry sample (`system/...` metrics)."""
        return self._evaluate(step, values, ("ecc_errors",))

    def _evaluate(self, step: int, values: Mapping[str, float], kinds: tuple[str, ...],
                  judged: bool = True) -> list[Alert]:
        prev_loss = list(self._series("loss"))
        for key in ("loss", "step_time_s", "data_wait_s"):  # the rolling series the rules read (_window, _check)
            if key in values and isinstance(values[key], int | float) and math.isfinite(values[key]):
                self._series(key).append(float(values[key]))
        fired = []
        for rule in self.rules:
            if rule.kind not in kinds or (rule.kind in STEADY_KINDS and not judged):
                continue  # an excused step neither advances nor breaks a streak
            verdict = self._check(rule, values, prev_loss)
            if verdict is None:
                self.streak[rule.label] = 0
                self.cleared[rule.label] = self.cleared.get(rule.label, 0) + 1
                if self.cleared[rule.label] >= rule.persist:  # re-armed once it stayed clear as long
                    self.active.discard(rule.label)
                continue
            self.cleared[rule.label] = 0
            self.streak[rule.label] = self.streak.get(rule.label, 0) + 1
            value, message = verdict
            if rule.label not in self.active and self.streak[rule.label] >= rule.persist:
                self.active.add(rule.label)
                persisted = f" (for {rule.persist} steps)" if rule.persist > 1 else ""
                fired.append(Alert(rule.label, rule.kind, step, value, rule.threshold, message + persisted))
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
            recent = list(self._series("recent/step_time_s"))
            step_time = statistics.median(recent[-rule.window:]) if len(recent) >= rule.window else None
            if step_time and self.predicted_step_time_s:
                ratio = self.predicted_step_time_s / step_time
                if ratio < rule.threshold:
                    return ratio, (f"throughput at {ratio:.0%} of the plan (step {step_time:.3g} s vs predicted "
                                   f"{self.predicted_step_time_s:.3g} s)")
        elif k == "throughput_drop":
            return judge_throughput(list(self._series("recent/tokens_per_s")), self.baseline_tps, rule)
        elif k == "data_wait":
            wait, step_time = self._window("data_wait_s", rule), self._window("step_time_s", rule)
            if wait is not None and step_time and wait / step_time > rule.threshold:
                return wait / step_time, f"data wait {wait / step_time:.0%} of step time"
        elif k == "straggler":
            return judge_straggler(list(self.straggler_pairs), self.world_size, rule)
        elif k == "ecc_errors":
            ecc = v.get("system/gpu_ecc_uncorrected")
            if ecc is not None and ecc > rule.threshold:
                return float(ecc), f"{ecc:g} uncorrected ECC errors"
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
    checkpoint_staged .. checkpoint (or checkpoint_skipped), and segment_start: the steady-state bookkeeping of
    the throughput and straggler rules (module docstring)
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
            self.alerts += self.engine.observe(ev.step, values, ev.time)
            return [(ev.step, values)]
        if isinstance(ev, RankMetrics):
            values = ev.values()
            self.alerts += self.engine.observe_ranks(ev.step, values, ev.time)
            return [(ev.step, {f"ranks/{k}": v for k, v in values.items()})]
        if isinstance(ev, System):
            values = {f"system/{k}": v for k, v in ev.values().items()}
            self.alerts += self.engine.observe_system(ev.step, values)
            return [(ev.step, values)]
        if isinstance(ev, CheckpointStaged):  # the save's upload runs beside training until its commit
            self.engine.platform_started(f"checkpoint-{ev.step}", ev.time - ev.blocked_s)
            return [(ev.step, {"checkpoint_stall_s": ev.blocked_s})]
        if isinstance(ev, CheckpointCommitted | CheckpointSkipped):
            self.engine.platform_finished(f"checkpoint-{ev.step}", ev.time)
        elif isinstance(ev, SegmentStart):
            self.engine.segment_started(ev.world_size)
        return []

    def platform_started(self, key: str, at: float) -> None:
        """The flow works on this job (commit bookkeeping, an evaluation): steps meanwhile are not judged."""
        self.engine.platform_started(key, at)

    def platform_finished(self, key: str, at: float) -> None:
        self.engine.platform_finished(key, at)

    def check_stalled(self, now: float) -> None:
        if self.last_progress is not None:
            self.alerts += self.engine.check_stalled(self.last_step, now - self.last_progress)

    def take_alerts(self) -> list[Alert]:
        out, self.alerts = self.alerts, []
        return out
