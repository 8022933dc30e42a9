"""A recovery that finds too few hosts waits a bounded time with its cause shown, then the job fails naming it.

The live scheduler on the chaos drills' 3-node cluster (CHAOS_CLUSTER: 3 nodes x 2 slots) holds a 6-worker job on
all three; its segment 0 ended in a network cut that excluded `chaos-2`. The flow's re-provisioning
(tasks/steps.py `reprovision`) marks `chaos-2` failed and asks for the gang again: no 3 healthy nodes remain, so it
waits, with the cut and the scheduler's reason in the job record's `waiting` (what `trainforge status` shows), at
most `fault_tolerance.recovery_wait_s`, then raises `RecoveryTimeout` naming the cut, on which the segment
controller gives up at once (kind `capacity`). No worker runs: only the scheduler and the record are exercised.
"""

from __future__ import annotations

import threading
import time

import pytest
from typer.testing import CliRunner

from tests.chaos.harness import CHAOS_CLUSTER, chaos_cluster
from trainforge.cli import app
from trainforge.contract.controller import Action, History, SegmentController
from trainforge.datasets.demo import ensure_demo_dataset
from trainforge.registry.jobs import JobStore
from trainforge.tasks.chaos import prepare_job
from trainforge.tasks.provision import RecoveryTimeout, provision_gang, record_allocation

pytestmark = pytest.mark.timeout(120)

CUT = "network cut: hosts chaos-2 cannot reach hosts chaos-0, chaos-1 (all 2 pairs across the cut fail)"


def test_too_few_hosts_after_a_cut_wait_with_the_cut_shown_then_the_job_gives_up_naming_it(monkeypatch):
    import yaml

    from tests.chaos.harness import EXAMPLES
    from trainforge.tasks.driver import failure_outcome
    from trainforge.tasks.steps import reprovision

    ensure_demo_dataset()
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    doc["resources"].update({"min_gpus": 6, "gpus_per_node": 2})
    doc["parallelism"].update({"dp": 6, "micro_batch_size": 1})
    doc["training"]["global_batch_size"] = 6
    doc["fault_tolerance"]["recovery_wait_s"] = 5
    job = prepare_job(doc, "cut.yaml", EXAMPLES, "cut-wait", cluster=CHAOS_CLUSTER)
    record = job.record
    with chaos_cluster(CHAOS_CLUSTER):
        alloc = provision_gang(record.job_id, job.spec, record.data["plan"]["layout"])
        record_allocation(record, alloc, "provisioned", job.spec)
        assert sorted(alloc["nodes"]) == ["chaos-0", "chaos-1", "chaos-2"]
        record.update(segments=[{"attempt": 0, "state": "failed", "nodes": alloc["nodes"]}],
                      incidents=[{"kind": "network_cut", "rank": 4, "detected_at": time.time(), "message": CUT,
                                  "action": "stop the gang", "attempt": 0, "scope": "node", "host": "chaos-2",
                                  "hosts": ["chaos-2"], "evidence": {}, "restart": 0, "step": 6}])
        failure: list[BaseException] = []

        def recover() -> None:
            try:
                reprovision(JobStore().get(record.job_id), job.spec)
            except BaseException as exc:  # noqa: BLE001 - the test reads it
                failure.append(exc)

        t0 = time.monotonic()
        thread = threading.Thread(target=recover)
        thread.start()
        shown = None
        while thread.is_alive() and shown is None:
            waiting = JobStore().get(record.job_id).data.get("waiting")
            if waiting:
                out = CliRunner().invoke(app, ["status", record.job_id], env={"COLUMNS": "400", "NO_COLOR": "1"})
                shown = out.output
            time.sleep(0.1)
        thread.join(timeout=60)
        waited = time.monotonic() - t0
    assert shown is not None, "the wait never showed in the job record"
    assert f"waiting       : re-provisioning after {CUT}" in shown and "gives up at" in shown, shown
    [exc] = failure
    assert isinstance(exc, RecoveryTimeout)
    assert CUT in str(exc) and "fault_tolerance.recovery_wait_s (5 s)" in str(exc)
    assert 5.0 <= waited < 30.0
    fresh = JobStore().get(record.job_id)
    assert not fresh.data.get("waiting")  # the wait is over
    outcome = failure_outcome(fresh, exc)
    assert outcome.kind == "capacity"
    decision = SegmentController(History(total_steps=8, max_retries=3, max_rollbacks=3)).decide(outcome)
    assert decision.action is Action.GIVE_UP and CUT in decision.reason
