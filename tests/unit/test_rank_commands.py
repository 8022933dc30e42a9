"""Commands down and their answers up, through the channel (no flow-host disk, no pid on the control side):
the node sidecar's stack dumps (a real rank process's faulthandler text comes back as a `StackDump`), the
supervisor naming a hang's culprit from those records and keeping artifacts/stacks/, the replay of a profile
window to a rank that registers late, the rank's command inbox, the `Notice` watch, the worker's `Divergence`,
and the profiler's upload of its trace with the `Profile` event that says where it is.

Run: PYTHONPATH=$PWD .venv/bin/python -m pytest tests/unit/test_rank_commands.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import types
from collections.abc import Callable
from pathlib import Path

import pytest

from trainforge.contract.channel import (
    ChannelReader,
    Command,
    CommandWriter,
    NodePublisher,
    RankClient,
    channel_root,
)
from trainforge.contract.events import Heartbeat, Sender, StackDump, dump_event
from trainforge.events import read_events
from trainforge.infra.backends.sidecar import NodeSidecar
from trainforge.infra.storage import LocalObjectStore
from trainforge.registry.jobs import JobStore
from trainforge.tasks.supervisor import RankBeat, SegmentSupervisor
from trainforge.trainer.health import HealthPolicy, node_stacks_dir, stacks_file_name
from trainforge.trainer.inbox import CommandInbox, NoticeWatch

pytestmark = pytest.mark.timeout(120)

ROOT = f"{channel_root('teams/t/jobs/j')}/segment-0"


def _wait(cond: Callable[[], bool], timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} not met in {timeout}s"
        time.sleep(0.02)


def _records(store: LocalObjectStore, kind: str) -> list[dict]:
    """Every record of `kind` in node n1's batches so far (a reader reads a bounded number of batches per poll)."""
    reader = ChannelReader(store, ROOT, nodes=["n1"], flush_interval_s=0.01)
    out: list[dict] = []
    try:
        while batches := reader.poll():
            out += [r for _, _, _, r in reader.records(batches) if r.get("type") == kind]
            time.sleep(0.01)
        return out
    finally:
        reader.close()


@pytest.fixture
def store(tmp_path: Path) -> LocalObjectStore:
    return LocalObjectStore(tmp_path / "objects")


RANK = textwrap.dedent("""
    import faulthandler, os, signal, sys, time
    from trainforge.contract.channel import RankClient
    from trainforge.trainer.health import node_stacks_dir, stacks_file_name
    sock = sys.argv[1]
    folder = node_stacks_dir(sock)
    folder.mkdir(parents=True, exist_ok=True)
    out = open(folder / stacks_file_name(2, 0), "w")
    faulthandler.register(signal.SIGUSR1, file=out, all_threads=True)
    client = RankClient(sock, 2)
    def waiting_in_user_code():
        while True:
            client.heartbeat(pid=os.getpid(), restart=0, phase="training", rank=2)
            time.sleep(0.05)
    waiting_in_user_code()
""")


