"""A job's gang as Kubernetes manifests (pure: dicts in, dicts out, no `kubernetes` import).

One JobSet (jobset.x-k8s.io/v1alpha2) per job: one replicated job `node` whose Indexed Job runs one pod per node
of the placement (parallelism = completions = nodes). Each pod runs torchrun's elastic agent with the static
rendezvous at pod 0's stable DNS name (JobSet's headless service), node rank = the pod's completion index, and
`--max-restarts` for in-pod worker restarts (tier 1 of recovery); a lost pod fails the Job and JobSet's failure
policy recreates the gang (tier 2) up to `max_segment_retries` times. Why JobSet rather than Kubeflow's
PyTorchJob: docs/production.md.

Around it: the PriorityClass of the job's priority (and Kueue's WorkloadPriorityClass of the same name and value),
a ConfigMap holding the worker config, and a NetworkPolicy that admits only the job's own pods (plus DNS and the
platform's HTTPS endpoints on egress). Kueue admits the JobSet whole (queue-name label; created suspended) and,
with topology-aware scheduling (on whenever Kueue is), places it: the pod template asks for the topology the plan
needs (`topology_annotations`) and pins only the GPU type and the fabric, not the scheduler's preview nodes, so
trainforge never books nodes Kueue has not admitted. The cluster-admin side (ResourceFlavors, Topology, Cohort,
ClusterQueues, LocalQueues) is trainforge/infra/k8s/kueue.py.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from trainforge.contract.config import SegmentConfig
from trainforge.infra.k8s.nccl import TCPX_SOCKET_DIR, NcclConfig, nccl_environment
from trainforge.infra.launch import WORKER_MODULE, worker_environment
from trainforge.plan.cluster import ClusterSpec, NodeGroup
from trainforge.plan.layout import Layout
from trainforge.spec import JobSpec, Priority

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
KUEUE_API = "kueue.x-k8s.io/v1beta2"  # the storage version (v1beta1: served, deprecated)
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB = "node"

# Node labels the platform's node-labeller puts on every node (the cluster description is generated from them).
NODE_LABEL = "kubernetes.io/hostname"
RACK_LABEL = "trainforge.io/rack"
BLOCK_LABEL = "trainforge.io/block"
"""Set on nodes of groups with `racks_per_block` (`<group>-b<k>`)."""
GROUP_LABEL = "trainforge.io/node-group"
GPU_TYPE_LABEL = "trainforge.io/gpu-type"
INTERCONNECT_LABEL = "trainforge.io/interconnect"
"""The node group's `inter_node_link` (infiniband, efa, ...): a Kueue ResourceFlavor per (GPU type, fabric)."""
CAPACITY_LABEL = "trainforge.io/capacity"
"""`spot` or `on-demand`."""
POOL_LABEL = "trainforge.io/pool"
"""The node group's pool: `shared` or the team owning a dedicated pool."""

TAS_REQUIRED = "kueue.x-k8s.io/podset-required-topology"
TAS_PREFERRED = "kueue.x-k8s.io/podset-preferred-topology"
TAS_SLICE_REQUIRED = "kueue.x-k8s.io/podset-slice-required-topology"
TAS_SLICE_SIZE = "kueue.x-k8s.io/podset-slice-size"
POD_CPU_REQUEST = 16
"""CPU cores a GPU pod requests (the rest of the host is the kubelet's and the daemons'); Kueue quotas use it."""
POD_MEMORY_FRACTION = 0.8

CONFIG_DIR = "/etc/trainforge"
CONFIG_FILE = "worker-config.json"
RUN_DIR = "/var/lib/trainforge/run"

# Scheduling priority per class: PriorityClass (kube-scheduler preemption) and Kueue WorkloadPriorityClass
# (admission order and Kueue preemption) carry the same value. User classes stay far below system ones (2e9).
PRIORITY_VALUES = {Priority.CRITICAL: 100_000, Priority.HIGH: 10_000, Priority.NORMAL: 1_000, Priority.LOW: 100,
                   Priority.PREEMPTIBLE: 10}


