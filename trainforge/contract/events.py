"""`SegmentEvent`: every message a worker (or the control plane's supervisor, about a worker) sends, typed.

One pydantic model per message, discriminated by `type`; a `v` schema version; the `time` it was made; the
sender's identity (`src`: job, segment attempt, rank, host, node) where known. The on-disk / on-the-wire form is the
flat JSON object the readers of events.jsonl have always read (`{"type": "metrics", "step": 3, "loss": ...}`), plus
`v` and `src`; `dump_event` writes it and `parse_event` reads it back, naming the field when a message is wrong.

Senders construct these models, so a misspelt or mistyped field fails at the sender, not in the flow an hour
later. Pure: importable without torch (the trainer and the control plane both import it).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, ValidationError

SCHEMA_VERSION = 1
"""The version this code writes and the newest it reads. Bump it when a change would mislead an older reader
(a field's meaning changes, a required field appears); adding an optional field does not need a bump."""


class EventError(ValueError):
    """A message that is not a valid SegmentEvent: the text names the event type and the field."""


class UnsupportedEventVersion(EventError):
    """A message written by a newer trainforge (schema version above SCHEMA_VERSION)."""

    def __init__(self, kind: str, version: int):
        super().__init__(f"event {kind!r} has schema version {version}, newer than the {SCHEMA_VERSION} this "
                         f"trainforge reads: upgrade trainforge on the control plane to the workers' version")
        self.kind, self.version = kind, version


class Sender(BaseModel):
    """Who sent a message. Unknown parts stay None (a single-process trainer has no node; the supervisor no rank)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    job: str | None = None
    attempt: int | None = None
    """The segment attempt: fencing and de-duplication across retries use it."""
    rank: int | None = None
    host: str | None = None
    node: int | None = None


def _a_number(value: Any) -> Any:
    # JSON numbers only: pydantic's lax mode would turn True into 1.0 and "3" into 3.0, logging a flag or a
    # name as a metric.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"a metric must be a number, got {type(value).__name__} {value!r}")
    return value


MetricValue = Annotated[float, BeforeValidator(_a_number)]
"""A metric: a JSON number (int or float; NaN and infinities allowed: a diverged loss is reported as it is)."""


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    v: int = SCHEMA_VERSION
    time: float = Field(default_factory=time.time)
    src: Sender | None = None


class _MetricMap(_Event):
    """An event whose payload is a free map of metric name -> number, written flat beside the fixed fields (the
    historical format). Only numbers are accepted as extra fields; `values()` is the map."""

    model_config = ConfigDict(extra="allow", frozen=True)
    __pydantic_extra__: dict[str, MetricValue] = Field(init=False)  # type: ignore[assignment]
    _FIXED: ClassVar[frozenset[str]] = frozenset({"type", "v", "time", "src", "step"})

    def values(self) -> dict[str, float]:
        """Every numeric field except the step: what goes to the tracker as metrics."""
        out: dict[str, float] = {}
        for name, value in dict(self).items():
            if name not in self._FIXED and isinstance(value, int | float) and not isinstance(value, bool):
                out[name] = float(value)
        return out


# ---- metrics and telemetry ----------------------------------------------------------------------------------------

class Metrics(_MetricMap):
    """One optimizer step's metrics (rank 0): loss, lr, timings, throughput, the step-time split, MFU, and in
    script mode whatever scalars the user's script logs."""

    type: Literal["metrics"] = "metrics"
    step: int
    loss: MetricValue | None = None
    grad_norm: MetricValue | None = None
    lr: MetricValue | None = None
    step_time_s: MetricValue | None = None
    tokens_per_s: MetricValue | None = None
    samples_per_s: MetricValue | None = None

    @classmethod
    def of(cls, step: int, values: Mapping[str, float]) -> Metrics:
        """A step's metrics from a free map (script mode's `log_metrics`): a name that is one of the event's own
        fields (`time`, `v`, `src`, `type`) would overwrite it, so it is refused by name."""
        reserved = sorted(set(values) & {"type", "v", "time", "src", "step"})
        if reserved:
            raise EventError(f"metric name(s) {reserved} are reserved by the event format (fields type, v, time, "
                             "src, step): rename the metric")
        return cls(step=step, **values)


class RankMetrics(_MetricMap):
    """The per-rank aggregate of a step: `<field>_{min,median,max}`, `straggler_rank`, `straggler_ratio`."""

    type: Literal["rank_metrics"] = "rank_metrics"
    step: int


class MetricsMeta(_Event):
    """What the metrics of a segment are measured against (once per segment)."""

    type: Literal["metrics_meta"] = "metrics_meta"
    step: int
    peak_flops: float
    peak_source: str
    flops_per_token: float
    world_size: int
    bubble_fraction: float


class System(_MetricMap):
    """A node's telemetry sample (NVML on GPUs, CPU % and RSS on a CPU host)."""

    type: Literal["system"] = "system"
    step: int
    source: str
    _FIXED: ClassVar[frozenset[str]] = frozenset({"type", "v", "time", "src", "step", "source"})


class Profile(_Event):
    """A torch.profiler window's summary from one rank (the traces themselves stay artifacts)."""

    type: Literal["profile"] = "profile"
    rank: int
    start_step: int
    end_step: int
    trace: str | None = None
    """The object-store key of the rank's Chrome trace in the job's store (its per-rank summary JSON sits beside
    it, `.trace.json` -> `.summary.json`): the worker uploads both, so the control side needs no shared disk."""
    summary: dict[str, MetricValue] = Field(default_factory=dict)


class StackDump(_Event):
    """One rank's Python stacks (faulthandler, every thread), answering a `dump_stacks` command: the node's sidecar
    reads the rank's faulthandler file on its own node after the signal and sends the text up the channel. The
    control side keeps the text in the job's artifacts/stacks/ and journals the event without it (`artifact`)."""

    type: Literal["stack_dump"] = "stack_dump"
    rank: int
    restart: int = 0
    """torchrun's restart generation of the rank that dumped."""
    text: str = ""
    """faulthandler's output for this dump (empty in the journal's copy, where `artifact` says where it is)."""
    truncated: bool = False
    """The dump was longer than the sidecar sends (its head is kept: the innermost frames of each thread)."""
    cmd_seq: int | None = None
    """The `dump_stacks` command answered."""
    artifact: str | None = None
    """Where the control side keeps the text, relative to the job's folder."""


# ---- liveness -----------------------------------------------------------------------------------------------------

Phase = Literal["starting", "training", "closing", "done", "failed", "preempted", "terminated", "script"]


class GpuDevice(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    index: int
    ecc_uncorrected: int | None = None
    temperature_c: int | None = None
    sm_clock_mhz: int | None = None
    throttle_reasons: int | None = None
    retired_pages: int | None = None
    retired_pages_pending: int | None = None
    xids: list[int] = Field(default_factory=list)
    """The latest Xid events of the device (critical ones, trainer/health.py CRITICAL_XIDS, make it unhealthy)."""
    reasons: list[str] = Field(default_factory=list)
    """Why it is unhealthy, in words (empty when healthy)."""
    healthy: bool


class GpuHealth(BaseModel):
    """trainer/health.py `gpu_health()`: NVML's view of the node's GPUs, or why there is none."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    available: bool
    reason: str | None = None
    devices: list[GpuDevice] = Field(default_factory=list)
    healthy: bool | None = None


class Heartbeat(_Event):
    """A rank's liveness and progress, every `heartbeat_interval_s` (the supervisor's input: pid and age for
    liveness, step / steps_done for hangs, local_s for stragglers, phase_note for termination notices)."""

    type: Literal["heartbeat"] = "heartbeat"
    rank: int
    pid: int
    restart: int = 0
    """torchrun's restart generation of the gang."""
    host: str | None = None
    netns: str | None = None
    """The rank's own network namespace as it sees it (`/proc/self/ns/net`, e.g. `net:[4026532288]`)."""
    address: str | None = None
    """The rank's own address towards its gang's rendezvous (the source address the kernel picks for it)."""
    phase: Phase
    phase_note: str | None = None
    step: int | None = None
    step_started: float | None = None
    steps_done: int = 0
    step_s: float | None = None
    """Median time per step over the last few steps."""
    local_s: float | None = None
    """Median time of this rank's own work before the step's first collective (the straggler signal)."""
    started: float | None = None
    resumed_from: int | None = None
    gpu: GpuHealth | None = None


# ---- checkpoints --------------------------------------------------------------------------------------------------

class CheckpointStaged(_Event):
    """A save's host copy is complete; `blocked_s` is how long it held the step loop."""

    type: Literal["checkpoint_staged"] = "checkpoint_staged"
    step: int
    blocked_s: float


class CheckpointCommitted(_Event):
    """A checkpoint's manifest is written: it exists (on disk as type `checkpoint`)."""

    type: Literal["checkpoint"] = "checkpoint"
    step: int
    prefix: str
    metrics: dict[str, MetricValue] = Field(default_factory=dict)


class CheckpointCorrupt(_Event):
    """A committed checkpoint failed verification on restore and was skipped."""

    type: Literal["checkpoint_corrupt"] = "checkpoint_corrupt"
    step: int
    problems: list[str]


class CheckpointSkipped(_Event):
    """A staged checkpoint that was never committed (superseded by a later commit)."""

    type: Literal["checkpoint_skipped"] = "checkpoint_skipped"
    step: int
    reason: str


# ---- faults -------------------------------------------------------------------------------------------------------

FailureKind = Literal["user", "infra", "divergence"]


class FailureReport(_Event):
    """A rank's own report of the exception that ends it (trainer/worker.py `write_failure`)."""

    type: Literal["failure"] = "failure"
    rank: int
    attempt: int
    restart: int = 0
    host: str | None = None
    failure: FailureKind = Field(alias="kind")
    """`user` faults are not retried forever, `infra` ones are what retries exist for, `divergence` rolls back.
    On the wire this field is `kind` (the failure files' historical name)."""
    exception: str
    traceback: str
    step: int | None = None
    reason: str | None = None
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, serialize_by_alias=True)


