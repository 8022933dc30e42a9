"""The segment supervisor (trainforge/tasks/supervisor.py) on a real local channel: liveness comes from the
channel alone (the sidecar's process check in the beat, the beat's age on the publisher's and reader's clocks,
a node whose batches stop), the kill of a frozen rank and the notices go down as commands, and a beat that is not a
valid `Heartbeat` is skipped with a warning. No pid is read or signalled.

Run: PYTHONPATH=$PWD .venv/bin/python -m pytest tests/unit/test_supervisor.py -q
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import pytest

from tests.local_channel import LocalChannel
from trainforge.contract.events import Heartbeat
from trainforge.registry.jobs import JobStore
from trainforge.tasks.supervisor import Incident, SegmentSupervisor, rank_beats
from trainforge.trainer.health import HealthPolicy, read_heartbeats

pytestmark = pytest.mark.timeout(60)


def _until(sup: SegmentSupervisor, cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"not seen in {timeout_s}s; incidents: {sup.incidents}"
        sup.poll()
        time.sleep(0.02)


def _lost(sup: SegmentSupervisor) -> list[Incident]:
    return [i for i in sup.incidents if i.kind == "rank_lost"]


@pytest.fixture
def record():  # type: ignore[no-untyped-def]
    return JobStore().create("sup", name="s", team="demo", spec={}, source="x")


def test_a_rank_its_sidecar_saw_die_is_lost_and_not_killed_again(tmp_path, record):
    channel = LocalChannel(tmp_path / "objects")
    try:
        sup = channel.supervisor(record)
        channel.deliver(sup, channel.beat(0, step=2), channel.beat(1, step=2, node_side={"alive": False}))
        _until(sup, lambda: bool(_lost(sup)))
        [inc] = _lost(sup)
        assert (inc.rank, inc.scope, inc.host) == (1, "process", None)
        assert "died without a report" in inc.message
        assert inc.evidence["alive"] is False and inc.evidence["node"] == "node-0"
        assert channel.sent() == []  # already dead: torchrun restarts the gang, nothing to kill
    finally:
        channel.close()


@pytest.mark.timing
def test_a_frozen_rank_is_lost_by_its_beats_age_and_killed_through_the_channel(tmp_path, record):
    channel = LocalChannel(tmp_path / "objects", ["node-0", "node-1"])
    try:
        sup = channel.supervisor(record, policy=HealthPolicy(heartbeat_interval_s=0.1, heartbeat_timeout_s=0.5),
                                 rank_hosts={0: "node-0", 1: "node-1"})
        channel.deliver(sup, channel.beat(0, step=4), channel.beat(1, node="node-1", step=4))
        # rank 0 keeps beating, rank 1 froze (SIGSTOP): its publisher re-sends its last beat with a growing age
        deadline = time.monotonic() + 10
        while not _lost(sup):
            assert time.monotonic() < deadline, "the frozen rank was not found"
            channel.beat(0, step=4)
            sup.poll()
            time.sleep(0.05)
        [inc] = _lost(sup)
        assert (inc.rank, inc.host, inc.scope) == (1, "node-1", "process")
        assert "no heartbeat for" in inc.message and inc.evidence["heartbeat_age_s"] >= 0.5  # (rounded)
        # the kill goes to rank 1's node only, as a command its sidecar turns into SIGKILL
        assert [(c.kind, c.args, c.nodes) for c in channel.sent("node-1")] == [("kill_rank", {"rank": 1},
                                                                               ("node-1",))]
        assert channel.sent("node-0") == []
    finally:
        channel.close()


def test_a_node_whose_batches_never_come_is_lost_whole(tmp_path, record):
    channel = LocalChannel(tmp_path / "objects", ["node-0", "node-1"], publishing=["node-0"], lost_after_s=0.3)
    try:
        sup = channel.supervisor(record, rank_hosts={0: "node-0", 1: "node-1"})
        channel.deliver(sup, channel.beat(0, step=1))
        _until(sup, lambda: bool(_lost(sup)))
        [inc] = _lost(sup)
        assert (inc.rank, inc.host, inc.scope, inc.evidence) == (1, "node-1", "node", {"ranks": [1]})
        assert "no batch from its publisher" in inc.message
    finally:
        channel.close()


def test_draining_waits_for_each_closing_batch_but_a_dead_nodes(tmp_path, record):
    """At a segment's end the survivors' closing batches are read; a node the launcher saw die (its agent killed)
    sends none, and the drain does not wait lost_after_s for the channel to call it lost."""
    channel = LocalChannel(tmp_path / "objects", ["node-0", "node-1"], lost_after_s=30.0)
    try:
        sup = channel.supervisor(record, rank_hosts={0: "node-0", 1: "node-1"})
        channel.deliver(sup, channel.beat(0, step=3), channel.beat(1, node="node-1", step=3))
        channel.kill("node-1")
        channel.publishers.pop("node-0").close()
        t0 = time.monotonic()
        sup.drain(timeout_s=10.0, gone=["node-1"])
        assert time.monotonic() - t0 < 3.0
        assert channel.reader.status()["node-0"].state == "closed"
        t0 = time.monotonic()
        sup.drain(timeout_s=1.0)  # not told: it waits for node-1's closing batch, or for it to be lost
        assert time.monotonic() - t0 >= 1.0
    finally:
        channel.close()


def test_a_host_whose_ranks_all_die_is_one_node_incident_in_the_record(tmp_path, record):
    """Both ranks of node-1 found dead in the same pass are one lost machine: one incident, scope `node`, naming
    both ranks, in the supervisor and in the job record, however often the record is written."""
    channel = LocalChannel(tmp_path / "objects", ["node-0", "node-1"])
    try:
        hosts = {0: "node-0", 1: "node-0", 2: "node-1", 3: "node-1"}
        sup = channel.supervisor(record, rank_hosts=hosts)
        sup.finish()  # a write before the loss: the later writes replace it, they do not add to it
        channel.deliver(sup, channel.beat(0, step=3), channel.beat(1, step=3),
                        channel.beat(2, node="node-1", step=3, node_side={"alive": False}),
                        channel.beat(3, node="node-1", step=3, node_side={"alive": False}))
        _until(sup, lambda: any(i.scope == "node" for i in _lost(sup)))
        [inc] = _lost(sup)
        assert (inc.rank, inc.host, inc.scope, inc.evidence["ranks"]) == (2, "node-1", "node", [2, 3])
        sup.finish()
        sup.node_lost("node-1")  # the launcher then sees the node's agent die: the same loss, not a new one
        sup.finish()
        record.reload()
        [written] = [i for i in record.data["incidents"] if i["kind"] == "rank_lost"]
        assert (written["rank"], written["scope"], written["evidence"]["ranks"]) == (2, "node", [2, 3])
    finally:
        channel.close()


def test_hosts_lost_together_are_one_incident_and_a_later_loss_another(tmp_path, record):
    """node-1 and node-2 dead in the same pass (a rack lost at once): one incident of scope `node` naming both
    hosts and all their ranks, the earlier detection kept; a host lost more than a heartbeat timeout later is an
    incident of its own. What the driver re-provisions comes from `incident_hosts`."""
    from trainforge.tasks.supervisor import incident_hosts

    channel = LocalChannel(tmp_path / "objects", ["node-0", "node-1", "node-2", "node-3"])
    try:
        hosts = {0: "node-0", 1: "node-1", 2: "node-2", 3: "node-3"}
        sup = channel.supervisor(record, rank_hosts=hosts)
        channel.deliver(sup, channel.beat(0, step=3), channel.beat(1, node="node-1", step=3, node_side={"alive": False}),
                        channel.beat(2, node="node-2", step=3, node_side={"alive": False}),
                        channel.beat(3, node="node-3", step=3))
        _until(sup, lambda: len(_lost(sup)) == 2)  # each rank's process gone
        sup.node_lost("node-1")
        sup.node_lost("node-2")
        [inc] = _lost(sup)
        assert (inc.scope, inc.hosts, inc.evidence["ranks"]) == ("node", ["node-1", "node-2"], [1, 2])
        assert inc.message.startswith("nodes node-1, node-2 lost together")
        sup.finish()
        record.reload()
        [written] = [i for i in record.data["incidents"] if i["kind"] == "rank_lost"]
        assert incident_hosts(written) == ["node-1", "node-2"]
        # node-3, lost more than a heartbeat timeout later: a loss of its own
        later = sup.incidents[0].detected_at + sup.policy.heartbeat_timeout_s + 1
        import unittest.mock

        with unittest.mock.patch("trainforge.tasks.supervisor.time.time", return_value=later):
            sup.node_lost("node-3")
        assert sorted(tuple(i.hosts) for i in _lost(sup)) == [("node-1", "node-2"), ("node-3",)]
    finally:
        channel.close()


def test_a_rank_lost_before_a_restart_is_not_folded_into_the_node_lost_after_it(tmp_path, record):
    """Rank 2 dies alone (torchrun restarts the gang), then in the restarted gang node-1 dies whole: two faults, two
    incidents; the first stays a process loss of restart 0 and the second is the node's, of restart 1."""
    channel = LocalChannel(tmp_path / "objects", ["node-0", "node-1"])
    try:
        hosts = {0: "node-0", 1: "node-0", 2: "node-1", 3: "node-1"}
        sup = channel.supervisor(record, rank_hosts=hosts)
        channel.deliver(sup, channel.beat(0, step=3), channel.beat(1, step=3),
                        channel.beat(2, node="node-1", step=3, node_side={"alive": False}),
                        channel.beat(3, node="node-1", step=3))
        _until(sup, lambda: bool(_lost(sup)))
        channel.deliver(sup, channel.beat(0, step=3, restart=1), channel.beat(1, step=3, restart=1),
                        channel.beat(2, node="node-1", step=3, restart=1, node_side={"alive": False}),
                        channel.beat(3, node="node-1", step=3, restart=1, node_side={"alive": False}))
        _until(sup, lambda: any(i.scope == "node" for i in _lost(sup)))
        before, after = _lost(sup)
        assert (before.rank, before.scope, before.restart) == (2, "process", 0)
        assert (after.rank, after.scope, after.restart, after.evidence["ranks"]) == (2, "node", 1, [2, 3])
    finally:
        channel.close()


