"""The Kubernetes backend with the official `kubernetes` client against an in-process fake API server
(tests/unit/k8s/fake_api.py; no real cluster can run here). The fake admits only objects the offline validator
accepts (422 otherwise), so everything the backend sends is schema-valid; the test plays Kueue, the JobSet
controller and the kubelet (admission, pods Pending -> Running -> Succeeded/Failed, JobSet terminal state).

Covers: apply order and shared classes created once; pod states followed to success and to failure; a timeout;
delete removes the job's objects and pods; `trainforge render` and `submit --backend kubernetes` end to end.

Run: .venv/bin/python -m pytest tests/integration/test_k8s_backend.py -q   (about 10 s)
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tests.unit.k8s.fake_api import FakeKubeAPI
from trainforge.infra.backends.kubernetes import GangFailed, KubernetesBackend, api_client
from trainforge.infra.k8s.job import manifests_for_spec
from trainforge.plan.cluster import ClusterSpec, NodeGroup, dump_cluster
from trainforge.spec import load_spec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NS = "trainforge"
JOBSETS = f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets"
PODS = f"/api/v1/namespaces/{NS}/pods"


def cluster() -> ClusterSpec:
    return ClusterSpec(name="k8s", node_groups=[NodeGroup(name="cpu", gpu_type="cpu", nodes=4, gpus_per_node=2,
                                                          nodes_per_rack=2, inter_node_link="ethernet",
                                                          intra_node_link="loopback")])


def spec():
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    doc["resources"] = {"gpu_type": "cpu", "min_gpus": 4, "gpus_per_node": 2}
    doc["parallelism"]["dp"] = 4
    from trainforge.spec import JobSpec

    return JobSpec.model_validate(doc)


def play_controllers(api: FakeKubeAPI, name: str, outcome: str, stop: threading.Event) -> None:
    """Kueue admits (unsuspends), the Job controller creates one pod per completion index, the kubelet runs
    them; then every pod succeeds, or pod 1 fails and JobSet marks itself failed."""
    key = f"{JOBSETS}/{name}"
    while key not in api.objects and not stop.wait(0.05):
        pass
    if stop.is_set():
        return
    time.sleep(0.3)
    api.patch(key, {"spec": {"suspend": False}})
    job = api.objects[key]["spec"]["replicatedJobs"][0]["template"]["spec"]
    pods = [f"{name}-node-0-{i}" for i in range(job["completions"])]
    for pod in pods:
        api.put(PODS, {"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": pod, "namespace": NS, "labels": {"jobset.sigs.k8s.io/jobset-name": name}},
            "spec": {"containers": [{"name": "worker", "image": "x"}]}, "status": {"phase": "Pending"}})
    for phase in ("Running",):
        time.sleep(0.3)
        for pod in pods:
            api.patch(f"{PODS}/{pod}", {"status": {"phase": phase}})
    time.sleep(0.3)
    if outcome == "hang":
        return
    if outcome == "fail":
        api.patch(f"{PODS}/{pods[1]}", {"status": {"phase": "Failed"}})
        api.patch(key, {"status": {"terminalState": "Failed", "conditions": [
            {"type": "Failed", "status": "True", "reason": "FailedJobs", "message": "jobset failed: node-0 failed"}]}})
        return
    for pod in pods:
        api.patch(f"{PODS}/{pod}", {"status": {"phase": "Succeeded"}})
    api.patch(key, {"status": {"terminalState": "Completed",
                               "conditions": [{"type": "Completed", "status": "True"}]}})


@pytest.fixture
def fake_api():
    with FakeKubeAPI() as api:
        yield api


def run_gang(api: FakeKubeAPI, outcome: str, timeout_s: float = 20.0):
    manifests = manifests_for_spec(spec(), f"tiny-{outcome}-1", cluster())
    name = manifests[-1]["metadata"]["name"]
    backend = KubernetesBackend(api_client(api.url), NS)
    stop = threading.Event()
    controllers = threading.Thread(target=play_controllers, args=(api, name, outcome, stop), daemon=True)
    controllers.start()
    seen = []
    try:
        created = backend.apply(manifests)
        result = backend.wait(name, timeout_s=timeout_s, poll_s=0.1, on_change=seen.append)
        return backend, name, created, seen, result
    finally:
        stop.set()
        controllers.join(timeout=5)


def test_apply_and_follow_the_gang_to_success(fake_api):
    backend, name, created, seen, result = run_gang(fake_api, "ok")
    assert [c.split("/")[0] for c in created] == ["PriorityClass", "WorkloadPriorityClass", "ConfigMap",
                                                  "NetworkPolicy", "JobSet"]
    assert result.state == "succeeded" and len(result.pods) == 2  # 4 CPU slots on 2 nodes
    states = [s.state for s in seen]
    assert states[0] == "pending" and "running" in states and states[-1] == "succeeded"
    assert seen[0].reason == "waiting for Kueue admission"
    # The pods carry the rendered config; the JobSet stored is exactly what was rendered and validated.
    js = fake_api.objects[f"{JOBSETS}/{name}"]
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-demo"
    cm = fake_api.objects[f"/api/v1/namespaces/{NS}/configmaps/{name}-config"]
    assert json.loads(cm["data"]["worker-config.json"])["job_id"] == "tiny-ok-1"

    # A second job of the same priority reuses the shared classes ("already exists" is fine).
    manifests = manifests_for_spec(spec(), "tiny-ok-2", cluster())
    assert [c.split("/")[0] for c in backend.apply(manifests)] == ["ConfigMap", "NetworkPolicy", "JobSet"]
    with pytest.raises(RuntimeError, match="409"):  # the same job twice is an error
        backend.apply(manifests)

    backend.delete(name)
    assert f"{JOBSETS}/{name}" not in fake_api.objects
    assert not any(name in k for k in fake_api.objects)  # config, policy and pods went with it
    backend.delete(name)  # idempotent


def test_a_failed_pod_fails_the_gang_with_the_reason(fake_api):
    with pytest.raises(GangFailed, match="node-0 failed") as info:
        run_gang(fake_api, "fail")
    assert "Failed" in info.value.pods.values()


def test_waiting_is_bounded(fake_api):
    with pytest.raises(TimeoutError, match="still running"):
        run_gang(fake_api, "hang", timeout_s=3.0)


def test_the_fake_api_refuses_what_the_api_server_would(fake_api):
    manifests = manifests_for_spec(spec(), "tiny-bad-1", cluster())
    manifests[-1]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["oops"] = 1
    with pytest.raises(RuntimeError, match="422"):
        KubernetesBackend(api_client(fake_api.url), NS).apply(manifests[-1:])


def test_render_cli_prints_valid_manifests():
    from trainforge.cli import app

    result = CliRunner().invoke(app, ["render", str(EXAMPLES / "llama-7b-finetune.yaml"), "--cluster",
                                      str(EXAMPLES / "clusters" / "fleet-10k.yaml"), "--job-id", "ft-1",
                                      "--image", "registry.example/trainforge:1"])
    assert result.exit_code == 0, result.output
    docs = list(yaml.safe_load_all(result.stdout))
    assert [d["kind"] for d in docs][-1] == "JobSet"
    pod = docs[-1]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == "registry.example/trainforge:1"
    bad = CliRunner().invoke(app, ["render", str(EXAMPLES / "llama-200b-pretrain.yaml")])  # this machine: no H100
    assert bad.exit_code == 1 and "has no h100 GPUs" in bad.output


def test_submit_backend_kubernetes_end_to_end(fake_api, tmp_path):
    from trainforge.cli import app

    cluster_file = tmp_path / "cluster.yaml"
    cluster_file.write_text(dump_cluster(cluster()))
    spec_file = tmp_path / "job.yaml"
    doc = spec().model_dump(mode="json", exclude_defaults=True)
    spec_file.write_text(yaml.safe_dump(doc))
    load_spec(spec_file)
    from trainforge.datasets.demo import ensure_demo_dataset

    ensure_demo_dataset()  # submit validates the dataset reference like every other submit
    stop = threading.Event()

    def controllers() -> None:  # the job id is generated by submit: follow whichever JobSet appears
        while not stop.is_set():
            names = [o["metadata"]["name"] for o in list(fake_api.objects.values()) if o["kind"] == "JobSet"]
            if names:
                return play_controllers(fake_api, names[0], "ok", stop)
            time.sleep(0.05)

    thread = threading.Thread(target=controllers, daemon=True)
    thread.start()
    try:
        result = CliRunner().invoke(app, ["submit", str(spec_file), "--backend", "kubernetes", "--cluster",
                                          str(cluster_file), "--kube-api", fake_api.url, "--timeout", "30", "--json"])
    finally:
        stop.set()
        thread.join(timeout=5)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["state"] == "succeeded" and out["events"][-1]["state"] == "succeeded"
    # The live scheduler reserved the nodes for the run and released them afterwards.
    from trainforge.infra.scheduler.live import LiveScheduler

    assert LiveScheduler(cluster()).queue() == []
