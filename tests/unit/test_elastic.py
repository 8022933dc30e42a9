"""Elastic data-parallel sizes and layouts (tasks/provision.py), provisioning an elastic gang through the real live
scheduler on a 3-node cluster (full size when free, smaller when not, the resize recorded), and the supervisor's
resize notice when the scheduler changes a running elastic job's allocation.

Run: .venv/bin/python -m pytest tests/unit/test_elastic.py -q
"""

from __future__ import annotations

import copy

import pytest

from tests.local_channel import LocalChannel
from trainforge.events import read_events
from trainforge.infra.scheduler.live import GangRequest
from trainforge.registry.jobs import JobStore
from trainforge.spec import JobSpec
from trainforge.tasks.chaos import CHAOS_CLUSTER, chaos_cluster
from trainforge.tasks.provision import (
    accumulation,
    elastic_sizes,
    layout_for,
    live_scheduler,
    provision_gang,
    record_allocation,
    release_gang,
)

DOC = {
    "name": "elastic", "team": "demo", "code": {"entrypoint": "trainforge.trainer.models.llama:build_model"},
    "dataset": {"ref": "catalog://demo-text@main"},
    "resources": {"gpu_type": "cpu", "min_gpus": 2, "max_gpus": 4, "gpus_per_node": 2},
    "model": {"preset": "tiny"},
    "training": {"max_steps": 20, "global_batch_size": 8, "seq_len": 64},
    "parallelism": {"strategy": "explicit", "micro_batch_size": 2},
}
LAYOUT = {"dp": 2, "tp": 1, "pp": 1, "ep": 1, "vpp": 1, "micro_batch_size": 2, "schedule": "1f1b",
          "sharding": "none", "activation_checkpointing": "none"}


def spec(**resources) -> JobSpec:
    doc = copy.deepcopy(DOC)
    doc["resources"].update(resources)
    return JobSpec.model_validate(doc)


def test_sizes_are_whole_nodes_whose_dp_divides_the_global_batch():
    assert elastic_sizes(spec(), LAYOUT) == [4, 2]
    assert elastic_sizes(spec(max_gpus=8), LAYOUT) == [8, 4, 2]  # 6: dp 6 does not divide a batch of 8
    assert elastic_sizes(spec(max_gpus=None), LAYOUT) == [2]  # fixed size
    assert elastic_sizes(spec(min_gpus=4, max_gpus=8, gpus_per_node=4), {**LAYOUT, "tp": 2}) == [8, 4]
    assert elastic_sizes(spec(min_gpus=2, max_gpus=8, gpus_per_node=8), LAYOUT) == [8]  # whole 8-GPU nodes only
    assert elastic_sizes(spec(min_gpus=1, max_gpus=2, gpus_per_node=1), LAYOUT) == [2, 1]
    deepspeed = copy.deepcopy(DOC)
    deepspeed["parallelism"]["engine"] = "deepspeed"
    assert elastic_sizes(JobSpec.model_validate(deepspeed), LAYOUT) == [2]  # ZeRO partitions do not reshard


def test_layout_keeps_the_global_batch_through_accumulation():
    for world in (2, 4, 8):
        lay = layout_for(LAYOUT, world, 8)
        assert lay["dp"] == world and lay["dp"] * lay["micro_batch_size"] * accumulation(lay, 8) == 8
    assert accumulation(layout_for(LAYOUT, 2, 8), 8) == 2 and accumulation(layout_for(LAYOUT, 4, 8), 8) == 1
    assert layout_for(LAYOUT, 8, 8)["micro_batch_size"] == 1  # local batch 1 < micro-batch 2
    assert layout_for({**LAYOUT, "micro_batch_size": 3}, 2, 12)["micro_batch_size"] == 3
    assert layout_for({**LAYOUT, "micro_batch_size": 4}, 2, 12)["micro_batch_size"] == 3  # largest divisor of 6


