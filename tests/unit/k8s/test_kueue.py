"""Kueue as the admission point (pure, a few seconds): the cluster-admin objects rendered from the cluster
description (Topology, a ResourceFlavor per GPU type and fabric, the shared Cohort, a ClusterQueue and LocalQueue
per team) validate against the vendored CRDs; quotas add up to the capacity and never exceed a team's hard cap;
a job's JobSet names objects that exist and one flavor only; topology requests follow the plan; the CRD validator
is strict the way an API server's structural schema is; secrets never reach a manifest as values.

Run: .venv/bin/python -m pytest tests/unit/k8s/test_kueue.py -q
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from trainforge.contract.config import SegmentConfig
from trainforge.infra.k8s.job import manifests_for_spec
from trainforge.infra.k8s.kueue import SHARED_POOL, flavors, quotas, render_cluster_admin, team_specs
from trainforge.infra.k8s.render import (
    BLOCK_LABEL,
    RACK_LABEL,
    TAS_PREFERRED,
    TAS_REQUIRED,
    TAS_SLICE_REQUIRED,
    TAS_SLICE_SIZE,
    K8sOptions,
    topology_annotations,
)
from trainforge.infra.k8s.validate import (
    CRD_DIR,
    ManifestInvalid,
    _check_keywords,
    crd_versions,
    schema_errors,
    validate_manifest,
    validate_manifests,
)
from trainforge.plan.cluster import ClusterSpec, NodeGroup, TeamSpec, load_cluster
from trainforge.plan.layout import Layout
from trainforge.spec import JobSpec, load_spec

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = ROOT / "examples"
FLEET = load_cluster(EXAMPLES / "clusters" / "fleet-10k.yaml")
ADMIN = render_cluster_admin(FLEET)


def of_kind(objs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def gpus(quota: dict[str, Any]) -> tuple[int, int | None]:
    r = next(r for r in quota["resources"] if r["name"] == "nvidia.com/gpu")
    return int(r["nominalQuota"]), (int(r["borrowingLimit"]) if "borrowingLimit" in r else None)


def test_cluster_admin_objects_validate_against_the_published_crds():
    assert validate_manifests(ADMIN) == len(ADMIN)
    kinds = [o["kind"] for o in ADMIN]
    # Apply order: what others refer to first (priority classes, topology, flavors, cohort, queues).
    order = ["WorkloadPriorityClass", "Topology", "ResourceFlavor", "Cohort", "ClusterQueue", "LocalQueue"]
    assert [k for k in dict.fromkeys(kinds) if k in order] == order
    assert set(of_kind(ADMIN, "ClusterQueue")) == {f"team-{t}" for t in FLEET.teams}
    for name, lq in of_kind(ADMIN, "LocalQueue").items():
        assert lq["spec"]["clusterQueue"] == name and lq["metadata"]["namespace"] == "trainforge"
    versions = crd_versions()
    for o in ADMIN:  # every CRD object at its storage version (Kueue's v1beta1 is deprecated)
        if (o["apiVersion"], o["kind"]) in versions:
            assert versions[(o["apiVersion"], o["kind"])].storage, o["kind"]


def test_one_flavor_per_gpu_type_and_fabric_with_a_topology():
    flavor_objs = of_kind(ADMIN, "ResourceFlavor")
    topologies = of_kind(ADMIN, "Topology")
    keys = {(f["spec"]["nodeLabels"]["trainforge.io/gpu-type"], f["spec"]["nodeLabels"]["trainforge.io/interconnect"])
            for f in flavor_objs.values()}
    assert len(keys) == len(flavor_objs)  # no flavor spans two fabrics or two GPU types
    assert {("h100", "infiniband"), ("h100", "efa")} <= keys  # the fleet's H100s: on-prem IB, AWS spot EFA
    for f in flavor_objs.values():
        levels = [lv["nodeLabel"] for lv in topologies[f["spec"]["topologyName"]]["spec"]["levels"]]
        assert levels[-1] == "kubernetes.io/hostname" and RACK_LABEL in levels
    assert [lv["nodeLabel"] for lv in topologies["fleet-10k-block"]["spec"]["levels"]] == [
        BLOCK_LABEL, RACK_LABEL, "kubernetes.io/hostname"]
    assert flavor_objs["h100-infiniband"]["spec"]["topologyName"] == "fleet-10k-block"  # racks_per_block: 8
    assert flavor_objs["h100-efa-spot"]["spec"]["topologyName"] == "fleet-10k-rack"  # the AWS rack has no blocks
    assert flavor_objs["h100-efa-spot"]["spec"]["nodeTaints"] == [
        {"key": "trainforge.io/spot", "value": "true", "effect": "NoSchedule"}]


def test_quotas_add_up_to_the_capacity_and_respect_hard_caps():
    cohort = of_kind(ADMIN, "Cohort")["trainforge"]
    left = {f["name"]: gpus(f)[0] for g in cohort["spec"].get("resourceGroups", []) for f in g["flavors"]}
    queues = of_kind(ADMIN, "ClusterQueue")
    by_type: dict[tuple[str, str], int] = {}
    for f in flavors(FLEET):
        nominal = 0
        for team, cq in queues.items():
            entry = next(x for x in cq["spec"]["resourceGroups"][0]["flavors"] if x["name"] == f.name)
            n, borrow = gpus(entry)
            nominal += n
            cap = FLEET.teams[team.removeprefix("team-")].quota
            if f.gpu_type in cap or "*" in cap:
                assert borrow is not None and n + borrow <= min(cap.get(f.gpu_type, 10**9), cap.get("*", 10**9))
                by_type[(team, f.gpu_type)] = by_type.get((team, f.gpu_type), 0) + n + borrow
            else:
                assert borrow is None  # no cap: borrowing unlimited within the cohort
            assert n % f.groups[0].gpus_per_node == 0  # whole nodes
        assert nominal + left.get(f.name, 0) == f.gpus
    for (team, gpu_type), most in by_type.items():  # the cap over a type's flavors together
        cap = FLEET.teams[team.removeprefix("team-")].quota
        assert most <= cap.get(gpu_type, cap.get("*", 10**9))
    # Heavier teams get more: foundation (weight 4) > nlp (2) on the uncapped A100s.
    a100 = {t: n for t, (n, _, _) in quotas(FLEET, team_specs(FLEET))["a100-80gb-infiniband"].items()}
    assert a100["foundation"] > a100["nlp"] > a100["research"]
    cq = queues["team-foundation"]["spec"]
    assert cq["cohortName"] == "trainforge" and cq["fairSharing"]["weight"] == 4
    assert cq["preemption"] == {"withinClusterQueue": "LowerPriority", "reclaimWithinCohort": "Any",
                                "borrowWithinCohort": {"policy": "Never"}}


def test_a_dedicated_pool_is_its_owners_and_lends_nothing():
    cluster = ClusterSpec(name="mixed", teams={"vision": TeamSpec(weight=1.5), "nlp": TeamSpec()}, node_groups=[
        NodeGroup(name="shared-h100", gpu_type="h100", nodes=8, gpus_per_node=8, nodes_per_rack=4),
        NodeGroup(name="vision-h100", gpu_type="h100", nodes=4, gpus_per_node=8, nodes_per_rack=4, pool="vision")])
    objs = render_cluster_admin(cluster)
    validate_manifests(objs)
    queues = of_kind(objs, "ClusterQueue")
    vision = {f["name"]: f for f in queues["team-vision"]["spec"]["resourceGroups"][0]["flavors"]}
    nlp = {f["name"] for f in queues["team-nlp"]["spec"]["resourceGroups"][0]["flavors"]}
    assert "h100-infiniband-vision" in vision and "h100-infiniband-vision" not in nlp
    gpu = next(r for r in vision["h100-infiniband-vision"]["resources"] if r["name"] == "nvidia.com/gpu")
    assert gpu == {"name": "nvidia.com/gpu", "nominalQuota": "32", "borrowingLimit": "0", "lendingLimit": "0"}
    assert queues["team-vision"]["spec"]["fairSharing"]["weight"] == "1.5"  # int-or-string quantity
    pools = {f["metadata"]["name"]: f["spec"]["nodeLabels"]["trainforge.io/pool"]
             for f in of_kind(objs, "ResourceFlavor").values()}
    assert pools == {"h100-infiniband": SHARED_POOL, "h100-infiniband-vision": "vision"}


def test_no_teams_is_an_error_naming_the_fix():
    with pytest.raises(ValueError, match="lists no teams"):
        render_cluster_admin(load_cluster(EXAMPLES / "clusters" / "this-machine.yaml"))
    objs = render_cluster_admin(load_cluster(EXAMPLES / "clusters" / "this-machine.yaml"), extra_teams=["demo"])
    assert validate_manifests(objs) and "team-demo" in of_kind(objs, "LocalQueue")


@pytest.mark.parametrize("example", ["llama-7b-finetune", "llama-70b-pretrain", "llama-200b-pretrain"])
def test_the_jobset_joins_a_queue_a_priority_and_one_flavor(example):
    spec = load_spec(EXAMPLES / f"{example}.yaml")
    manifests = manifests_for_spec(spec, f"{example}-1", FLEET)
    assert validate_manifests(manifests) == len(manifests)  # against the published CRDs
    job = {m["kind"]: m for m in manifests}
    SegmentConfig.model_validate_json(job["ConfigMap"]["data"]["worker-config.json"])  # the pods' config loads
    labels = job["JobSet"]["metadata"]["labels"]
    assert labels["kueue.x-k8s.io/queue-name"] in of_kind(ADMIN, "LocalQueue")
    assert labels["kueue.x-k8s.io/priority-class"] in of_kind(ADMIN, "WorkloadPriorityClass")
    pod = job["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    exprs = {e["key"]: set(e["values"]) for e in
             pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
                 "nodeSelectorTerms"][0]["matchExpressions"]}
    fitting = [f for f in of_kind(ADMIN, "ResourceFlavor").values()
               if all(v in exprs.get(k, {v}) for k, v in f["spec"]["nodeLabels"].items())
               and not f["spec"].get("nodeTaints")]  # the example jobs do not tolerate spot
    assert len(fitting) == 1  # Kueue can admit the gang on one flavor: one GPU type, one fabric
    requested = set(pod["spec"]["containers"][0]["resources"]["requests"])
    covered = set(of_kind(ADMIN, "ClusterQueue")[labels["kueue.x-k8s.io/queue-name"]]["spec"]["resourceGroups"][0][
        "coveredResources"])
    assert requested <= covered  # Kueue refuses a workload asking for a resource its queue does not cover
    ann = pod["metadata"]["annotations"]
    assert TAS_REQUIRED in ann or TAS_PREFERRED in ann


def test_200b_asks_for_pipeline_slices_within_a_rack():
    spec = load_spec(EXAMPLES / "llama-200b-pretrain.yaml")
    manifests = manifests_for_spec(spec, "llama-200b-1", FLEET)
    config = json.loads(next(m for m in manifests if m["kind"] == "ConfigMap")["data"]["worker-config.json"])
    js = next(m for m in manifests if m["kind"] == "JobSet")["spec"]["replicatedJobs"][0]["template"]["spec"]
    ann, pods = js["template"]["metadata"]["annotations"], js["parallelism"]
    tp, pp = config["layout"]["tp"], config["layout"]["pp"]
    replica_nodes = tp * pp // 8
    assert pods > 32 and replica_nodes > 1  # spans racks, a model replica spans nodes
    assert ann[TAS_SLICE_REQUIRED] == RACK_LABEL and int(ann[TAS_SLICE_SIZE]) == replica_nodes
    assert pods % replica_nodes == 0


@pytest.mark.parametrize("pods,tp,pp,blocks,expected", [
    (4, 8, 1, None, {TAS_REQUIRED: RACK_LABEL}),  # fits a rack: the whole gang there
    (8, 8, 2, None, {TAS_PREFERRED: RACK_LABEL, TAS_SLICE_REQUIRED: RACK_LABEL, TAS_SLICE_SIZE: "2"}),
    (8, 8, 2, 2, {TAS_REQUIRED: BLOCK_LABEL, TAS_SLICE_REQUIRED: RACK_LABEL, TAS_SLICE_SIZE: "2"}),
    (16, 8, 2, 2, {TAS_PREFERRED: BLOCK_LABEL, TAS_SLICE_REQUIRED: RACK_LABEL, TAS_SLICE_SIZE: "2"}),
    (8, 2, 1, None, {TAS_PREFERRED: RACK_LABEL}),  # 4 replicas per node: nothing crosses a node but DP
    (8, 8, 8, None, {TAS_PREFERRED: RACK_LABEL}),  # a replica bigger than a rack: no slice can hold it
])
def test_topology_annotations(pods, tp, pp, blocks, expected):
    group = NodeGroup(name="g", gpu_type="h100", nodes=64, gpus_per_node=8, nodes_per_rack=4, racks_per_block=blocks)
    assert topology_annotations(group, pods, 8, Layout(dp=pods * 8 // (tp * pp), tp=tp, pp=pp)) == expected


# ------------------------------------------------------------------------------------------ the CRD validator

def _cq() -> dict[str, Any]:
    return copy.deepcopy(of_kind(ADMIN, "ClusterQueue")["team-nlp"])


@pytest.mark.parametrize("mutate,message", [
    (lambda o: o["spec"].update(cohort="trainforge"), "spec.cohort: unknown field"),  # v1beta1's name
    (lambda o: o["spec"]["preemption"].update(withinClusterQueue="Always"), "is not one of"),
    (lambda o: o["spec"]["fairSharing"].update(weight=[1]), "must be an integer or a string"),
    (lambda o: o["spec"]["fairSharing"].update(weight="heavy"), "does not match the pattern"),
    (lambda o: o["spec"]["resourceGroups"][0]["flavors"].append(
        copy.deepcopy(o["spec"]["resourceGroups"][0]["flavors"][0])), "keys must be unique"),
    (lambda o: o["spec"]["resourceGroups"][0]["flavors"][0]["resources"][0].pop("nominalQuota"),
     "nominalQuota: required field missing"),
    (lambda o: o.update(apiVersion="kueue.x-k8s.io/v1alpha1"), "not served by the ClusterQueue CRD"),
    (lambda o: o["metadata"].update(namespace="trainforge"), "cluster-scoped"),
    (lambda o: o["metadata"].update(labels={"bad": "x" * 64}), "63 characters"),
    (lambda o: o["spec"].pop("cohortName"), "borrowingLimit must be nil when cohort is empty"),  # a CEL rule
    (lambda o: o["spec"]["preemption"].update(reclaimWithinCohort="Never", borrowWithinCohort={
        "policy": "LowerPriority"}), "reclaimWithinCohort=Never and borrowWithinCohort.Policy!=Never"),
    (lambda o: o["spec"]["resourceGroups"][0]["flavors"][0]["resources"].pop(), "same number of resources"),
])
def test_crd_validator_refuses_what_the_api_server_would(mutate, message):
    obj = _cq()
    mutate(obj)
    with pytest.raises(ManifestInvalid) as info:
        validate_manifest(obj)
    text = str(info.value)
    assert message in text and text.startswith("ClusterQueue/team-nlp")


@pytest.mark.parametrize("kind,mutate,message", [
    ("Topology", lambda o: o["spec"]["levels"].reverse(), "kubernetes.io/hostname label can only be used at the lowest"),
    ("Topology", lambda o: o["spec"]["levels"].append(dict(o["spec"]["levels"][0])), "must be unique"),
    ("ResourceFlavor", lambda o: o["spec"].update(nodeLabels={}), "at least one nodeLabel is required"),
    ("ResourceFlavor", lambda o: o["spec"].update(tolerations=[{"operator": "Equal", "value": "x"}]),
     "operator must be Exists when 'key' is empty"),
])
def test_the_crds_create_time_cel_rules_are_enforced(kind, mutate, message):
    obj = copy.deepcopy(next(o for o in ADMIN if o["kind"] == kind))
    mutate(obj)
    with pytest.raises(ManifestInvalid, match=re.escape(message)):
        validate_manifest(obj)


def test_structural_schema_semantics():
    schema = {"type": "object", "properties": {
        "open": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        "closed": {"type": "object", "properties": {"a": {"type": "integer", "format": "int32"}}},
        "map": {"type": "object", "additionalProperties": {"type": "string"}},
        "port": {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}]},
        "maybe": {"type": "string", "nullable": True},
        "tags": {"type": "array", "items": {"type": "string"}, "x-kubernetes-list-type": "set"},
        "obj": {"type": "object", "x-kubernetes-embedded-resource": True, "properties": {"spec": {"type": "object"}}},
    }}
    ok = {"open": {"anything": {"goes": 1}}, "closed": {"a": 1}, "map": {"k": "v"}, "port": "http", "maybe": None,
          "tags": ["a", "b"], "obj": {"apiVersion": "v1", "kind": "X", "spec": {}}}
    assert schema_errors(ok, schema) == []
    assert schema_errors({"port": 8080}, schema) == []
    bad = schema_errors({"closed": {"a": 2**31, "b": 1}, "map": {"k": 1}, "port": 1.5, "tags": ["a", "a"],
                         "obj": {"spec": {"x": 1}}, "extra": True}, schema)
    assert any(e.startswith("closed.a: ") and "int32" in e for e in bad)
    assert any(e.startswith("closed.b: unknown field") for e in bad)
    assert any(e.startswith("map.k: must be a string") for e in bad)
    assert any(e.startswith("port: must be an integer or a string") for e in bad)
    assert any(e.startswith("tags: 'a' appears twice") for e in bad)
    assert any(e.startswith("obj.spec.x: unknown field") for e in bad)  # an object with no fields declared
    assert any(e.startswith("extra: unknown field") for e in bad)
    assert schema_errors({"maybe": None}, {"type": "object", "properties": {"maybe": {"type": "string"}}}) == [
        "maybe: null is not allowed here"]


def test_a_schema_keyword_or_cel_rule_the_validator_does_not_check_is_refused():
    with pytest.raises(ValueError, match="not supported"):
        _check_keywords({"type": "object", "properties": {"x": {"type": "string", "x-kubernetes-new-thing": 1}}},
                        "test")
    with pytest.raises(ValueError, match="not transcribed"):
        _check_keywords({"type": "object", "x-kubernetes-validations": [{"rule": "self.size() > 1"}]}, "test")
    _check_keywords({"type": "object", "x-kubernetes-validations": [{"rule": "self == oldSelf"}]}, "test")  # update


def test_vendored_crds_are_the_published_files_unchanged():
    readme = (CRD_DIR / "README.md").read_text()
    listed = dict((name, digest) for digest, name in re.findall(r"^([0-9a-f]{64})  (\S+)$", readme, re.M))
    files = sorted(p.name for p in CRD_DIR.glob("*.yaml"))
    assert sorted(listed) == files
    for name in files:
        assert hashlib.sha256((CRD_DIR / name).read_bytes()).hexdigest() == listed[name], name
    kinds = {k for _, k in crd_versions()}
    assert kinds == {"JobSet", "ClusterQueue", "Cohort", "LocalQueue", "ResourceFlavor", "Topology",
                     "WorkloadPriorityClass"}


# ------------------------------------------------------------------------------------------ isolation

def test_secret_values_never_enter_a_manifest(monkeypatch, tmp_path):
    values = {"nlp/hf-token": "hf_S3cr3t-value-0123456789", "nlp/wandb.key": "wandb-9f8e7d6c5b4a"}
    for name, value in values.items():  # where the platform's secret store would find them
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(value)
        monkeypatch.setenv("TRAINFORGE_SECRET_" + re.sub(r"[^A-Z0-9]", "_", name.upper()), value)
    monkeypatch.setenv("TRAINFORGE_SECRETS_DIR", str(tmp_path))
    doc = yaml.safe_load((EXAMPLES / "llama-7b-finetune.yaml").read_text())
    doc["secrets"] = [{"name": "nlp/hf-token", "env": "HF_TOKEN"}, {"name": "nlp/wandb.key", "env": "WANDB_API_KEY"}]
    spec = JobSpec.model_validate(doc)
    platform = {"TRAINFORGE_STORAGE_URL": "s3://platform-bucket-visible"}
    manifests = manifests_for_spec(spec, "secret-job-1", FLEET, K8sOptions(env=platform))
    manifests += render_cluster_admin(FLEET)
    validate_manifests(manifests)
    text = "\n".join(json.dumps(m) for m in manifests)
    assert "s3://platform-bucket-visible" in text  # the scan sees what the renderer writes...
    for value in values.values():
        assert value not in text  # ...and no secret's value
    assert not [m for m in manifests if m["kind"] == "Secret"]
    env = {e["name"]: e for m in manifests if m["kind"] == "JobSet"
           for e in m["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "nlp-hf-token",
                                                                                   "key": "value"}}}
    assert env["WANDB_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "nlp-wandb-key"



def test_golden_cluster_admin_objects():
    """The fleet's Kueue objects, pinned (regenerate: TRAINFORGE_UPDATE_GOLDEN=1, then review the diff)."""
    text = yaml.safe_dump_all(ADMIN, sort_keys=True)
    golden = Path(__file__).parent / "golden" / "fleet-10k-cluster-admin.yaml"
    if os.environ.get("TRAINFORGE_UPDATE_GOLDEN") or not golden.is_file():
        golden.write_text(text)
    assert text == golden.read_text(), f"{golden} changed: review, then TRAINFORGE_UPDATE_GOLDEN=1"