@dataclass(frozen=True, slots=True, kw_only=True)
class K8sOptions:
    """How the platform's cluster is set up (defaults match docs/production.md)."""

    namespace: str = "trainforge"
    """Namespace of the job's objects (Kueue's LocalQueues live there)."""
    image: str = "ghcr.io/example-org/trainforge:0.1.0"
    """Worker image: trainforge + torch (CUDA) + the NCCL net plugins of the cluster's fabric."""
    queue: str | None = None
    """Kueue LocalQueue; None = `team-<team>` (one LocalQueue per team, each pointing at its ClusterQueue)."""
    kueue: bool = True
    """Gang admission through Kueue (label + created suspended); False = plain JobSet."""
    topology_aware: bool | None = None
    """Kueue topology-aware scheduling: the pod template asks for the topology the plan needs and Kueue picks the
    nodes (needs the Topology and ResourceFlavors of kueue.py). None = on whenever `kueue` is; off = the pods are
    pinned to the scheduler's placement by node affinity."""
    rdzv_port: int = 29400
    rdma_resource: str = "rdma/rdma_shared_device_a"
    """Device-plugin resource of the InfiniBand HCAs (NVIDIA network operator's shared RDMA device)."""
    efa_devices_per_node: int | None = None
    """`vpc.amazonaws.com/efa` devices per pod; None = one per GPU (p4d has 4, p5 32: set it per fleet)."""
    spot_taint_key: str = "trainforge.io/spot"
    """Taint the spot node pools carry (`NoSchedule`); spot jobs tolerate it."""
    termination_grace_s: int = 120
    """SIGTERM -> SIGKILL window of a pod: the emergency checkpoint budget (AWS spot warns 120 s ahead)."""
    egress_cidrs: tuple[str, ...] = ("0.0.0.0/0",)
    """Where workers may open HTTPS connections (object store, MLflow, Prefect); narrow it per site."""
    egress_ports: tuple[int, ...] = (443,)
    tcpx_daemon_image: str = "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpx/tcpgpudmarxd-dev:v2.0.9"
    env: dict[str, str] = field(default_factory=dict)
    """Platform settings every worker gets (TRAINFORGE_STORAGE_URL, MLFLOW_TRACKING_URI, ...)."""

    @property
    def tas(self) -> bool:
        return self.kueue if self.topology_aware is None else self.topology_aware


@dataclass(frozen=True, slots=True)
class GangNode:
    name: str
    gpus: tuple[int, ...]
    rack: str
    group: NodeGroup
    block: str | None = None


def rack_of(group: NodeGroup, index: int) -> str:
    return group.rack_name(index)


def block_of(group: NodeGroup, index: int) -> str | None:
    per_block = group.nodes_per_block
    return None if per_block is None else f"{group.name}-b{index // per_block}"


def dns_label(text: str, limit: int = 63) -> str:
    """A DNS-1123 label from any id: lower-case alphanumerics and '-', at most `limit` characters (a hash
    suffix keeps truncated names distinct)."""
    label = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-") or "x"
    if len(label) > limit:
        digest = hashlib.sha256(text.encode()).hexdigest()[:6]
        label = label[: limit - 7].rstrip("-") + "-" + digest
    return label


def jobset_name(job_id: str) -> str:
    # Pod hostnames are `<jobset>-node-<job index>-<pod index>` and must stay within 63 characters.
    return dns_label(job_id, 40)


def secret_name(ref_name: str) -> str:
    """The Kubernetes Secret holding a secret of the platform's store (`nlp/hf-token` -> `nlp-hf-token`); the
    value is under the key `value`. Secrets are synced into the namespace by the site (e.g. External Secrets)."""
    return dns_label(ref_name.replace("/", "-").replace("_", "-").replace(".", "-"))


def gang_nodes(cluster: ClusterSpec, nodes: Sequence[tuple[str, Sequence[int]]]) -> list[GangNode]:
    """The placement's nodes (in rank order) with their rack and node group (names as in
    trainforge.infra.scheduler.state.nodes_from_spec: `<group>-<n>`, racks `<group>-r<k>`)."""
    out = []
    for name, gpus in nodes:
        group_name, _, index = name.rpartition("-")
        group = next((g for g in cluster.node_groups if g.name == group_name), None)
        if group is None or not index.isdigit() or int(index) >= group.nodes:
            raise ValueError(f"node {name!r} is not in cluster {cluster.name!r}; placements name nodes "
                             "`<node group>-<index>`")
        out.append(GangNode(name, tuple(gpus), rack_of(group, int(index)), group, block_of(group, int(index))))
    if len({n.group.gpu_type for n in out}) > 1:
        raise ValueError("a gang's nodes must all have one GPU type")
    return out