class Divergence(_Event):
    """Training diverged at `step` (0-based index of the batch that produced the bad loss)."""

    type: Literal["divergence"] = "divergence"
    step: int
    reason: str
    action: Literal["rollback", "stop"]
    samples: list[int] = Field(default_factory=list)
    """The offending batch's global sample indices (skipped on rollback)."""


class Notice(_Event):
    """A notice to a gang or from it: preemption (the scheduler wants the GPUs back), resize (the allocation grew
    or shrank) or termination (a node's termination notice, e.g. a spot reclaim). Answered with an emergency
    checkpoint at the next step boundary."""

    type: Literal["notice"] = "notice"
    notice: Literal["preemption", "resize", "termination"]
    message: str
    deadline: float | None = None
    target_workers: int | None = None


IncidentKind = Literal["rank_lost", "hang", "straggler", "straggler_evicted", "preemption", "resize",
                       "gpu_unhealthy", "divergence", "network_cut"]
FATAL_INCIDENTS = ("rank_lost", "hang", "straggler_evicted", "gpu_unhealthy", "network_cut")
"""The supervisor's findings that end a segment (tasks/supervisor.py): one of them is what stopped a failed one."""


class FaultDetected(_Event):
    """The supervisor (or a worker's own report) detected a fault; `action` is what the policy does about it."""

    type: Literal["fault_detected"] = "fault_detected"
    fault: IncidentKind
    rank: int | None = None
    message: str
    action: str
    step: int | None = None
    attempt: int
    detected_at: float