def test_the_scheduler_preemption_goes_down_as_a_notice(tmp_path, record):
    channel = LocalChannel(tmp_path / "objects")
    try:
        sup = channel.supervisor(record, scheduler_status=lambda: {"state": "preempting", "preempt_deadline": 30})
        channel.deliver(sup, channel.beat(0, step=1))
        _until(sup, lambda: sup.preempting)
        assert [(c.kind, c.args, c.nodes) for c in channel.sent()] == [("preemption_notice", {"deadline_s": 30},
                                                                        None)]
    finally:
        channel.close()


def test_a_preemption_at_the_next_checkpoint_boundary_waits_for_that_commit(tmp_path, record, monkeypatch):
    """A starving gang stops a victim at its next checkpoint boundary (`preempt_at`): no notice before the boundary
    time nor before a commit made after the preemption was seen; the first of the two sends it."""
    import trainforge.tasks.supervisor as supervisor_module
    from trainforge.contract.events import CheckpointCommitted, Sender
    from trainforge.events import EventWriter

    monkeypatch.setattr(supervisor_module, "PREEMPTION_CHECK_S", 0.0)
    channel = LocalChannel(tmp_path / "objects")
    try:
        status = {"state": "preempting", "preempt_deadline": time.time() + 3720, "preempt_at": time.time() + 3600}
        sup = channel.supervisor(record, scheduler_status=lambda: status)
        channel.deliver(sup, channel.beat(0, step=1))
        for _ in range(5):
            sup.poll()
        assert not sup.preempting and channel.sent() == []
        EventWriter(record.folder, True, Sender(job=record.job_id, attempt=0, rank=0)).publish(
            CheckpointCommitted(step=8, prefix="checkpoints/step-00000008"))
        _until(sup, lambda: sup.preempting)
        assert [c.kind for c in channel.sent()] == ["preemption_notice"]
        assert any("at its checkpoint boundary" in i.message for i in sup.incidents)

        later = channel.supervisor(record, scheduler_status=lambda: {**status, "preempt_at": time.time() - 1})
        channel.deliver(later, channel.beat(0, step=9))
        _until(later, lambda: later.preempting)  # the boundary time passed: no commit needed
    finally:
        channel.close()