def _labels(spec: JobSpec, name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "trainforge-job", "app.kubernetes.io/managed-by": "trainforge",
            "trainforge.io/job": name, "trainforge.io/team": spec.team, "trainforge.io/priority": spec.priority.value}


def priority_class_name(priority: Priority) -> str:
    return f"trainforge-{priority.value}"


def render_priority_class(priority: Priority) -> dict[str, Any]:
    return {
        "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
        "metadata": {"name": priority_class_name(priority), "labels": {"app.kubernetes.io/managed-by": "trainforge"}},
        "value": PRIORITY_VALUES[priority], "globalDefault": False,
        # Preemptible jobs never evict anyone; every other class may evict lower ones (checkpoint first).
        "preemptionPolicy": "Never" if priority is Priority.PREEMPTIBLE else "PreemptLowerPriority",
        "description": f"trainforge jobs of priority {priority.value}",
    }


def render_workload_priority_class(priority: Priority) -> dict[str, Any]:
    return {"apiVersion": KUEUE_API, "kind": "WorkloadPriorityClass",
            "metadata": {"name": priority_class_name(priority),
                         "labels": {"app.kubernetes.io/managed-by": "trainforge"}},
            "value": PRIORITY_VALUES[priority], "description": f"trainforge jobs of priority {priority.value}"}


def render_config_map(name: str, spec: JobSpec, options: K8sOptions, worker_config: SegmentConfig) -> dict[str, Any]:
    """The worker's SegmentConfig, rendered as every backend renders it (the pods read it with SegmentConfig.load)."""
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": f"{name}-config", "namespace": options.namespace, "labels": _labels(spec, name)},
            "data": {CONFIG_FILE: worker_config.dump_json()}}


def render_network_policy(name: str, spec: JobSpec, options: K8sOptions) -> dict[str, Any]:
    """Ingress only from the job's own pods; egress to them, to cluster DNS, and to the platform's HTTPS
    endpoints. Another job's pods (another team's included) can neither reach nor be reached by this gang."""
    own = {"podSelector": {"matchLabels": {JOBSET_NAME_LABEL: name}}}
    dns = {"to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                   "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}],
           "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}
    egress = [{"to": [own]}, dns]
    if options.egress_cidrs and options.egress_ports:
        egress.append({"to": [{"ipBlock": {"cidr": c}} for c in options.egress_cidrs],
                       "ports": [{"protocol": "TCP", "port": p} for p in options.egress_ports]})
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": f"{name}-gang", "namespace": options.namespace, "labels": _labels(spec, name)},
            "spec": {"podSelector": {"matchLabels": {JOBSET_NAME_LABEL: name}}, "policyTypes": ["Ingress", "Egress"],
                     "ingress": [{"from": [own]}], "egress": egress}}


def torchrun_args(*, nnodes: int, nproc_per_node: int, master_addr: str, master_port: int, max_restarts: int) -> list[str]:
    """torchrun's elastic agent with the static rendezvous (clean restarts, ENVIRONMENT.md) at pod 0; the node
    rank is the pod's completion index, expanded by the kubelet from the env var."""
    return ["python", "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}",
            "--node-rank=$(JOB_COMPLETION_INDEX)", f"--master-addr={master_addr}", f"--master-port={master_port}",
            f"--max-restarts={max_restarts}", "--monitor-interval=5", "-m", WORKER_MODULE]


def _env_list(env: dict[str, str]) -> list[dict[str, Any]]:
    return [{"name": k, "value": v} for k, v in sorted(env.items())]