def test_elastic_gang_takes_what_the_scheduler_can_give_and_the_resize_is_recorded(tmp_path):
    s = spec()
    with chaos_cluster(CHAOS_CLUSTER):
        record = JobStore().create("el-1", name="elastic", team="demo", spec=DOC, source="x")
        full = provision_gang("el-1", s, LAYOUT)
        assert full["workers"] == 4 and len(full["nodes"]) == 2 and full["layout"]["dp"] == 4
        assert record_allocation(record, full, "provisioned", s) is None  # the first gang is not a resize
        # another job takes the third node; one of ours fails: only one node is left for us
        blocker = GangRequest(job_id="other", team="demo", gpu_type="cpu", num_gpus=2, gpus_per_node=2)
        other = live_scheduler().request(blocker, timeout_s=5)
        live_scheduler().node_failed(full["nodes"][1], "test")
        release_gang("el-1")
        small = provision_gang("el-1", s, LAYOUT)
        assert small["workers"] == 2 and small["nodes"] == [full["nodes"][0]]
        assert small["layout"]["dp"] == 2 and small["layout"]["micro_batch_size"] == 2
        entry = record_allocation(record, small, "re-provisioned after a node loss", s)
        assert entry is not None and (entry["from_workers"], entry["to_workers"]) == (4, 2)
        assert entry["accumulation"] == [1, 2] and entry["global_batch_size"] == 8
        assert JobStore().get("el-1").data["resizes"][0]["to_dp"] == 2
        [ev] = [e for e in read_events(record.events_path)[0] if e["type"] == "resize"]
        assert ev["from_workers"] == 4 and ev["to_workers"] == 2
        # capacity returns: the scheduler grows the running elastic job into it; the next boundary sees 4
        release_gang("other")
        assert live_scheduler().status("el-1")["gpus"] == 4
        grown = provision_gang("el-1", s, LAYOUT)  # idempotent for a running job: its current allocation
        assert grown["workers"] == 4 and other.nodes[0][0] in grown["nodes"]
        assert record_allocation(record, grown, "segment boundary", s)["to_workers"] == 4
        release_gang("el-1")


def test_fixed_size_job_requests_exactly_its_gang():
    s = spec(max_gpus=None, min_gpus=4)
    with chaos_cluster(CHAOS_CLUSTER):
        alloc = provision_gang("fixed", s, {**LAYOUT, "dp": 4})
        assert alloc["workers"] == 4 and alloc["sizes"] == [4]
        live_scheduler().request(GangRequest(job_id="b", team="demo", gpu_type="cpu", num_gpus=2), timeout_s=5)
        status = live_scheduler().status("fixed")
        assert status["gpus"] == 4  # never shrunk nor grown
        release_gang("fixed")
        release_gang("b")


@pytest.mark.parametrize(("gpus", "phase", "expect"), [(4, "training", 4), (2, "training", None),
                                                        (4, "starting", None), (3, "training", None),
                                                        (6, "training", 4)])
def test_supervisor_ends_the_segment_for_a_usable_new_size(tmp_path, gpus, phase, expect):
    record = JobStore().create(f"sup-{gpus}-{phase}", name="e", team="demo", spec={}, source="x")
    channel = LocalChannel(tmp_path / "objects")
    try:
        sup = channel.supervisor(record, 0, scheduler_status=lambda: {"state": "running", "gpus": gpus},
                                 world=2, sizes=[4, 2])
        beats = channel.deliver(sup, channel.beat(0, phase=phase, step=3), channel.beat(1, phase=phase, step=3))
        sup._check_preemption(beats, now=1e12)
        assert sup.resize_to == expect
        sent = channel.sent()  # the notice goes down the channel: the node's sidecar signals its ranks
        assert [(c.kind, c.args.get("workers")) for c in sent] == ([("resize_notice", expect)] if expect else [])
        assert sup.preempting == (expect is not None)
    finally:
        channel.close()
    if expect:
        [ev] = [e for e in read_events(record.events_path)[0] if e["type"] == "fault_detected"]
        assert ev["fault"] == "resize" and "from 2 to 4" in ev["message"]
        assert JobStore().get(record.job_id).data["pending_recovery"]["kind"] == "resize"



def test_supervisor_waits_for_a_pending_recovery_before_resizing(tmp_path):
    """A resize notice right after a restore would end the recovery before its first step (no MTTR measured)."""
    record = JobStore().create("sup-pending", name="e", team="demo", spec={}, source="x")
    record.update(pending_recovery={"kind": "rank_lost", "rank": 2, "detected_at": 1.0, "step": 14, "attempt": 0})
    channel = LocalChannel(tmp_path / "objects")
    try:
        sup = channel.supervisor(record, 1, scheduler_status=lambda: {"state": "running", "gpus": 4},
                                 world=2, sizes=[4, 2])
        beats = channel.deliver(sup, channel.beat(0, step=3), channel.beat(1, step=3))
        sup._check_preemption(beats, now=1e12)
        assert sup.resize_to is None and not channel.sent()
        sup._pending = None  # recovered: the next pass resizes
        sup._check_preemption(beats, now=2e12)
        assert sup.resize_to == 4 and [c.kind for c in channel.sent()] == ["resize_notice"]
    finally:
        channel.close()