def test_beats_are_typed_and_a_malformed_one_is_skipped_by_name(tmp_path, record, caplog):
    channel = LocalChannel(tmp_path / "objects")
    try:
        sup = channel.supervisor(record)
        good = channel.beat(0, step=7, steps_done=3, local_s=0.01)
        channel.publishers["node-0"].heartbeat(1, rank=1, phase="training")  # no pid: not a Heartbeat
        with caplog.at_level(logging.WARNING, logger="trainforge.tasks.supervisor"):
            beats = channel.deliver(sup, good)
            assert "1" in channel.reader.heartbeats["node-0"]  # the channel carried it, the supervisor refused it
            assert set(rank_beats(channel.reader)) == {0}
        assert isinstance(beats[0].beat, Heartbeat) and beats[0].beat == good and beats[0].node == "node-0"
        assert any("rank 1's heartbeat" in r.message and "pid" in r.message for r in caplog.records)
        sup.finish()  # the journal: the last beat per rank, as the typed event's JSON
        assert Heartbeat.model_validate({k: v for k, v in read_heartbeats(record.folder, 0)[0].items()
                                         if k != "type"}) == good
    finally:
        channel.close()


def test_failure_reports_come_up_the_channel_typed_root_cause_first(tmp_path, record, caplog):
    from trainforge.tasks.segment import _failure, failure_reports

    channel = LocalChannel(tmp_path / "objects")
    try:
        sup = channel.supervisor(record)
        pub = channel.publishers["node-0"]
        # as trainer/worker.py write_failure sends them: rank 0 died of the broken connection after rank 1's fault
        pub.publish({"type": "failure", "rank": 0, "attempt": "0", "restart": "0", "kind": "infra", "host": "h",
                     "exception": "ConnectionError: reset", "traceback": "Traceback ...", "time": 20.0})
        pub.publish({"type": "failure", "rank": 1, "attempt": "0", "restart": "0", "kind": "user", "host": "h",
                     "exception": "InjectedFault: boom", "traceback": "Traceback ...", "time": 30.0})
        deadline = time.monotonic() + 10
        while len(list((record.folder / "failures").glob("segment-0-rank-*.json"))) < 2:
            assert time.monotonic() < deadline, "the reports were not journalled"
            sup._read_beats()
            time.sleep(0.02)
    finally:
        channel.close()
    (record.folder / "failures" / "segment-0-rank-00002.json").write_text('{"rank": 2}')  # not a report
    with caplog.at_level(logging.WARNING, logger="trainforge.tasks.segment"):
        reports = failure_reports(record, 0)
    assert [(r.rank, r.failure) for r in reports] == [(1, "user"), (0, "infra")]  # a user fault is the cause
    assert any("segment-0-rank-00002.json" in r.message for r in caplog.records)
    exc = _failure(record, 0, tmp_path / "logs", 1, sup)
    assert (exc.kind, exc.rank) == ("user", 1) and "InjectedFault: boom" in str(exc)