def _container_env(spec: JobSpec, nodes: list[GangNode], options: K8sOptions, link: str) -> list[dict[str, Any]]:
    per_node = len(nodes[0].gpus)
    cpu = nodes[0].group.gpu_type.value == "cpu"
    env = worker_environment({}, config_path=f"{CONFIG_DIR}/{CONFIG_FILE}", segment_attempt=0,
                             threads_per_worker=1 if cpu else 8)
    env.update(options.env)
    env.update(spec.env)
    env.update(nccl_environment(NcclConfig(link=link)))
    env.update({
        "TRAINFORGE_BACKEND": "kubernetes", "TRAINFORGE_RUN_DIR": RUN_DIR, "LOCAL_WORLD_SIZE": str(per_node),
        # The spot termination handler drains the node: the kubelet sends SIGTERM to torchrun, which forwards it
        # to the workers; they write the emergency checkpoint within the grace period, then SIGKILL.
        "TRAINFORGE_EMERGENCY_CHECKPOINT_SIGNAL": "SIGTERM",
        "TRAINFORGE_TERMINATION_GRACE_S": str(options.termination_grace_s),
    })
    out = _env_list(env)
    out += [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]
    for ref in spec.secrets:  # by reference: the value never enters the manifest
        out.append({"name": ref.env, "valueFrom": {"secretKeyRef": {"name": secret_name(ref.name), "key": "value"}}})
    return out


def pod_requests(group: NodeGroup, options: K8sOptions, *, per_node: int | None = None,
                 memory_gb: float | None = None) -> tuple[dict[str, int], dict[str, int]]:
    """(requests, limits) of one gang pod on a node of `group`, as integers (memory in GiB): what the pod
    template asks for and, per node, what kueue.py's quotas count."""
    per_node = per_node or group.gpus_per_node
    memory = memory_gb or group.memory_per_node_gb
    if group.gpu_type.value == "cpu":
        req = {"cpu": per_node, "memory": int(memory)}
        return req, dict(req)
    limits = {"nvidia.com/gpu": per_node}
    if group.inter_node_link == "infiniband":
        limits[options.rdma_resource] = 1
    elif group.inter_node_link == "efa":
        limits["vpc.amazonaws.com/efa"] = options.efa_devices_per_node or per_node
    # Most of the host for the gang's pod (the node is the job's whole): room for the kubelet and daemons.
    requests = dict(limits) | {"cpu": POD_CPU_REQUEST, "memory": int(memory * POD_MEMORY_FRACTION)}
    return requests, limits


def quantity(resource: str, amount: int) -> str:
    return f"{amount}Gi" if resource == "memory" else str(amount)


def _resources(spec: JobSpec, nodes: list[GangNode], options: K8sOptions) -> dict[str, Any]:
    requests, limits = pod_requests(nodes[0].group, options, per_node=len(nodes[0].gpus),
                                    memory_gb=spec.resources.memory_per_node_gb)
    return {"requests": {k: quantity(k, v) for k, v in requests.items()},
            "limits": {k: quantity(k, v) for k, v in limits.items()}}


def _affinity(name: str, nodes: list[GangNode], *, pinned: bool) -> dict[str, Any]:
    """The GPU type and the fabric always (Kueue then admits the gang on one ResourceFlavor, never half on
    InfiniBand and half on EFA); the scheduler's nodes and racks only when `pinned` (no topology-aware Kueue:
    with it, Kueue picks the nodes and a pin to the preview's would contradict its assignment)."""
    exprs = [{"key": GPU_TYPE_LABEL, "operator": "In", "values": [nodes[0].group.gpu_type.value]},
             {"key": INTERCONNECT_LABEL, "operator": "In", "values": [nodes[0].group.inter_node_link]}]
    if pinned:
        exprs = [{"key": NODE_LABEL, "operator": "In", "values": [n.name for n in nodes]},
                 {"key": RACK_LABEL, "operator": "In", "values": sorted({n.rack for n in nodes})}] + exprs
    return {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{
            "matchExpressions": exprs}]}},
        # One pod per node: the pod owns the node's GPUs (TP stays on NVLink).
        "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
            "labelSelector": {"matchLabels": {JOBSET_NAME_LABEL: name}}, "topologyKey": NODE_LABEL}]},
    }


