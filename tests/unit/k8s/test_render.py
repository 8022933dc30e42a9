"""The Kubernetes renderers (pure): every manifest of every case is schema-valid (kubernetes-validate's strict
OpenAPI schemas for core kinds, the vendored JobSet/Kueue CRDs for theirs); placement, GPU requests, NCCL
variants (InfiniBand, EFA, GPUDirect-TCPX, CPU), Kueue labels, priority classes, secret references, spot
tolerations and the network policy are what the spec and plan say; the validator refuses broken objects;
golden files pin the 7B and 200B examples (regenerate: TRAINFORGE_UPDATE_GOLDEN=1).

Run: .venv/bin/python -m pytest tests/unit/k8s -q   (a few seconds)
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from trainforge.infra.k8s.job import manifests_for_spec, preview_placement
from trainforge.infra.k8s.nccl import NcclConfig, nccl_environment
from trainforge.infra.k8s.render import (
    PRIORITY_VALUES,
    K8sOptions,
    dns_label,
    jobset_name,
    render_job,
    secret_name,
)
from trainforge.infra.k8s.validate import ManifestInvalid, validate_manifest, validate_manifests
from trainforge.plan.cluster import ClusterSpec, NodeGroup, load_cluster
from trainforge.spec import JobSpec, Priority, load_spec

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples"
GOLDEN = Path(__file__).parent / "golden"
FLEET = load_cluster(EXAMPLES / "clusters" / "fleet-10k.yaml")
JOB_ID = "job-20261129-000000-abcd"


def cloud_cluster(link: str, spot: bool = False) -> ClusterSpec:
    return ClusterSpec(name=f"cloud-{link}", node_groups=[NodeGroup(
        name=f"h100-{link}", gpu_type="h100", nodes=8, gpus_per_node=8, nodes_per_rack=4, inter_node_link=link,
        spot=spot)])


def h100_spec(nodes: int = 2, **extra: Any) -> JobSpec:
    doc = yaml.safe_load((EXAMPLES / "llama-7b-finetune.yaml").read_text())
    doc["resources"] = {"gpu_type": "h100", "min_gpus": 8 * nodes, "gpus_per_node": 8}
    doc["parallelism"] = {"strategy": "explicit", "dp": 8 * nodes, "sharding": "full-shard", "micro_batch_size": 1}
    doc.update(extra)
    return JobSpec.model_validate(doc)


def parts(manifests: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {m["kind"]: m for m in manifests}


def pod_spec(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    return parts(manifests)["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def env_of(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod_spec(manifests)["containers"][0]["env"]}


CASES = [
    # (id, spec, cluster, options)
    ("tiny-cpu", lambda: load_spec(EXAMPLES / "tiny-cpu.yaml"), lambda: load_cluster(
        EXAMPLES / "clusters" / "this-machine.yaml"), K8sOptions()),
    ("7b-infiniband", lambda: load_spec(EXAMPLES / "llama-7b-finetune.yaml"), lambda: FLEET, K8sOptions()),
    ("200b-infiniband", lambda: load_spec(EXAMPLES / "llama-200b-pretrain.yaml"), lambda: FLEET, K8sOptions()),
    ("h100-efa-spot", lambda: h100_spec(2, priority="preemptible"), lambda: cloud_cluster("efa", spot=True),
     K8sOptions(efa_devices_per_node=32)),
    ("h100-tcpx", lambda: h100_spec(4), lambda: cloud_cluster("gpudirect-tcpx"), K8sOptions(topology_aware=True)),
    ("h100-ethernet-no-kueue", lambda: h100_spec(2, priority="low"), lambda: cloud_cluster("ethernet"),
     K8sOptions(kueue=False, queue="ignored")),
]


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def case(request: pytest.FixtureRequest) -> tuple[str, JobSpec, ClusterSpec, list[dict[str, Any]]]:
    name, spec_fn, cluster_fn, options = request.param
    spec, cluster = spec_fn(), cluster_fn()
    return name, spec, cluster, manifests_for_spec(spec, JOB_ID, cluster, options)


def test_every_manifest_is_schema_valid(case):
    _, _, _, manifests = case
    assert validate_manifests(manifests) == len(manifests)
    kinds = [m["kind"] for m in manifests]
    assert kinds[0] == "PriorityClass" and kinds[-1] == "JobSet"  # classes before the objects that use them


def test_one_pod_per_placed_node_with_affinity_to_exactly_those_nodes(case):
    _, spec, cluster, manifests = case
    js = parts(manifests)["JobSet"]
    job = js["spec"]["replicatedJobs"][0]["template"]["spec"]
    placement = preview_placement(spec, cluster, {"tp": spec.parallelism.tp, "pp": spec.parallelism.pp})
    assert job["parallelism"] == job["completions"] == len(placement)
    assert job["completionMode"] == "Indexed"
    terms = pod_spec(manifests)["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    exprs = {e["key"]: e["values"] for e in terms["nodeSelectorTerms"][0]["matchExpressions"]}
    group = next(g for g in cluster.node_groups if placement[0][0].startswith(g.name + "-"))
    assert exprs["trainforge.io/gpu-type"] == [spec.resources.gpu_type.value]
    assert exprs["trainforge.io/interconnect"] == [group.inter_node_link]  # one fabric: one Kueue flavor
    if "no-kueue" in case[0]:  # trainforge's scheduler places: pinned to exactly its nodes and racks
        assert exprs["kubernetes.io/hostname"] == [n for n, _ in placement]
        assert all(r.startswith(group.name) for r in exprs["trainforge.io/rack"])
    else:  # Kueue places (topology-aware): no pin to the preview's nodes, which Kueue has not admitted
        assert "kubernetes.io/hostname" not in exprs and "trainforge.io/rack" not in exprs
    anti = pod_spec(manifests)["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname"
    cmd = pod_spec(manifests)["containers"][0]["command"]
    assert f"--nnodes={len(placement)}" in cmd and "--node-rank=$(JOB_COMPLETION_INDEX)" in cmd
    assert f"--nproc-per-node={len(placement[0][1])}" in cmd
    assert cmd[-2:] == ["-m", "trainforge.trainer.worker"]
    assert js["spec"]["failurePolicy"]["maxRestarts"] == spec.fault_tolerance.max_segment_retries


def test_gpu_requests_by_type_and_fabric(case):
    name, spec, _, manifests = case
    res = pod_spec(manifests)["containers"][0]["resources"]
    if spec.resources.gpu_type.value == "cpu":
        assert "nvidia.com/gpu" not in res["limits"]
        return
    assert res["limits"]["nvidia.com/gpu"] == str(min(8, spec.resources.gpus_per_node))
    assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"]
    assert ("rdma/rdma_shared_device_a" in res["limits"]) == ("infiniband" in name)
    assert res["limits"].get("vpc.amazonaws.com/efa") == ("32" if "efa" in name else None)


@pytest.mark.parametrize("link,expected,absent", [
    ("infiniband", {"NCCL_IB_HCA": "mlx5", "NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_TIMEOUT": "22"}, ["FI_PROVIDER"]),
    ("efa", {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "NCCL_SOCKET_IFNAME": "eth0"}, ["NCCL_IB_HCA"]),
    ("gpudirect-tcpx", {"NCCL_NET": "GPUDirectTCPX_v7", "NCCL_GPUDIRECTTCPX_SOCKET_IFNAME": "eth1,eth2,eth3,eth4",
                        "NCCL_GPUDIRECTTCPX_CTRL_DEV": "eth0"}, ["NCCL_IB_HCA", "FI_PROVIDER"]),
    ("ethernet", {"NCCL_SOCKET_IFNAME": "eth0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, ["NCCL_IB_HCA"]),
])
def test_nccl_environment_per_link(link, expected, absent):
    env = nccl_environment(NcclConfig(link=link, collective_timeout_s=300))
    assert {k: env[k] for k in expected} == expected
    assert env["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "300"
    assert not set(absent) & env.keys()


def test_nccl_environment_cpu_and_unknown_link():
    assert nccl_environment(NcclConfig(link="loopback")) == {}
    with pytest.raises(ValueError, match="no NCCL settings"):
        nccl_environment(NcclConfig(link="carrier-pigeon"))


def test_worker_env_injected_and_nccl_matches_the_node_group(case):
    name, spec, _, manifests = case
    env = env_of(manifests)
    assert env["TRAINFORGE_JOB_CONFIG"] == "/etc/trainforge/worker-config.json"
    assert env["TRAINFORGE_EMERGENCY_CHECKPOINT_SIGNAL"] == "SIGTERM"
    assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert ("NCCL_IB_HCA" in env) == ("infiniband" in name)
    assert ("FI_PROVIDER" in env) == ("efa" in name)
    assert ("NCCL_GPUDIRECTTCPX_SOCKET_IFNAME" in env) == ("tcpx" in name)
    assert ("NCCL_SOCKET_IFNAME" in env) == (spec.resources.gpu_type.value != "cpu")


def test_kueue_labels_and_priority_classes(case):
    name, spec, _, manifests = case
    p = parts(manifests)
    labels = p["JobSet"]["metadata"]["labels"]
    klass = f"trainforge-{spec.priority.value}"
    assert p["PriorityClass"]["metadata"]["name"] == klass == pod_spec(manifests)["priorityClassName"]
    assert p["PriorityClass"]["value"] == PRIORITY_VALUES[spec.priority]
    assert p["PriorityClass"]["preemptionPolicy"] == ("Never" if spec.priority is Priority.PREEMPTIBLE
                                                      else "PreemptLowerPriority")
    if "no-kueue" in name:
        assert "kueue.x-k8s.io/queue-name" not in labels and "suspend" not in p["JobSet"]["spec"]
        assert "WorkloadPriorityClass" not in p
    else:
        assert labels["kueue.x-k8s.io/queue-name"] == f"team-{spec.team}"
        assert labels["kueue.x-k8s.io/priority-class"] == klass
        assert p["WorkloadPriorityClass"]["value"] == PRIORITY_VALUES[spec.priority]
        assert p["JobSet"]["spec"]["suspend"] is True


def test_priority_values_are_ordered():
    values = [PRIORITY_VALUES[p] for p in sorted(Priority, key=lambda p: p.rank)]
    assert values == sorted(values) and len(set(values)) == len(values)


def test_network_policy_confines_the_gang(case):
    _, _, _, manifests = case
    p = parts(manifests)
    pol, name = p["NetworkPolicy"]["spec"], p["JobSet"]["metadata"]["name"]
    own = {"jobset.sigs.k8s.io/jobset-name": name}
    assert pol["podSelector"]["matchLabels"] == own
    assert pol["policyTypes"] == ["Ingress", "Egress"]
    assert pol["ingress"] == [{"from": [{"podSelector": {"matchLabels": own}}]}]
    assert pol["egress"][0] == {"to": [{"podSelector": {"matchLabels": own}}]}
    assert all(port["port"] in (53, 443) for rule in pol["egress"][1:] for port in rule["ports"])


def test_secrets_are_references_never_values():
    spec = load_spec(EXAMPLES / "llama-7b-finetune.yaml")
    manifests = manifests_for_spec(spec, JOB_ID, FLEET)
    env = env_of(manifests)
    assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "nlp-hf-token", "key": "value"}}
    assert "Secret" not in parts(manifests)  # the platform never writes secret values into manifests
    assert secret_name("team_a/db.password") == "team-a-db-password"


def test_spot_gets_tolerations_and_the_emergency_checkpoint_grace():
    spec = h100_spec(2)
    on_demand = pod_spec(manifests_for_spec(spec, JOB_ID, cloud_cluster("efa")))
    spot = pod_spec(manifests_for_spec(spec, JOB_ID, cloud_cluster("efa", spot=True),
                                       K8sOptions(termination_grace_s=90)))
    assert not any(t["key"] == "trainforge.io/spot" for t in on_demand["tolerations"])
    assert {"key": "trainforge.io/spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"} \
        in spot["tolerations"]
    assert spot["terminationGracePeriodSeconds"] == 90
    assert {"name": "TRAINFORGE_TERMINATION_GRACE_S", "value": "90"} in spot["containers"][0]["env"]
    disruption = {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    js = parts(manifests_for_spec(spec, JOB_ID, cloud_cluster("efa", spot=True)))["JobSet"]
    assert disruption in js["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"]


def test_tcpx_adds_the_receive_daemon_and_nics():
    manifests = manifests_for_spec(h100_spec(2), JOB_ID, cloud_cluster("gpudirect-tcpx"))
    pod = pod_spec(manifests)
    assert [c["name"] for c in pod["containers"]] == ["worker", "tcpx-daemon"]
    assert pod["containers"][1]["securityContext"] == {"privileged": True}
    ann = parts(manifests)["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["metadata"]
    assert "eth4" in ann["annotations"]["networking.gke.io/interfaces"]


def test_topology_aware_asks_kueue_for_one_rack_when_the_gang_fits():
    ann = parts(manifests_for_spec(h100_spec(4), JOB_ID, cloud_cluster("infiniband")))["JobSet"]
    meta = ann["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["metadata"]["annotations"]
    assert meta["kueue.x-k8s.io/podset-required-topology"] == "trainforge.io/rack"
    wide = parts(manifests_for_spec(h100_spec(8), JOB_ID, cloud_cluster("infiniband"),
                                    K8sOptions(topology_aware=True)))["JobSet"]
    meta = wide["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["metadata"]["annotations"]
    assert meta["kueue.x-k8s.io/podset-preferred-topology"] == "trainforge.io/rack"


@pytest.mark.parametrize("job_id", ["a" * 80, "Team_A.Job_1", "x--y-"])
def test_names_are_dns_labels_within_limits(job_id):
    name = jobset_name(job_id)
    assert len(name) <= 40 and name == dns_label(name)
    assert len(f"{name}-node-0-0") <= 63
    manifests = manifests_for_spec(load_spec(EXAMPLES / "tiny-cpu.yaml"), job_id,
                                   load_cluster(EXAMPLES / "clusters" / "this-machine.yaml"))
    validate_manifests(manifests)


@pytest.mark.parametrize("placement,error", [
    ([("nowhere-0", [0, 1, 2, 3, 4, 5, 6, 7])], "not in cluster"),
    ([("h100-efa-0", list(range(8))), ("h100-efa-1", list(range(4)))], "different GPU counts"),
    ([("h100-efa-99", list(range(8)))], "not in cluster"),
])
def test_render_refuses_impossible_placements(placement, error):
    with pytest.raises(ValueError, match=error):
        render_job(h100_spec(2), JOB_ID, cloud_cluster("efa"), placement, {})


def test_render_refuses_a_placement_of_another_gpu_type():
    spec = load_spec(EXAMPLES / "llama-7b-finetune.yaml")  # a100-80gb
    with pytest.raises(ValueError, match="wants a100-80gb"):
        render_job(spec, JOB_ID, FLEET, [("h100-onprem-0", list(range(8)))], {})


def _broken(mutate) -> dict[str, Any]:
    js = copy.deepcopy(parts(manifests_for_spec(h100_spec(2), JOB_ID, cloud_cluster("efa")))["JobSet"])
    mutate(js)
    return js


def _pod(js: dict[str, Any]) -> dict[str, Any]:
    return js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


@pytest.mark.parametrize("mutate,message", [
    (lambda js: _pod(js)["containers"][0].update(bogus=1), "bogus"),
    (lambda js: _pod(js)["containers"][0]["resources"]["limits"].update({"nvidia.com/gpu": [8]}), "nvidia.com/gpu"),
    (lambda js: _pod(js).update(restartPolicy=7), "restartPolicy"),
    (lambda js: js["spec"]["failurePolicy"].update(restartStrategy="Sometimes"), "restartStrategy"),
    (lambda js: js["spec"].update(replicas=3), "replicas"),
    (lambda js: js["spec"]["successPolicy"].update(operator="Most"), "operator"),
    (lambda js: js["metadata"]["labels"].update(bad="x" * 64), "63 characters"),
    (lambda js: js["metadata"].update(name="Not_A_Label"), "not a valid Kubernetes name"),
    (lambda js: js["metadata"].pop("namespace"), "namespace"),
    (lambda js: js["spec"]["replicatedJobs"][0]["template"]["spec"].update(backoffLimit="zero"), "backoffLimit"),
])
def test_validator_refuses_broken_manifests(mutate, message):
    js = _broken(mutate)
    with pytest.raises(ManifestInvalid) as info:
        validate_manifest(js)
    if message:
        assert message in str(info.value)


def test_validator_refuses_unknown_core_fields_and_kinds():
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x", "namespace": "n"}, "dta": {}}
    with pytest.raises(ManifestInvalid, match="dta"):
        validate_manifest(cm)
    with pytest.raises(ManifestInvalid, match="Couldn't find schema"):
        validate_manifest({"apiVersion": "example.com/v1", "kind": "Gadget", "metadata": {"name": "g",
                                                                                         "namespace": "n"}})


@pytest.mark.parametrize("example", ["llama-7b-finetune", "llama-200b-pretrain"])
def test_golden_manifests(example):
    spec = load_spec(EXAMPLES / f"{example}.yaml")
    manifests = manifests_for_spec(spec, f"{example}-20261129-000000-abcd", FLEET)
    text = yaml.safe_dump_all(manifests, sort_keys=True)
    golden = GOLDEN / f"{example}.yaml"
    if os.environ.get("TRAINFORGE_UPDATE_GOLDEN") or not golden.is_file():
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(text)
    assert text == golden.read_text(), f"{golden} changed: review, then TRAINFORGE_UPDATE_GOLDEN=1"