@pytest.mark.slow
def test_the_sidecar_sends_a_ranks_faulthandler_dump_up_the_channel(store):
    sock = f"@tf-test-stacks-{os.getpid()}"
    pub = NodePublisher(store, ROOT, "n1", flush_interval_s=0.05, socket_path=sock).start()
    # Generous bounds (each ends as soon as its condition holds): a loaded host starts a Python process slowly.
    sidecar = NodeSidecar(pub, dump_wait_s=60.0)
    rank = subprocess.Popen([sys.executable, "-c", RANK, sock], env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        _wait(lambda: "2" in pub.beats(), timeout=90, what="the rank's first heartbeat")
        sidecar.dump_stacks(7).join(90)
        pub.wake()
        _wait(lambda: _records(store, "stack_dump"), timeout=60, what="the StackDump record")
        [rec] = _records(store, "stack_dump")
        assert (rec["rank"], rec["restart"], rec["cmd_seq"], rec["truncated"]) == (2, 0, 7, False)
        assert "in waiting_in_user_code" in rec["text"] and "File " in rec["text"]
    finally:
        rank.kill()
        rank.wait(10)
        pub.close()
        sidecar.cleanup()
    assert not node_stacks_dir(sock).exists()  # the node's dump folder goes with the sidecar


def test_the_sidecar_replays_a_profile_window_to_a_rank_that_reached_it_later(store):
    sock = f"@tf-test-window-{os.getpid()}"
    pub = NodePublisher(store, ROOT, "n1", flush_interval_s=0.05, socket_path=sock).start()
    sidecar = NodeSidecar(pub)
    try:
        window = Command(3, "profile_window", {"start_step": 5, "end_step": 6}, None, time.time())
        sidecar._on_command(window)  # delivered while the gang starts: no rank has reached the publisher yet
        late = RankClient(sock, 0)
        late.heartbeat(pid=os.getpid(), phase="starting")
        _wait(lambda: "0" in pub.beats(), what="the late rank's heartbeat")
        sidecar.watch_once()
        got: list[dict] = []
        _wait(lambda: got.extend(late.poll_commands()) or got, what="the replayed window")
        assert [(c["seq"], c["kind"], c["args"]) for c in got] == [(3, "profile_window",
                                                                    {"start_step": 5, "end_step": 6})]
        sidecar.watch_once()  # given once
        time.sleep(0.1)
        assert late.poll_commands() == []
    finally:
        pub.close()
        sidecar.cleanup()


DUMP = ('Thread 0x01 (most recent call first):\n  File "/venv/lib/python3.12/threading.py", line 331 in wait\n'
        '  File "/venv/lib/python3.12/threading.py", line 1009 in _bootstrap\n\n'
        'Current thread 0x02 (most recent call first):\n')


def test_the_supervisor_names_the_culprit_from_stack_dumps_received_through_the_channel(store):
    record = JobStore().create("sup-stacks", name="s", team="t", spec={}, source="x")
    stacks = {0: DUMP + '  File "/venv/lib/python3.12/site-packages/torch/distributed/c10d.py", line 9 in wait\n'
                        '  File "/w/trainforge/trainer/loop.py", line 200 in train\n'
                        '  File "<frozen runpy>", line 88 in _run_code\n',
              1: DUMP + '  File "/w/trainforge/trainer/faults.py", line 105 in _fire\n'
                        '  File "/w/trainforge/trainer/loop.py", line 190 in train\n'
                        '  File "<frozen runpy>", line 88 in _run_code\n'}
    pub = NodePublisher(store, ROOT, "n1", flush_interval_s=0.05)

    def answer(cmd: Command) -> None:  # what the node's sidecar does, with the faulthandler texts above
        if cmd.kind == "dump_stacks":
            for rank, text in stacks.items():
                pub.publish(dump_event(StackDump(rank=rank, text=text, cmd_seq=cmd.seq, src=Sender(rank=rank))))

    pub.on_command(answer)
    pub.start()
    reader = ChannelReader(store, ROOT, nodes=["n1"], flush_interval_s=0.05)
    sup = SegmentSupervisor(record, 0, HealthPolicy(), channel=reader, commands=CommandWriter(store, ROOT))
    beats = {r: RankBeat(Heartbeat(rank=r, pid=100 + r, phase="training", steps_done=7 - r), "n1", None, 0.0)
             for r in stacks}
    try:
        frames = sup.dump_stacks(beats, wait_s=15.0)
    finally:
        pub.close()
        reader.close()
    assert frames[1][0] == "/w/trainforge/trainer/faults.py:105 in _fire"
    from trainforge.tasks.supervisor import name_culprit

    assert name_culprit(frames, {r: dump_event(b.beat) for r, b in beats.items()}) == (
        1, "/w/trainforge/trainer/faults.py:105 in _fire")
    # The control side keeps the text where users and the docs look for it; the journal keeps a pointer.
    kept = record.folder / "artifacts/stacks/segment-0" / stacks_file_name(1, 0)
    assert kept.read_text() == stacks[1]
    journal = [e for e in read_events(record.events_path)[0] if e["type"] == "stack_dump"]
    assert sorted(e["rank"] for e in journal) == [0, 1]
    assert all(e["text"] == "" and e["artifact"].startswith("artifacts/stacks/segment-0/") for e in journal)


class FakeClient:
    def __init__(self) -> None:
        self.commands: list[dict] = []
        self.published: list[dict] = []

    def poll_commands(self) -> list[dict]:
        out, self.commands = self.commands, []
        return out

    def publish(self, record: dict) -> None:
        self.published.append(record)


def _cmd(seq: int, kind: str, **args) -> dict:
    return {"seq": seq, "kind": kind, "args": args, "nodes": None, "sent_at": 0.0}


def test_the_inbox_keeps_each_kind_for_its_taker_and_acts_on_a_replay_once():
    client = FakeClient()
    inbox = CommandInbox(client)
    client.commands = [_cmd(1, "kill_rank", rank=0), _cmd(2, "profile_window", start_step=5, end_step=6),
                       _cmd(3, "preemption_notice", deadline_s=None)]
    assert [c["seq"] for c in inbox.take("profile_window")] == [2]
    client.commands = [_cmd(2, "profile_window", start_step=5, end_step=6)]  # the sidecar's replay
    assert inbox.take("profile_window") == []
    assert [c["kind"] for c in inbox.take("preemption_notice", "resize_notice")] == ["preemption_notice"]
    assert inbox.take("kill_rank") == []  # the sidecar's business, not the rank's


def test_a_notice_command_is_reported_once_per_gang_and_a_bare_sigterm_by_its_rank():
    monitor = types.SimpleNamespace(stop_requested=False)
    client0, client1 = FakeClient(), FakeClient()
    rank0 = NoticeWatch(CommandInbox(client0), monitor, rank=0, src=Sender(rank=0))
    rank1 = NoticeWatch(CommandInbox(client1), monitor, rank=1, src=Sender(rank=1))
    for client in (client0, client1):
        client.commands = [_cmd(4, "resize_notice", num_nodes=None, workers=2)]
    monitor.stop_requested = True  # the sidecar's SIGTERM that comes with the command
    for t in (0.0, 5.0):
        rank0.check(t)
        rank1.check(t)
    [notice] = client0.published
    assert (notice["type"], notice["notice"], notice["target_workers"], notice["src"]["rank"]) == (
        "notice", "resize", 2, 0)
    assert client1.published == []  # one event per notice for the gang
    # A SIGTERM with no notice from the control plane (the node's own termination notice): the rank reports it.
    bare = FakeClient()
    watch = NoticeWatch(CommandInbox(bare), monitor, rank=4, src=Sender(rank=4), explain_s=1.0)
    watch.check(10.0)
    assert bare.published == []  # a notice command may still be on its way
    watch.check(11.5)
    watch.check(20.0)
    assert [n["notice"] for n in bare.published] == ["termination"]


def test_the_worker_reports_a_divergence_before_its_failure(tmp_path, monkeypatch):
    from trainforge.trainer.health import DivergenceError
    from trainforge.trainer.worker import report_divergence, write_failure

    monkeypatch.delenv("TRAINFORGE_CHANNEL_SOCKET", raising=False)
    monkeypatch.setenv("TRAINFORGE_SEGMENT_ATTEMPT", "1")
    cfg = types.SimpleNamespace(run_dir=str(tmp_path), job_id="j-1")
    try:
        raise DivergenceError(11, "loss is nan", "rollback")
    except DivergenceError as exc:
        report_divergence(cfg, 1, exc)  # not rank 0: every rank raises it, one reports it
        assert not (tmp_path / "events.jsonl").exists()
        report_divergence(cfg, 0, exc)
        write_failure(cfg, 0, exc)
    [event] = read_events(tmp_path / "events.jsonl")[0]
    assert (event["type"], event["step"], event["reason"], event["action"]) == ("divergence", 11, "loss is nan",
                                                                               "rollback")
    assert event["src"]["job"] == "j-1" and event["src"]["attempt"] == 1
    [failure] = (tmp_path / "failures").glob("segment-1-rank-*.json")
    assert json.loads(failure.read_text())["kind"] == "divergence"


class FakeTorchProfiler:
    """What StepProfiler uses of torch.profiler's `profile` (torch itself is the integration test's)."""

    def __exit__(self, *exc: object) -> None:
        pass

    def export_chrome_trace(self, path: str) -> None:
        Path(path).write_text(json.dumps({"traceEvents": [{"name": "aten::mm", "ph": "X", "ts": 0, "dur": 5}]}))

    def events(self) -> list:
        span = types.SimpleNamespace(start=0, end=5_000)
        return [types.SimpleNamespace(name="aten::mm", time_range=span)]

    def key_averages(self) -> list:
        return [types.SimpleNamespace(key="aten::mm", self_cpu_time_total=5_000)]


def test_a_requested_window_is_profiled_uploaded_and_announced(store, tmp_path, monkeypatch):
    """The rank side of `trainforge profile`: the command through the node socket, the profiler over the window,
    the trace and summary in the job's store, the `Profile` event with the key (torch.profiler faked: the
    observability integration test runs the real one)."""
    import trainforge.events
    import trainforge.trainer.inbox
    from trainforge.trainer.profiling import StepProfiler, summary_key

    sock = f"@tf-test-profile-{os.getpid()}"
    monkeypatch.setenv("TRAINFORGE_CHANNEL_SOCKET", sock)
    monkeypatch.setenv("TRAINFORGE_SEGMENT_ATTEMPT", "0")
    monkeypatch.setattr(trainforge.events, "_CLIENT", None)
    monkeypatch.setattr(trainforge.trainer.inbox, "_INBOX", None)
    started: list[int] = []
    monkeypatch.setattr(StepProfiler, "_start", lambda self: started.append(1) or setattr(
        self, "prof", FakeTorchProfiler()))
    pub = NodePublisher(store, ROOT, "n1", flush_interval_s=0.05, socket_path=sock).start()
    cfg = types.SimpleNamespace(storage_url=str(store.root), storage_prefix="teams/t/jobs/j", job_id="j")
    try:
        client = trainforge.events.rank_client(0)
        client.heartbeat(pid=os.getpid(), phase="training")  # the rank reaches its publisher
        _wait(lambda: "0" in pub.beats(), what="the rank's heartbeat")
        CommandWriter(store, ROOT).send("profile_window", start_step=3, end_step=4)
        profiler = StepProfiler(tmp_path, 0, None, 0, 1e12, 1e9, config=cfg)
        # the command reaches the rank's socket within a flush of its publisher
        _wait(lambda: profiler._poll_request(0) or profiler.window is not None, what="the window")
        for step in range(1, 7):
            profiler.after_step(step, 0.01)
        profiler.close()  # the segment's end waits for the window's files (written on a thread of their own)
        assert started == [1] and profiler.done and profiler.published is not None
        event = profiler.published
        assert (event.rank, event.start_step, event.end_step) == (0, 3, 4)
        assert event.trace == "teams/t/jobs/j/profiles/segment-0/rank0.trace.json"
        assert "traceEvents" in json.loads(store.get_bytes(event.trace))  # the Chrome trace, in the job's store
        summary = json.loads(store.get_bytes(summary_key(event.trace)))
        assert summary["window"] == [3, 4] and set(summary["step_times"]) == {"3", "4"}
        assert event.summary["compute_s"] == pytest.approx(0.005)
        assert not (tmp_path / "profiles").exists()  # nothing written into the flow's run folder
        client.drain()
        pub.wake()
        _wait(lambda: _records(store, "profile"), what="the Profile record in the channel")
        assert _records(store, "profile")[0]["trace"] == event.trace
    finally:
        pub.close()