def _tolerations(nodes: list[GangNode], options: K8sOptions) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if nodes[0].group.gpu_type.value != "cpu":
        out.append({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"})
    if any(n.group.spot for n in nodes):
        out.append({"key": options.spot_taint_key, "operator": "Equal", "value": "true", "effect": "NoSchedule"})
    return out


def _pod_spec(name: str, spec: JobSpec, nodes: list[GangNode], options: K8sOptions) -> dict[str, Any]:
    link = nodes[0].group.inter_node_link
    master = f"{name}-{REPLICATED_JOB}-0-0.{name}"
    worker = {
        "name": "worker", "image": options.image, "imagePullPolicy": "IfNotPresent",
        "command": torchrun_args(nnodes=len(nodes), nproc_per_node=len(nodes[0].gpus), master_addr=master,
                                 master_port=options.rdzv_port,
                                 max_restarts=spec.fault_tolerance.max_restarts),
        "env": _container_env(spec, nodes, options, link),
        "resources": _resources(spec, nodes, options),
        "ports": [{"name": "rendezvous", "containerPort": options.rdzv_port, "protocol": "TCP"}],
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                         {"name": "dshm", "mountPath": "/dev/shm"},
                         {"name": "run", "mountPath": RUN_DIR}],
    }
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": f"{name}-config"}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},  # NCCL and DataLoader shared memory
        {"name": "run", "emptyDir": {}},
    ]
    containers = [worker]
    if link in ("infiniband", "efa"):
        worker["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}  # RDMA memory registration
    if link == "gpudirect-tcpx":
        worker["volumeMounts"].append({"name": "tcpx-socket", "mountPath": TCPX_SOCKET_DIR})
        worker["volumeMounts"].append({"name": "nvidia-libs", "mountPath": "/usr/local/nvidia/lib64",
                                       "readOnly": True})
        containers.append({
            "name": "tcpx-daemon", "image": options.tcpx_daemon_image, "imagePullPolicy": "IfNotPresent",
            "command": ["/tcpgpudmarxd/build/app/tcpgpudmarxd", "--gpu_nic_preset", "a3vm", "--gpu_shmem_type", "fd",
                        "--uds_path", TCPX_SOCKET_DIR, "--setup_param", "--verbose 128 2 0"],
            "securityContext": {"privileged": True},
            "env": [{"name": "LD_LIBRARY_PATH", "value": "/usr/local/nvidia/lib64"}],
            "volumeMounts": [{"name": "tcpx-socket", "mountPath": TCPX_SOCKET_DIR},
                             {"name": "nvidia-libs", "mountPath": "/usr/local/nvidia/lib64", "readOnly": True}],
        })
        volumes += [{"name": "tcpx-socket", "emptyDir": {}},
                    {"name": "nvidia-libs", "hostPath": {"path": "/home/kubernetes/bin/nvidia/lib64"}}]
    return {
        "restartPolicy": "Never",
        "priorityClassName": priority_class_name(spec.priority),
        "terminationGracePeriodSeconds": options.termination_grace_s,
        "affinity": _affinity(name, nodes, pinned=not options.tas),
        "tolerations": _tolerations(nodes, options),
        "containers": containers,
        "volumes": volumes,
        "enableServiceLinks": False,
    }


def topology_annotations(group: NodeGroup, pods: int, gpus_per_pod: int, layout: Layout | None) -> dict[str, str]:
    """What Kueue's topology-aware scheduling must guarantee for a gang of `pods` pods (one per node):
    - a TP group within a node: one pod owns a whole node, and the planner keeps TP within a node;
    - the whole gang in one rack when it fits one (required), else in one block when the group has blocks and it
      fits one (required), else as few racks/blocks as Kueue can (preferred);
    - a PP stage group (the nodes of one model replica, tp * pp GPUs) within a rack when the gang spans racks:
      slices of that many consecutive pods (Kueue gives consecutive completion indexes, = node ranks, to a slice).
    Data parallelism crosses racks; its all-reduce is the traffic that tolerates the spine best."""
    ann: dict[str, str] = {}
    per_block = group.nodes_per_block
    fits_rack = pods <= group.nodes_per_rack
    if fits_rack:
        ann[TAS_REQUIRED] = RACK_LABEL
    elif per_block is not None and pods <= per_block:
        ann[TAS_REQUIRED] = BLOCK_LABEL
    else:
        ann[TAS_PREFERRED] = BLOCK_LABEL if per_block is not None else RACK_LABEL
    if layout is not None and not fits_rack:
        replica_nodes = -(-(layout.tp * layout.pp) // gpus_per_pod)
        if 1 < replica_nodes < pods and pods % replica_nodes == 0 and replica_nodes <= group.nodes_per_rack:
            ann[TAS_SLICE_REQUIRED] = RACK_LABEL
            ann[TAS_SLICE_SIZE] = str(replica_nodes)
    return ann


def _pod_annotations(nodes: list[GangNode], options: K8sOptions, layout: Layout | None) -> dict[str, str]:
    # The scheduler's preview placement, for people and for the job record (not a pin under Kueue).
    ann = {"trainforge.io/placement": json.dumps([[n.name, list(n.gpus)] for n in nodes], separators=(",", ":"))}
    if options.tas:
        ann |= topology_annotations(nodes[0].group, len(nodes), len(nodes[0].gpus), layout)
    if nodes[0].group.inter_node_link == "gpudirect-tcpx":
        ann["networking.gke.io/default-interface"] = "eth0"
        ann["networking.gke.io/interfaces"] = json.dumps(
            [{"interfaceName": "eth0", "network": "default"}]
            + [{"interfaceName": f"eth{i}", "network": f"vpc{i}"} for i in range(1, 5)])
    return ann


def render_jobset(name: str, job_id: str, spec: JobSpec, nodes: list[GangNode], options: K8sOptions,
                  layout: Layout | None = None) -> dict[str, Any]:
    labels = _labels(spec, name)
    meta_labels = dict(labels)
    if options.kueue:
        meta_labels[QUEUE_LABEL] = options.queue or f"team-{spec.team}"
        meta_labels[KUEUE_PRIORITY_LABEL] = priority_class_name(spec.priority)
    n = len(nodes)
    job_spec = {
        "completionMode": "Indexed", "parallelism": n, "completions": n,
        "backoffLimit": 0,  # a failed pod fails the Job; JobSet's failure policy restarts the whole gang
        "activeDeadlineSeconds": int(spec.max_runtime_s),
        # A pod evicted by preemption, a drain or a spot reclaim is the infrastructure's fault: not a job failure.
        "podFailurePolicy": {"rules": [
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        ]},
        "template": {"metadata": {"labels": dict(labels), "annotations": _pod_annotations(nodes, options, layout)},
                     "spec": _pod_spec(name, spec, nodes, options)},
    }
    js_spec: dict[str, Any] = {
        "network": {"enableDNSHostnames": True, "subdomain": name, "publishNotReadyAddresses": True},
        "failurePolicy": {"maxRestarts": spec.fault_tolerance.max_segment_retries,
                          "restartStrategy": "BlockingRecreate"},
        "successPolicy": {"operator": "All", "targetReplicatedJobs": [REPLICATED_JOB]},
        "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": 1,
                            "template": {"metadata": {"labels": dict(labels)}, "spec": job_spec}}],
    }
    if options.kueue:
        js_spec["suspend"] = True  # Kueue un-suspends the JobSet when the whole gang is admitted
    return {"apiVersion": JOBSET_API, "kind": "JobSet",
            "metadata": {"name": name, "namespace": options.namespace, "labels": meta_labels,
                         "annotations": {"trainforge.io/job-id": job_id}},
            "spec": js_spec}