class Recovered(_Event):
    """The first step completed after the restore that followed a detection: MTTR and lost work."""

    type: Literal["recovered"] = "recovered"
    fault: IncidentKind
    rank: int | None = None
    mttr_s: float
    resumed_from: int
    lost_steps: int | None = None
    attempt: int
    tier: Literal["in-segment restart", "resume after preemption", "resume after resize", "segment retry"]


class Resize(_Event):
    """An elastic job's gang changed size between segments."""

    type: Literal["resize"] = "resize"
    reason: str
    from_workers: int
    to_workers: int
    from_dp: int
    to_dp: int
    accumulation: list[int]
    """Gradient accumulation steps before and after."""
    micro_batch_size: int
    global_batch_size: int
    nodes: list[str] = Field(default_factory=list)
    after_step: int | None = None
    """The newest committed checkpoint: the step the resized gang resumes from."""


# ---- segment boundaries -------------------------------------------------------------------------------------------

class SegmentStart(_Event):
    type: Literal["segment_start"] = "segment_start"
    step: int
    world_size: int
    resumed_from: int | None = None
    mode: Literal["script"] | None = None


SegmentEndReason = Literal["finished", "segment_max_steps", "preempted"]


class SegmentEnd(_Event):
    type: Literal["segment_end"] = "segment_end"
    step: int
    reason: SegmentEndReason
    mode: Literal["script"] | None = None


