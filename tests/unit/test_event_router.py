"""The segment's events (trainforge/contract/events.py) and the control side's EventRouter (contract/router.py):
every event type round-trips through its wire form, a malformed or newer event is a clear error, the senders'
sinks write what the readers read, and the router's table: event in -> actions out.

Run: .venv/bin/python -m pytest tests/unit/test_event_router.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import types

import pytest

from trainforge.contract.events import (
    EVENT_TYPES,
    KINDS,
    SCHEMA_VERSION,
    AccessDenied,
    CheckpointCommitted,
    CheckpointCorrupt,
    CheckpointSkipped,
    CheckpointStaged,
    Divergence,
    EventError,
    FailureReport,
    FaultDetected,
    GpuHealth,
    Heartbeat,
    Metrics,
    MetricsMeta,
    Notice,
    Profile,
    RankMetrics,
    Recovered,
    Resize,
    SegmentEnd,
    SegmentStart,
    Sender,
    StackDump,
    System,
    UnsupportedEventVersion,
    dump_event,
    from_file,
    parse_event,
)
from trainforge.contract.router import EventRouter, Log, RecordResume, StartBookkeeping, TrackMetrics
from trainforge.events import AsyncEventWriter, EventWriter, read_events, read_typed_events
from trainforge.registry.alerts import DEFAULT_RULES, MetricsObserver

SRC = Sender(job="demo-1", attempt=2, rank=0, host="node-a", node=0)

# One instance of every message, with every field a reader uses.
SAMPLES = [
    Metrics(step=3, loss=2.5, grad_norm=0.9, lr=1e-3, step_time_s=0.2, tokens_per_s=5e3, samples_per_s=40.0,
            mfu=0.31, compute_s=0.15, peak_mem_bytes=3e8, src=SRC),
    RankMetrics(step=3, step_time_s_min=0.19, step_time_s_median=0.2, step_time_s_max=0.3, straggler_rank=1.0,
                straggler_ratio=1.4),
    MetricsMeta(step=0, peak_flops=1e12, peak_source="catalog", flops_per_token=6e6, world_size=4,
                bubble_fraction=0.1),
    System(step=3, source="cpu", cpu_percent=95.0, workers_rss_bytes=6e8),
    Profile(rank=1, start_step=10, end_step=12, trace="teams/t/jobs/demo-1/profiles/segment-2/rank1.trace.json",
            summary={"overlap_fraction": 0.6}),
    StackDump(rank=1, restart=0, text='Thread 0x1 (most recent call first):\n  File "x.py", line 3 in f\n',
              cmd_seq=7, src=Sender(rank=1, host="node-a")),
    Heartbeat(rank=1, pid=4242, restart=1, host="node-a", phase="training", step=7, step_started=1.0, steps_done=3,
              step_s=0.2, local_s=0.05, started=0.5, resumed_from=4,
              gpu=GpuHealth(available=False, reason="NVML not available on this host")),
    CheckpointStaged(step=4, blocked_s=0.25),
    CheckpointCommitted(step=4, prefix="checkpoints/step-00000004", metrics={"train_loss": 2.4}),
    CheckpointCorrupt(step=8, problems=["model.safetensors: sha256 mismatch"]),
    CheckpointSkipped(step=6, reason="superseded by step 8"),
    FailureReport(rank=1, attempt=2, restart=0, host="node-b", failure="infra", exception="DistNetworkError: reset",
                  traceback="Traceback (most recent call last): ...", step=None),
    Divergence(step=11, reason="loss is nan", action="rollback", samples=[88, 89, 90]),
    Notice(notice="resize", message="the scheduler shrank the allocation to 2 GPUs", target_workers=2),
    FaultDetected(fault="rank_lost", rank=1, message="rank 1 lost: its process died", action="segment retry",
                  step=7, attempt=2, detected_at=100.0, src=Sender(job="demo-1", attempt=2)),
    Recovered(fault="rank_lost", rank=1, mttr_s=11.0, resumed_from=4, lost_steps=3, attempt=3, tier="segment retry"),
    Resize(reason="grown into idle capacity", from_workers=2, to_workers=4, from_dp=2, to_dp=4, accumulation=[2, 1],
           micro_batch_size=4, global_batch_size=16, nodes=["n0", "n1"], after_step=8),
    SegmentStart(step=4, world_size=2, resumed_from=4),
    SegmentEnd(step=10, reason="finished", mode="script"),
    AccessDenied(operation="PutObject", bucket="ckpts", key="teams/vision/jobs/x/checkpoints/m.json",
                 src=Sender(job="demo-1", attempt=2, rank=0)),
]


def test_every_event_type_has_a_sample_and_round_trips():
    assert {type(s) for s in SAMPLES} == set(EVENT_TYPES)
    assert set(KINDS) == {dump_event(s)["type"] for s in SAMPLES}
    for sample in SAMPLES:
        wire = json.loads(json.dumps(dump_event(sample)))  # through JSON text, as the file and the channel carry it
        assert wire["v"] == SCHEMA_VERSION and wire["type"] == type(sample).model_fields["type"].default
        assert parse_event(wire) == sample, type(sample).__name__


def test_wire_form_is_the_flat_historical_format():
    wire = dump_event(SAMPLES[0])
    assert wire["step"] == 3 and wire["loss"] == 2.5 and wire["mfu"] == 0.31  # metrics beside the fixed fields
    assert wire["src"] == {"job": "demo-1", "attempt": 2, "rank": 0, "host": "node-a", "node": 0}
    assert "grad_norm" not in dump_event(Metrics(step=1, loss=1.0))  # not measured: absent, as before
    assert dump_event(SegmentStart(step=0, world_size=1))["resumed_from"] is None  # readers index it
    failure = dump_event(next(s for s in SAMPLES if isinstance(s, FailureReport)))
    assert failure["kind"] == "infra" and "failure" not in failure  # the failure files' field name
    nan = parse_event(json.loads(json.dumps(dump_event(Metrics(step=2, loss=float("nan"))))))
    assert nan.loss != nan.loss  # a diverged loss is reported as it is
    # Lines written before the schema was versioned (no `v`, no `src`) are version 1.
    old = parse_event({"type": "checkpoint", "step": 4, "prefix": "p", "metrics": {}, "time": 5.0})
    assert isinstance(old, CheckpointCommitted) and old.v == 1 and old.src is None


@pytest.mark.parametrize(("data", "field", "why"), [
    ({"type": "metrics", "loss": 1.0}, "step", "Field required"),
    ({"type": "metrics", "step": 1, "note": "warm"}, "note", "must be a number"),
    ({"type": "metrics", "step": 1, "flag": True}, "flag", "must be a number"),
    ({"type": "checkpoint", "step": "four", "prefix": "p"}, "step", "valid integer"),
    ({"type": "checkpoint_staged", "step": 1, "blocked_s": 0.1, "bloked_s": 0.1}, "bloked_s", "Extra inputs"),
    ({"type": "segment_end", "step": 3, "reason": "bored"}, "reason", "'finished'"),
    ({"type": "fault_detected", "fault": "gremlins", "message": "m", "action": "a", "attempt": 0,
      "detected_at": 1.0}, "fault", "rank_lost"),
    ({"type": "heartbeat", "rank": 0, "pid": 1, "phase": "training", "gpu": {"available": "maybe"}},
     "gpu.available", "valid boolean"),
    ({"type": "metrics", "step": 1, "src": {"job": "j", "rnak": 0}}, "src.rnak", "Extra inputs"),
])
def test_a_malformed_event_is_an_error_naming_the_field(data, field, why):
    with pytest.raises(EventError) as err:
        parse_event(data)
    text = str(err.value)
    assert f"event {data['type']!r}" in text and f"field {field!r}" in text and why in text, text


def test_unknown_types_and_future_versions_are_clear_errors():
    with pytest.raises(EventError, match=r"unknown event type 'checkpoint_teleported' \(field 'type'\); known: "):
        parse_event({"type": "checkpoint_teleported", "step": 1})
    with pytest.raises(EventError, match="an event must be a JSON object"):
        parse_event([1, 2])  # type: ignore[arg-type]
    with pytest.raises(EventError, match="field 'v' must be a positive integer"):
        parse_event({"type": "metrics", "step": 1, "v": "2"})
    with pytest.raises(UnsupportedEventVersion, match=f"schema version {SCHEMA_VERSION + 1}, newer than the "
                                                      f"{SCHEMA_VERSION} .* upgrade trainforge on the control plane"):
        parse_event({"type": "metrics", "step": 1, "v": SCHEMA_VERSION + 1})


def test_a_wrong_field_fails_at_the_sender():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="blocked_s"):
        CheckpointStaged(step=4, blocked=0.25)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="a metric must be a number"):
        Metrics(step=1, phase="warmup")


def test_sinks_stamp_the_sender_and_write_what_readers_read(tmp_path):
    writer = EventWriter(tmp_path, enabled=True, src=SRC)
    live = AsyncEventWriter(writer)
    writer.publish(SegmentStart(step=0, world_size=2))
    for step in range(1, 4):
        live.publish(Metrics(step=step, loss=3.0 - step))
    live.close()
    writer.publish(FaultDetected(fault="hang", message="m", action="a", attempt=2, detected_at=1.0,
                                 src=Sender(job="demo-1", attempt=2)))  # an explicit sender is kept
    (tmp_path / "events.jsonl").open("a").write('{"type": "metrics"}\n{"type": "checkpoint", "v": 9}\n')
    writer.publish(SegmentEnd(step=3, reason="finished"))
    raw, _ = read_events(tmp_path / "events.jsonl")
    assert [e["type"] for e in raw][:5] == ["segment_start", "metrics", "metrics", "metrics", "fault_detected"]
    assert raw[1]["src"]["rank"] == 0 and raw[4]["src"] == {"job": "demo-1", "attempt": 2, "rank": None,
                                                          "host": None, "node": None}
    events, offset, problems = read_typed_events(tmp_path / "events.jsonl")
    assert [type(e) for e in events] == [SegmentStart, Metrics, Metrics, Metrics, FaultDetected, SegmentEnd]
    assert offset == (tmp_path / "events.jsonl").stat().st_size
    assert len(problems) == 2 and "field 'step': Field required" in problems[0] and "schema version 9" in problems[1]
    assert all(e.src is not None and e.src.job == "demo-1" for e in events)
    ends, _, problems = read_typed_events(tmp_path / "events.jsonl", only=(SegmentEnd,))
    assert [type(e) for e in ends] == [SegmentEnd] and problems == []  # the other lines are not even validated
    disabled = EventWriter(tmp_path / "off", enabled=False)
    disabled.publish(SegmentEnd(step=1, reason="finished"))
    assert not (tmp_path / "off").exists()


def test_a_heartbeat_through_the_channel_and_a_failure_file_are_typed_events(tmp_path, monkeypatch):
    from trainforge.contract.channel import ChannelReader, NodePublisher
    from trainforge.infra.storage import LocalObjectStore
    from trainforge.tasks.supervisor import rank_beats
    from trainforge.trainer.health import HealthMonitor, HealthPolicy, gpu_health
    from trainforge.trainer.worker import write_failure

    monkeypatch.setenv("TRAINFORGE_SEGMENT_ATTEMPT", "1")
    try:
        raise ConnectionError("connection reset by peer")
    except ConnectionError as exc:
        write_failure(types.SimpleNamespace(run_dir=str(tmp_path)), 3, exc)  # no publisher: run_dir/failures
    [path] = (tmp_path / "failures").glob("segment-1-rank-*.json")
    report = from_file(FailureReport, json.loads(path.read_text()))
    assert report.rank == 3 and report.attempt == 1 and report.failure == "infra"
    assert report.exception.startswith("ConnectionError") and "Traceback" in report.traceback

    # The monitor's beat, through its node's real publisher (a Unix socket, as from the sidecar) and the channel.
    sock = f"@tf-event-router-{id(tmp_path)}"
    monkeypatch.setenv("TRAINFORGE_CHANNEL_SOCKET", sock)
    monkeypatch.setattr("trainforge.events._CLIENT", None)
    store = LocalObjectStore(tmp_path / "objects")
    reader = ChannelReader(store, "ch", nodes=["node-0"], flush_interval_s=0.05)
    with NodePublisher(store, "ch", "node-0", flush_interval_s=0.05, socket_path=sock):
        mon = HealthMonitor(HealthPolicy(), tmp_path, rank=3, attempt=1, handle_sigterm=False)
        mon._state["gpu"] = gpu_health()
        mon.attach(None, 4)
        mon.begin_step(4)
        mon.local_done()
        mon._write()
        deadline = time.monotonic() + 10
        while 3 not in (beats := rank_beats(reader)) or beats[3].beat.step is None:
            assert time.monotonic() < deadline, "the beat did not come through the channel"
            reader.poll()
            time.sleep(0.02)
        mon._client.close()
    reader.close()
    beat = beats[3].beat
    assert isinstance(beat, Heartbeat) and beat.rank == 3 and beat.phase == "training" and beat.step == 4
    assert beat.resumed_from == 4 and beat.local_s is not None and beat.gpu is not None
    assert not (tmp_path / "health").exists()  # no heartbeat file: the channel is the only way up


def test_the_contract_imports_without_torch():
    code = ("import sys; import trainforge.contract.events, trainforge.contract.router, trainforge.events; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---- the router's table ---------------------------------------------------------------------------------------

ROUTES = [
    (CheckpointCommitted(step=8, prefix="p"), set(), [StartBookkeeping(8)]),
    (CheckpointCommitted(step=8, prefix="p"), {8}, []),  # already booked (an earlier run of the job)
    (FaultDetected(fault="hang", rank=2, message="hang: rank 2 stuck at x.py:3", action="dump stacks", attempt=1,
                   detected_at=1.0), set(), [Log("warning", "fault_detected: hang: rank 2 stuck at x.py:3")]),
    (Recovered(fault="hang", rank=2, mttr_s=9.5, resumed_from=8, lost_steps=None, attempt=2, tier="segment retry"),
     set(), [Log("warning", "recovered: {'fault': 'hang', 'mttr_s': 9.5, 'resumed_from': 8, 'lost_steps': None, "
                            "'tier': 'segment retry'}"),
             TrackMetrics([(8, {"mttr_s": 9.5, "lost_steps": 0.0})])]),
    (CheckpointCorrupt(step=12, problems=["missing manifest"]), set(),
     [Log("warning", "skipped corrupt checkpoint step 12: ['missing manifest']")]),
    (Resize(reason="shrunk", from_workers=4, to_workers=2, from_dp=4, to_dp=2, accumulation=[1, 2],
            micro_batch_size=4, global_batch_size=16, after_step=None), set(), [TrackMetrics([(0, {"world_size": 2.0})])]),
    (SegmentStart(step=16, world_size=2, resumed_from=16), set(),
     [Log("info", "segment resumed from committed checkpoint step 16"), RecordResume(16)]),
    (SegmentStart(step=0, world_size=2, resumed_from=None), set(), []),
    (SegmentEnd(step=10, reason="finished"), set(), []),
    (CheckpointSkipped(step=6, reason="superseded"), set(), []),
    (Heartbeat(rank=0, pid=1, phase="training"), set(), []),
    # A rank's own accounts: information only; the incident (and the one warning) is the supervisor's
    # FaultDetected of the same fault, so nothing is counted twice.
    (Divergence(step=11, reason="loss is nan", action="rollback", src=Sender(rank=0)), set(),
     [Log("info", "divergence reported by rank 0 at step 12: loss is nan (policy: rollback)")]),
    (Notice(notice="preemption", message="emergency checkpoint", src=Sender(rank=0)), set(),
     [Log("info", "preemption notice received by rank 0: emergency checkpoint")]),
    (StackDump(rank=1, restart=0, artifact="artifacts/stacks/segment-0/rank-00001-restart-0.txt"), set(),
     [Log("info", "stacks of rank 1 (restart 0) dumped: artifacts/stacks/segment-0/rank-00001-restart-0.txt")]),
    (Profile(rank=1, start_step=5, end_step=6, trace="p/rank1.trace.json"), set(),
     [Log("info", "profile of steps 5:6 from rank 1: p/rank1.trace.json")]),
]


@pytest.mark.parametrize(("event", "committed", "actions"), ROUTES, ids=lambda x: type(x).__name__)
def test_router_table(event, committed, actions):
    assert EventRouter().route(event, committed) == actions


def test_router_sends_metrics_through_the_observer_and_books_each_commit_once():
    observer = MetricsObserver(DEFAULT_RULES, {"mfu": 0.4, "step_time_s": 0.5})
    router = EventRouter(observe=observer.rows)
    batch = [Metrics(step=4, time=10.0, loss=2.0, step_time_s=1.0, mfu=0.2), CheckpointStaged(step=4, blocked_s=0.1),
             CheckpointCommitted(step=4, prefix="p"), CheckpointCommitted(step=4, prefix="p"),
             RankMetrics(step=4, step_time_s_max=1.3), System(step=4, source="cpu", cpu_percent=50.0),
             Metrics(step=5, time=11.0, loss=float("nan"), step_time_s=1.0)]
    actions = router.route_all(batch)
    assert [a for a in actions if isinstance(a, StartBookkeeping)] == [StartBookkeeping(4)]
    rows = [r for a in actions if isinstance(a, TrackMetrics) for r in a.rows]
    assert rows[0] == (4, {"loss": 2.0, "step_time_s": 1.0, "mfu": 0.2, "mfu_predicted": 0.4,
                           "plan_attainment": 0.5})
    assert (4, {"checkpoint_stall_s": 0.1}) in rows and (4, {"ranks/step_time_s_max": 1.3}) in rows
    assert (4, {"system/cpu_percent": 50.0}) in rows
    assert "loss_nan" in [a.kind for a in observer.take_alerts()]
    assert router.route_all(batch[2:4], committed={4}) == []


def test_a_free_metric_map_cannot_overwrite_the_event_fields():
    assert Metrics.of(5, {"loss": 1.5, "accuracy": 0.9}).values() == {"loss": 1.5, "accuracy": 0.9}
    with pytest.raises(EventError, match=r"metric name\(s\) \['time', 'v'\] are reserved"):
        Metrics.of(5, {"time": 3.2, "v": 2.0, "loss": 1.0})