def render_job(spec: JobSpec, job_id: str, cluster: ClusterSpec, placement: Sequence[tuple[str, Sequence[int]]],
               worker_config: SegmentConfig, options: K8sOptions | None = None) -> list[dict[str, Any]]:
    """Every manifest of one job, in apply order: cluster-scoped classes first, the JobSet last."""
    options = options or K8sOptions()
    nodes = gang_nodes(cluster, placement)
    if len({len(n.gpus) for n in nodes}) > 1:
        raise ValueError(f"the placement uses different GPU counts per node ({sorted({len(n.gpus) for n in nodes})});"
                         " one pod template needs the same count on every node")
    if spec.resources.gpu_type.value != nodes[0].group.gpu_type.value:
        raise ValueError(f"job wants {spec.resources.gpu_type.value} but the placement is on "
                         f"{nodes[0].group.gpu_type.value} nodes")
    name = jobset_name(job_id)
    if worker_config.job_id != job_id:
        raise ValueError(f"the worker config is job {worker_config.job_id}'s, not {job_id}'s")
    config = worker_config.model_copy(update={"run_dir": RUN_DIR})  # the pod's run folder (an emptyDir)
    out = [render_priority_class(spec.priority)]
    if options.kueue:
        out.append(render_workload_priority_class(spec.priority))
    out += [render_config_map(name, spec, options, config), render_network_policy(name, spec, options),
            render_jobset(name, job_id, spec, nodes, options, config.layout)]
    return out
