"""NVML health with every heartbeat (trainer/health.py GpuHealthSampler) against tests/fake_nvml/pynvml.py, the
stand-in for nvidia-ml-py on hosts without GPUs, and the supervisor's answer to an unhealthy GPU: the node is
drained (the gang stops now, the node is recorded with scope `node` for the re-provisioning).

Run: PYTHONPATH=$PWD .venv/bin/python -m pytest tests/unit/test_gpu_health.py -q
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.local_channel import LocalChannel
from trainforge.contract.events import GpuHealth
from trainforge.registry.jobs import JobStore
from trainforge.trainer.health import GpuHealthSampler, HealthMonitor, HealthPolicy, gpu_health

FAKE = Path(__file__).resolve().parents[1] / "fake_nvml" / "pynvml.py"
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def fake_nvml(monkeypatch):  # type: ignore[no-untyped-def]
    """A fresh fake module as `pynvml`; the test sets $TRAINFORGE_FAKE_NVML before opening a sampler."""
    spec = importlib.util.spec_from_file_location("pynvml", FAKE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.delenv("TRAINFORGE_FAKE_NVML", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # every GPU of the fake node, unless a test narrows
    return module


def test_healthy_gpus_sample_clean_and_parse_as_the_heartbeats_gpu_field(fake_nvml, monkeypatch):
    monkeypatch.setenv("TRAINFORGE_FAKE_NVML", "devices=2")
    health = gpu_health()
    assert health["available"] and health["healthy"] is True
    assert [(d["index"], d["ecc_uncorrected"], d["retired_pages"], d["xids"], d["reasons"]) for d in
            health["devices"]] == [(0, 0, 0, [], []), (1, 0, 0, [], [])]
    assert GpuHealth.model_validate(health).devices[1].healthy


@pytest.mark.parametrize("fail, reason", [
    ("ecc", "2 uncorrected ECC error(s)"),
    ("retired", "a page retirement waits for a GPU reset"),
    ("xid:79", "critical Xid 79"),
    ("slowdown", "hardware slowdown (clock-event reasons 0x8)"),
])
def test_each_failure_nvml_reports_makes_its_device_unhealthy_with_the_reason(fake_nvml, monkeypatch, fail, reason):
    monkeypatch.setenv("TRAINFORGE_FAKE_NVML", f"devices=2,device=1,fail={fail}")
    sampler = GpuHealthSampler.open()
    assert isinstance(sampler, GpuHealthSampler)
    try:
        first, second = sampler.sample(), sampler.sample()
    finally:
        sampler.close()
    for health in (first, second):  # an Xid is delivered once by the driver: the sampler keeps it
        assert health["healthy"] is False
        assert health["devices"][0]["healthy"] and health["devices"][0]["reasons"] == []
        assert health["devices"][1]["reasons"] == [reason]
        GpuHealth.model_validate(health)


def test_a_non_critical_xid_is_kept_but_is_not_a_fault_of_the_gpu(fake_nvml, monkeypatch):
    monkeypatch.setenv("TRAINFORGE_FAKE_NVML", "fail=xid:13")  # a user kernel's exception: the process' own failure
    health = gpu_health()
    assert health["healthy"] is True and health["devices"][0]["xids"] == [13]


def test_a_fault_waits_for_its_node_attempt_and_time(fake_nvml, monkeypatch):
    monkeypatch.setenv("TRAINFORGE_FAKE_NVML", "fail=ecc,group_rank=1,attempt=0,after_s=0")
    monkeypatch.setenv("GROUP_RANK", "0")
    assert gpu_health()["healthy"] is True  # another node
    monkeypatch.setenv("GROUP_RANK", "1")
    monkeypatch.setenv("TRAINFORGE_SEGMENT_ATTEMPT", "1")
    assert gpu_health()["healthy"] is True  # the retry
    monkeypatch.setenv("TRAINFORGE_SEGMENT_ATTEMPT", "0")
    assert gpu_health()["healthy"] is False
    monkeypatch.setenv("TRAINFORGE_FAKE_NVML", "fail=ecc,after_s=3600")
    assert gpu_health()["healthy"] is True  # not yet


def test_a_host_without_nvml_says_why_and_the_monitor_keeps_beating_without_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails as on a host without nvidia-ml-py
    assert GpuHealthSampler.open() == "NVML not available on this host (nvidia-ml-py not installed)"
    mon = HealthMonitor(HealthPolicy(), tmp_path, 0, 0, handle_sigterm=False).start()
    try:
        assert mon.heartbeat().gpu == GpuHealth(available=False, reason=GpuHealthSampler.open())
    finally:
        mon.close()


def test_an_unhealthy_gpu_in_a_beat_drains_its_node_once(tmp_path, fake_nvml, monkeypatch):
    monkeypatch.setenv("TRAINFORGE_FAKE_NVML", "devices=2,device=1,fail=xid:48")
    record = JobStore().create("gpu", name="g", team="demo", spec={}, source="x")
    channel = LocalChannel(tmp_path / "objects", ["node-0", "node-1"])
    try:
        sup = channel.supervisor(record, rank_hosts={0: "node-0", 1: "node-0", 2: "node-1", 3: "node-1"})
        healthy = {"available": True, "healthy": True, "devices": [{"index": 0, "healthy": True}]}
        channel.deliver(sup, channel.beat(0, step=3, gpu=healthy), channel.beat(2, node="node-1", step=3,
                                                                                  gpu=gpu_health()))
        assert sup.poll() == "GPU unhealthy on node node-1"
        [inc] = [i for i in sup.incidents if i.kind == "gpu_unhealthy"]
        assert (inc.rank, inc.host, inc.scope, inc.step) == (2, "node-1", "node", 3)
        assert "node node-1 drained: NVML reports GPU 1: critical Xid 48" in inc.message
        assert inc.evidence["devices"][0]["xids"] == [48] and inc.evidence["node"] == "node-1"
        assert sup.root_cause() is inc
        sup.poll()  # stopped by policy: later passes only journal
        assert len([i for i in sup.incidents if i.kind == "gpu_unhealthy"]) == 1
        record.reload()
        assert [i["kind"] for i in record.data["incidents"]] == ["gpu_unhealthy"]
        assert record.data["incidents"][0]["scope"] == "node"  # what the re-provisioning excludes
    finally:
        channel.close()