class AccessDenied(_Event):
    """The object store refused a request a worker made with the job's own identity (a read or write outside its
    grant: another team's checkpoints, the channel's commands). Recorded by the flow in the job record's
    `security` list; the refusal itself is the server's."""

    type: Literal["access_denied"] = "access_denied"
    operation: str
    """The S3 API call (GetObject, PutObject, ListObjectsV2, ...)."""
    bucket: str | None = None
    key: str | None = None
    """The object key or listing prefix asked for."""
    code: str = "AccessDenied"


# ---- the union ----------------------------------------------------------------------------------------------------

EVENT_TYPES: tuple[type[_Event], ...] = (
    Metrics, RankMetrics, MetricsMeta, System, Profile, StackDump, Heartbeat, CheckpointStaged, CheckpointCommitted,
    CheckpointCorrupt, CheckpointSkipped, FailureReport, Divergence, Notice, FaultDetected, Recovered, Resize,
    SegmentStart, SegmentEnd, AccessDenied,
)

SegmentEvent = Annotated[
    Metrics | RankMetrics | MetricsMeta | System | Profile | StackDump | Heartbeat | CheckpointStaged
    | CheckpointCommitted | CheckpointCorrupt | CheckpointSkipped | FailureReport | Divergence | Notice
    | FaultDetected | Recovered | Resize | SegmentStart | SegmentEnd | AccessDenied,
    Field(discriminator="type"),
]

KINDS: dict[str, type[_Event]] = {cls.model_fields["type"].default: cls for cls in EVENT_TYPES}
_ADAPTER: TypeAdapter[Any] = TypeAdapter(SegmentEvent)


def parse_event(data: Mapping[str, Any]) -> SegmentEvent:
    """A message (a JSON object) -> its typed event. Raises EventError naming the event type and the field, or
    UnsupportedEventVersion for a message from a newer schema."""
    if not isinstance(data, Mapping):
        raise EventError(f"an event must be a JSON object, got {type(data).__name__}")
    kind = data.get("type")
    if not isinstance(kind, str) or kind not in KINDS:
        raise EventError(f"unknown event type {kind!r} (field 'type'); known: {', '.join(sorted(KINDS))}")
    version = data.get("v", 1)  # lines written before the schema was versioned are version 1
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise EventError(f"event {kind!r}: field 'v' must be a positive integer schema version, got {version!r}")
    if version > SCHEMA_VERSION:
        raise UnsupportedEventVersion(kind, version)
    try:
        return _ADAPTER.validate_python(dict(data))
    except ValidationError as exc:
        raise EventError(f"event {kind!r}: " + "; ".join(_describe(e) for e in exc.errors())) from None


def _describe(err: Any) -> str:
    loc = [str(p) for p in err["loc"]]
    if loc and loc[0] in KINDS:  # the union's own tag in front of the field path
        loc = loc[1:]
    field = ".".join(loc) or "(the event)"
    return f"field {field!r}: {err['msg']}" + (f" (got {err['input']!r})" if err["type"] != "missing" else "")


def dump_event(event: _Event) -> dict[str, Any]:
    """The event as the flat JSON object readers expect (NaN / inf losses stay floats: json writes them as
    NaN / Infinity, as the writers always have)."""
    out = event.model_dump(by_alias=True)
    if isinstance(event, _MetricMap):  # an optional metric not measured is absent, as it always was
        out = {k: v for k, v in out.items() if v is not None}
    elif out.get("src") is None:
        out.pop("src", None)
    return out


def from_file(kind: type[Heartbeat] | type[FailureReport], data: Mapping[str, Any]) -> Any:
    """A heartbeat file (trainer/health.py) or a failure report file (trainer/worker.py) as its typed event: the
    files predate the union and carry no `type`."""
    return parse_event({**data, "type": kind.model_fields["type"].default})

