"""Cost and chargeback (pure: job records and events in, numbers out; no I/O besides reading an optional price file).

GPU-hours of a job = Σ over its segments (each launch of the gang, failed ones included) of wall time x workers.
An elastic job's size changes between segments: each `resize` event (tasks/provision.py) sets the workers of the
segments and steps after it.
They are split so the parts add up exactly:
- productive: step time of steps that count (first time a step runs), minus data wait inside the step;
- lost: step time of steps recomputed after a failure (a step number already reached by an earlier segment);
- idle: the rest of the allocated time — start-up (process start, rendezvous, checkpoint load), data wait,
  checkpoint stalls, evaluation pauses, teardown and recovery;
- failed: every GPU-hour of a job that ended `failed` (nothing usable came out of it).
Queue time (submitted -> first segment start) holds no GPUs and is reported apart, not billed.
Checkpoint storage: bytes of each committed checkpoint x days kept x price per GB-month / 30.

Prices ($ per GPU-hour, on-demand and spot) are a config table: `DEFAULT_PRICES` are list-price assumptions of
late 2025 (H100 ~ $4/h on-demand in the big clouds' 8-GPU instances divided by 8, spot ~ 45%), replaced by
the YAML/JSON file named by $TRAINFORGE_PRICES: {gpu_type: {on_demand: X, spot: Y}, storage_gb_month: Z}.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainforge.contract.events import Metrics, Resize, SegmentEvent

COST_EVENTS = (Metrics, Resize)
"""The events the cost model reads."""

DEFAULT_PRICES: dict[str, dict[str, float]] = {
    "h200": {"on_demand": 5.00, "spot": 2.30},
    "h100": {"on_demand": 4.00, "spot": 1.80},
    "a100-80gb": {"on_demand": 2.50, "spot": 1.10},
    "a100-40gb": {"on_demand": 2.00, "spot": 0.90},
    "cpu": {"on_demand": 0.05, "spot": 0.02},  # one CPU worker slot
}
STORAGE_GB_MONTH = 0.023  # object storage, standard class
HOUR = 3600.0


def load_prices(env: Mapping[str, str] | None = None) -> tuple[dict[str, dict[str, float]], float]:
    path = (env if env is not None else os.environ).get("TRAINFORGE_PRICES")
    if not path:
        return DEFAULT_PRICES, STORAGE_GB_MONTH
    import yaml

    doc = yaml.safe_load(Path(path).read_text()) or {}
    storage = float(doc.pop("storage_gb_month", STORAGE_GB_MONTH))
    return {**DEFAULT_PRICES, **{k: {m: float(p) for m, p in v.items()} for k, v in doc.items()}}, storage


@dataclass
class JobCost:
    job_id: str
    team: str
    state: str
    gpu_type: str
    workers: int
    market: str
    price_per_gpu_hour: float
    gpu_hours: float = 0.0
    productive_hours: float = 0.0
    idle_hours: float = 0.0
    lost_hours: float = 0.0
    failed_hours: float = 0.0
    queue_hours: float = 0.0
    segments: int = 0
    failed_segments: int = 0
    resizes: int = 0
    storage_gb_days: float = 0.0
    compute_cost: float = 0.0
    storage_cost: float = 0.0
    created_at: float = 0.0

    @property
    def total_cost(self) -> float:
        return self.compute_cost + self.storage_cost

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total_cost": self.total_cost}


def step_hours(events: Iterable[SegmentEvent], workers: int) -> tuple[float, float, float]:
    """(productive, lost, data-wait) GPU-hours from `Metrics` events in file order: a step number at or below the
    highest already reached was recomputed after a failure. A `Resize` event changes the workers from there on."""
    productive = lost = wait = 0.0
    reached = 0
    for ev in events:
        if isinstance(ev, Resize):
            workers = ev.to_workers or workers
            continue
        if not isinstance(ev, Metrics):
            continue
        dt, step = float(ev.step_time_s or 0.0), ev.step
        data_wait = min(dt, ev.values().get("data_wait_s", 0.0))
        if step <= reached:
            lost += dt * workers
        else:
            productive += (dt - data_wait) * workers
            wait += data_wait * workers
            reached = step
    return productive / HOUR, lost / HOUR, wait / HOUR


def workers_at(events: Iterable[SegmentEvent], initial: int) -> list[tuple[float, int]]:
    """[(since, workers)] from the `Resize` events: the gang size in effect from each time on."""
    timeline = [(float("-inf"), initial)]
    for ev in events:
        if isinstance(ev, Resize) and ev.to_workers:
            timeline.append((ev.time, ev.to_workers))
    return sorted(timeline)


def job_cost(record: Mapping[str, Any], events: Iterable[SegmentEvent] = (), *,
             prices: Mapping[str, Mapping[str, float]] | None = None, storage_gb_month: float = STORAGE_GB_MONTH,
             market: str = "on_demand", now: float | None = None) -> JobCost:
    """The cost of one job from its record (segments, plan, checkpoints) and its typed events (step times and
    resizes; `trainforge.events.read_typed_events(path, only=COST_EVENTS)` reads just those)."""
    import time

    now = time.time() if now is None else now
    prices = prices or DEFAULT_PRICES
    spec = record.get("spec") or {}
    gpu_type = (spec.get("resources") or {}).get("gpu_type", "cpu")
    workers = int((record.get("plan") or {}).get("world_size") or (spec.get("resources") or {}).get("min_gpus", 1))
    if gpu_type not in prices:
        raise ValueError(f"no price for gpu type {gpu_type!r}; known: {', '.join(prices)} (set $TRAINFORGE_PRICES)")
    price = float(prices[gpu_type][market])
    cost = JobCost(record.get("job_id", "?"), record.get("team", "?"), record.get("state", "?"), gpu_type, workers,
                   market, price, created_at=float(record.get("created_at", 0.0)))
    segments = record.get("segments") or []
    events = list(events)
    timeline = workers_at(events, workers)
    cost.resizes = len(timeline) - 1
    for seg in segments:
        end = seg.get("ended_at") or now
        size = [w for since, w in timeline if since <= seg["started_at"]][-1]  # resized before this launch
        cost.gpu_hours += max(0.0, end - seg["started_at"]) * size / HOUR
        cost.segments += 1
        cost.failed_segments += seg.get("state") == "failed"
    if segments:
        cost.queue_hours = max(0.0, segments[0]["started_at"] - cost.created_at) / HOUR
    if cost.state == "failed":
        cost.failed_hours = cost.gpu_hours
    else:
        productive, lost, _ = step_hours(events, workers)
        # Clock skew or events of a segment still running can exceed the booked wall time: scale down, never over.
        scale = min(1.0, cost.gpu_hours / (productive + lost)) if productive + lost > 0 else 1.0
        cost.productive_hours, cost.lost_hours = productive * scale, lost * scale
        cost.idle_hours = cost.gpu_hours - cost.productive_hours - cost.lost_hours
    for ckpt in (record.get("checkpoints") or {}).values():
        since = ckpt.get("committed_at")
        since = since if since is not None else (cost.created_at or now)
        cost.storage_gb_days += ckpt.get("bytes", 0) / 1e9 * max(0.0, now - float(since)) / 86400
    cost.compute_cost = cost.gpu_hours * price
    cost.storage_cost = cost.storage_gb_days * storage_gb_month / 30
    return cost


@dataclass
class TeamCost:
    team: str
    jobs: int = 0
    gpu_hours: float = 0.0
    productive_hours: float = 0.0
    idle_hours: float = 0.0
    lost_hours: float = 0.0
    failed_hours: float = 0.0
    compute_cost: float = 0.0
    storage_cost: float = 0.0
    by_gpu_type: dict[str, float] = field(default_factory=dict)

    @property
    def total_cost(self) -> float:
        return self.compute_cost + self.storage_cost

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total_cost": self.total_cost}


def team_rollup(costs: Iterable[JobCost]) -> dict[str, TeamCost]:
    teams: dict[str, TeamCost] = {}
    for c in costs:
        t = teams.setdefault(c.team, TeamCost(c.team))
        t.jobs += 1
        for name in ("gpu_hours", "productive_hours", "idle_hours", "lost_hours", "failed_hours", "compute_cost",
                     "storage_cost"):
            setattr(t, name, getattr(t, name) + getattr(c, name))
        t.by_gpu_type[c.gpu_type] = t.by_gpu_type.get(c.gpu_type, 0.0) + c.gpu_hours
    return teams


def simulated_cost(gpu_seconds_by_type: Mapping[str, float], prices: Mapping[str, Mapping[str, float]] | None = None,
                   market: str = "on_demand") -> float:
    """Dollars for a simulated schedule's allocated GPU-seconds per GPU type (the simulator's report)."""
    prices = prices or DEFAULT_PRICES
    return sum(secs / HOUR * float(prices.get(t, prices["h100"])[market]) for t, secs in gpu_seconds_by_type.items())