# ------------------------------------------------------------------------------------------ the render targets

def test_render_cluster_prints_the_admin_objects_apart_from_a_jobs():
    from typer.testing import CliRunner

    from trainforge.cli import app

    runner = CliRunner()
    fleet = str(EXAMPLES / "clusters" / "fleet-10k.yaml")
    result = runner.invoke(app, ["render-cluster", "--cluster", fleet])
    assert result.exit_code == 0, result.output
    printed = list(yaml.safe_load_all(result.stdout))
    assert printed == ADMIN
    assert not {"JobSet", "ConfigMap", "NetworkPolicy"} & {o["kind"] for o in printed}
    small = str(EXAMPLES / "clusters" / "this-machine.yaml")
    refused = runner.invoke(app, ["render-cluster", "--cluster", small])
    assert refused.exit_code == 1 and "--team" in refused.output and "Traceback" not in refused.output
    assert runner.invoke(app, ["render-cluster", "--cluster", small, "--team", "demo"]).exit_code == 0
    job = runner.invoke(app, ["render", str(EXAMPLES / "llama-7b-finetune.yaml"), "--cluster", fleet,
                              "--job-id", "cli-1"])
    assert job.exit_code == 0, job.output
    kinds = [o["kind"] for o in yaml.safe_load_all(job.stdout)]
    assert kinds[-1] == "JobSet" and not {"ClusterQueue", "ResourceFlavor", "Topology"} & set(kinds)
    assert TAS_REQUIRED in job.stdout  # topology-aware by default with Kueue
