"""`EventRouter`: the control side's one reading of a segment's events. Pure: typed events in, typed actions out.

The flow (flows/train_job.py) performs the actions; the router decides nothing by string and does no I/O, so the
table test (tests/unit/test_event_router.py) covers every routing rule without a flow, a tracker or a database.

    Metrics / RankMetrics / System / CheckpointStaged -> TrackMetrics (through the metrics observer: alert rules)
    CheckpointCommitted (a step not yet booked)       -> StartBookkeeping (commit record, evaluation, retention)
    FaultDetected / Recovered                          -> Log (warning); Recovered -> TrackMetrics (mttr_s, lost_steps)
    CheckpointCorrupt                                  -> Log (warning)
    Resize                                             -> TrackMetrics (world_size at the step it resumes from)
    SegmentStart resumed from a checkpoint             -> Log (info) + RecordResume (lineage)
    Divergence (a rank's own account)                  -> Log (info); the incident itself is the supervisor's
                                                          FaultDetected(divergence), counted once, from the report
    Notice (a rank got a preemption / resize / termination notice) -> Log (info); the supervisor's
                                                          FaultDetected(preemption | resize) is the incident
    StackDump (a rank's stacks, text in artifacts/)    -> Log (info)
    Profile (a rank's profiler window is uploaded)     -> Log (info)
    AccessDenied (the store refused the job's identity) -> Log (warning) + RecordSecurity (the job record)
"""

from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Literal

from trainforge.contract.events import (
    AccessDenied,
    CheckpointCommitted,
    CheckpointCorrupt,
    Divergence,
    FaultDetected,
    Notice,
    Profile,
    Recovered,
    Resize,
    SegmentEvent,
    SegmentStart,
    StackDump,
)

MetricRow = tuple[int, dict[str, float]]
"""(step, metric name -> value): one row for the tracker."""


@dataclass(frozen=True, slots=True)
class TrackMetrics:
    rows: list[MetricRow]


@dataclass(frozen=True, slots=True)
class StartBookkeeping:
    """A checkpoint was committed: record it, evaluate it, apply retention."""

    step: int


@dataclass(frozen=True, slots=True)
class Log:
    level: Literal["info", "warning"]
    message: str


@dataclass(frozen=True, slots=True)
class RecordResume:
    """The segment resumed from the committed checkpoint of `step`: a lineage record."""

    step: int


@dataclass(frozen=True, slots=True)
class RecordSecurity:
    """Something the job's code tried and the platform refused: kept in the job record's `security` list."""

    entry: dict[str, object]


RoutedAction = TrackMetrics | StartBookkeeping | Log | RecordResume | RecordSecurity


def _no_rows(event: SegmentEvent) -> list[MetricRow]:
    return []


@dataclass
class EventRouter:
    """Routes one event at a time (`route`): the flow applies each action before routing the next event, so a
    StartBookkeeping it performed is in `committed` when a second commit of the same step comes in the same batch.

    `observe` maps an event to metric rows and runs the alert rules on the way (registry/alerts.py
    MetricsObserver.rows); it is injected because alert rules live on the control plane's side of the contract."""

    observe: Callable[[SegmentEvent], list[MetricRow]] = field(default=_no_rows)

    def route(self, event: SegmentEvent, committed: Container[int] = ()) -> list[RoutedAction]:
        actions: list[RoutedAction] = []
        rows = self.observe(event)
        if rows:
            actions.append(TrackMetrics(rows))
        match event:
            case CheckpointCommitted(step=step) if step not in committed:
                actions.append(StartBookkeeping(step))
            case FaultDetected():
                actions.append(Log("warning", f"fault_detected: {event.message}"))
            case Recovered():
                detail = {"fault": event.fault, "mttr_s": event.mttr_s, "resumed_from": event.resumed_from,
                          "lost_steps": event.lost_steps, "tier": event.tier}
                actions.append(Log("warning", f"recovered: {detail}"))
                actions.append(TrackMetrics([(event.resumed_from,
                                              {"mttr_s": event.mttr_s, "lost_steps": float(event.lost_steps or 0)})]))
            case CheckpointCorrupt():
                actions.append(Log("warning", f"skipped corrupt checkpoint step {event.step}: {event.problems}"))
            case Resize():  # elastic: the job record's `resizes` has the details; the tracker gets the world size
                actions.append(TrackMetrics([(event.after_step or 0, {"world_size": float(event.to_workers)})]))
            case SegmentStart(resumed_from=int(resumed)):
                actions.append(Log("info", f"segment resumed from committed checkpoint step {resumed}"))
                actions.append(RecordResume(resumed))
            case Divergence():  # informational: FaultDetected(divergence) is the one warning and the one incident
                rank = event.src.rank if event.src is not None else None
                actions.append(Log("info", f"divergence reported by rank {rank} at step {event.step + 1}: "
                                           f"{event.reason} (policy: {event.action})"))
            case Notice():
                rank = event.src.rank if event.src is not None else None
                actions.append(Log("info", f"{event.notice} notice received by rank {rank}: {event.message}"))
            case StackDump():
                actions.append(Log("info", f"stacks of rank {event.rank} (restart {event.restart}) dumped"
                                           + (f": {event.artifact}" if event.artifact else "")))
            case AccessDenied():
                rank = event.src.rank if event.src is not None else None
                actions.append(Log("warning", f"access denied by the object store to rank {rank}: "
                                              f"{event.operation} s3://{event.bucket}/{event.key or ''} ({event.code})"))
                actions.append(RecordSecurity({"event": "access_denied", "rank": rank, "operation": event.operation,
                                               "bucket": event.bucket, "key": event.key, "code": event.code,
                                               "time": event.time}))
            case Profile():
                actions.append(Log("info", f"profile of steps {event.start_step}:{event.end_step} from rank "
                                           f"{event.rank}: {event.trace}"))
        return actions

    def route_all(self, events: list[SegmentEvent], committed: set[int] | None = None) -> list[RoutedAction]:
        """Route a batch as the flow would, booking each StartBookkeeping into `committed` (a copy when given)."""
        booked = set(committed or ())
        out: list[RoutedAction] = []
        for event in events:
            actions = self.route(event, booked)
            booked.update(a.step for a in actions if isinstance(a, StartBookkeeping))
            out.extend(actions)
        return out