def test_a_commit_whose_report_never_came_is_booked_from_the_store_for_its_attempt(tmp_path, record, caplog):
    """Rank 0 writes the manifest, then reports it: killed in between (its node lost mid-commit, or the survivors
    stopped), it reports nothing, yet the retry resumes from that manifest. The segment's end (tasks/segment.py)
    books every commit of its attempt from the store, as a `checkpoint` event of that attempt, so the flow's
    bookkeeping runs for it; nothing else is booked twice, and another attempt's commit is that attempt's."""
    from trainforge.contract.events import CheckpointCommitted, Sender
    from trainforge.contract.router import EventRouter, StartBookkeeping
    from trainforge.events import EventWriter, read_events, read_typed_events
    from trainforge.registry.manifest import CheckpointRef, quarantine, step_prefix, write_manifest

    job = "teams/t/jobs/j"
    channel = LocalChannel(tmp_path / "objects")
    try:
        sup = channel.supervisor(record, attempt=1)
        store = channel.store
        for step, attempt in ((4, 0), (6, 0), (8, 1), (10, 1), (12, 1), (14, None)):
            write_manifest(store, step_prefix(job, step), {"step": step, "segment_attempt": attempt, "files": [],
                                                           "metrics": {"train_loss": 2.5}})
        quarantine(store, CheckpointRef(10, step_prefix(job, 10), {}), ["bit rot"])  # found corrupt: not resumed
        for step, attempt in ((4, 0), (8, 1)):  # the reports that came up the channel, as the journal keeps them
            EventWriter(record.folder, True, Sender(job=record.job_id, attempt=attempt, rank=0)).publish(
                CheckpointCommitted(step=step, prefix=step_prefix(job, step)))
        # 6: attempt 0's (its own end booked what it had to); 14: a manifest that names no attempt
        with caplog.at_level(logging.WARNING, logger="trainforge.tasks.supervisor"):
            assert sup.report_unreported_commits(store, job) == [12]
        assert any("step 12" in r.message and "never arrived" in r.message for r in caplog.records)
        [booked] = [e for e in read_events(record.events_path)[0] if e["type"] == "checkpoint" and e["step"] == 12]
        assert booked["src"]["attempt"] == 1 and booked["prefix"] == step_prefix(job, 12)
        assert booked["metrics"] == {"train_loss": 2.5}
        assert sup.report_unreported_commits(store, job) == []  # booked once
        # the flow's router starts the bookkeeping of the step it had not booked, and of no other
        events, _, _ = read_typed_events(record.events_path, only=(CheckpointCommitted,))
        assert [a.step for a in EventRouter().route_all(events, {4, 8}) if isinstance(a, StartBookkeeping)] == [12]
    finally:
        channel.close()


