"""Accelerators are never shared between tenants: the live scheduler gives each GPU of a node to one job at a time
(free-GPU bitmasks), the allocation carries the indices, each job's workers see only those
(`CUDA_VISIBLE_DEVICES`, infra/launch.py `device_environment`) and NVML health/telemetry sample only those
(trainer/health.py `visible_nvml_indices`). Fake device indices: a 1-node, 8-GPU cluster on SQLite."""

from __future__ import annotations

import pytest

from trainforge.infra.launch import device_environment
from trainforge.infra.scheduler.live import GangRequest, LiveScheduler, SchedulingTimeout
from trainforge.plan.cluster import ClusterSpec, NodeGroup
from trainforge.trainer.health import visible_nvml_indices

NODE = ClusterSpec(name="one-node", node_groups=[
    NodeGroup(name="h", gpu_type="h100", nodes=1, gpus_per_node=8, nodes_per_rack=1)])


def test_two_jobs_on_one_node_see_disjoint_gpus_and_a_third_waits(tmp_path):
    sched = LiveScheduler(NODE, f"sqlite:///{tmp_path / 's.db'}")
    a = sched.request(GangRequest(job_id="a", team="nlp", gpu_type="h100", num_gpus=4, tp=2), timeout_s=5)
    b = sched.request(GangRequest(job_id="b", team="vision", gpu_type="h100", num_gpus=2), timeout_s=5)
    (node_a, gpus_a), = a.nodes
    (node_b, gpus_b), = b.nodes
    assert node_a == node_b == "h-0" and len(gpus_a) == 4 and len(gpus_b) == 2 and not set(gpus_a) & set(gpus_b)
    env_a, env_b = (device_environment("h100", g, {}) for g in (gpus_a, gpus_b))
    seen_a = set(env_a["CUDA_VISIBLE_DEVICES"].split(","))
    seen_b = set(env_b["CUDA_VISIBLE_DEVICES"].split(","))
    assert seen_a == {str(g) for g in gpus_a} and not seen_a & seen_b
    # 2 GPUs are left: another 4-GPU gang (of a team past its share: nothing to preempt) waits, sharing nothing
    with pytest.raises(SchedulingTimeout, match="needs 4 GPUs, 2 free"):
        sched.request(GangRequest(job_id="c", team="nlp", gpu_type="h100", num_gpus=4), timeout_s=0.3)
    sched.release("a")
    c = sched.request(GangRequest(job_id="c", team="nlp", gpu_type="h100", num_gpus=4), timeout_s=5)
    assert not set(c.nodes[0][1]) & set(gpus_b)  # the freed GPUs, never b's


def test_device_environment_maps_through_the_hosts_own_narrowing():
    assert device_environment("cpu", [0, 1], {}) == {}
    assert device_environment("h100", [], {}) == {}
    assert device_environment("h100", [1, 3], {}) == {"CUDA_VISIBLE_DEVICES": "1,3"}
    # the platform was given GPUs 4-7 of this host: the scheduler's 0..3 are those
    assert device_environment("h100", [1, 3], {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == {"CUDA_VISIBLE_DEVICES": "5,7"}
    with pytest.raises(ValueError, match="lists 2"):
        device_environment("h100", [3], {"CUDA_VISIBLE_DEVICES": "0,1"})


def test_nvml_samples_only_the_jobs_gpus():
    assert visible_nvml_indices(8, {}) == list(range(8))
    assert visible_nvml_indices(8, {"CUDA_VISIBLE_DEVICES": "5,7"}) == [5, 7]
    assert visible_nvml_indices(8, {"CUDA_VISIBLE_DEVICES": "5,9,6"}) == [5]  # CUDA stops at an invalid entry
    assert visible_nvml_indices(8, {"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_nvml_indices(8, {"CUDA_VISIBLE_DEVICES": "GPU-1f2e,GPU-3a4b"}) == list(range(8))


def test_the_health_sampler_reports_only_the_visible_devices(monkeypatch):
    import importlib.util
    import sys
    from pathlib import Path

    from trainforge.trainer.health import GpuHealthSampler

    fake = Path(__file__).resolve().parents[1] / "fake_nvml" / "pynvml.py"
    spec = importlib.util.spec_from_file_location("pynvml", fake)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    # another tenant's GPU 0 fails: this job (GPUs 2, 3) is not drained for it
    monkeypatch.setenv("TRAINFORGE_FAKE_NVML", "devices=4,device=0,fail=ecc")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    sampler = GpuHealthSampler.open()
    assert isinstance(sampler, GpuHealthSampler)
    try:
        health = sampler.sample()
    finally:
        sampler.close()
    assert [d["index"] for d in health["devices"]] == [2, 3] and health["healthy"] is True