def test_a_store_that_cannot_be_listed_at_the_segment_end_books_nothing_and_says_so(tmp_path, record, caplog,
                                                                                    monkeypatch):
    from trainforge.infra.storage import LocalObjectStore

    channel = LocalChannel(tmp_path / "objects")
    store = LocalObjectStore(tmp_path / "checkpoints")
    try:
        sup = channel.supervisor(record)

        def down(prefix: str = "", *, start_after: str = "") -> list[str]:
            raise ConnectionError("store down")

        monkeypatch.setattr(store, "list", down)
        with caplog.at_level(logging.WARNING, logger="trainforge.tasks.supervisor"):
            assert sup.report_unreported_commits(store, "teams/t/jobs/j") == []
        assert any("listing the committed checkpoints" in r.message and "store down" in r.message
                   for r in caplog.records)
    finally:
        channel.close()


def test_a_network_cut_stops_the_gang_and_records_the_excluded_side_as_lost_together(tmp_path, record):
    from trainforge.plan.reach import find_cut
    from trainforge.tasks.supervisor import incident_hosts

    channel = LocalChannel(tmp_path / "objects", ["a", "b", "c"])
    try:
        sup = channel.supervisor(record, rank_hosts={0: "a", 1: "b", 2: "c", 3: "c"})
        cut = find_cut(["a", "b", "c"], {"c": {"a", "b"}})
        assert cut is not None
        sup.network_cut(cut)
        sup.network_cut(cut)  # said again by a later pass: one incident
        [inc] = sup.incidents
        assert (inc.kind, inc.scope, inc.hosts, inc.rank) == ("network_cut", "node", ["c"], 2)
        assert inc.message == "network cut: hosts c cannot reach hosts a, b (all 2 pairs across the cut fail)"
        assert inc.evidence["keep"] == ["a", "b"] and inc.evidence["ranks"] == [2, 3]
        assert sup.poll() == inc.message and sup.gang_broken  # the gang stops now, without grace
        assert sup.root_cause() is inc
        [kept] = JobStore().get(record.job_id).data["incidents"]  # in the record before the failure is handled
        assert incident_hosts(kept) == ["c"] and kept["evidence"]["exclude"] == ["c"]
    finally:
        channel.close()
