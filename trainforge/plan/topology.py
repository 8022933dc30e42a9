"""Where each mesh axis lands: the links a layout's groups use.

Ranks are numbered with tensor parallelism innermost, then pipeline, then data parallelism (Megatron's and
torchtitan's order), so a TP group is `tp` consecutive GPUs of one node, a PP group strides by `tp` (within a rack
when `tp * pp` GPUs fit in one) and a DP group strides by `tp * pp` (across racks). A group whose span fits in one
node uses the intra-node link; otherwise the per-GPU network link (every GPU has its own NIC rail in DGX-class
nodes). A ring collective (DP all-reduce, reduce-scatter, all-gather) whose group has g members in each node runs
g rings at once (NCCL's channels), each crossing nodes on its own rail with 1/g of the data, so it moves g x the
per-GPU NIC rate, up to the intra-node link's (`ring_link`): a TP-8 job's DP ring has one member per node (the NIC
rate), an FSDP-only job's eight (nccl-tests' multi-node bus bandwidth on 8-rail nodes is close to 8 NICs' rate).
Point-to-point (PP) and all-to-all (EP) traffic leaves each GPU through its own NIC: no such gain.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainforge.plan.cluster import ClusterSpec, NodeGroup
from trainforge.plan.hardware import GpuSpec, LinkSpec, gpu_spec, link_spec


@dataclass(frozen=True, slots=True)
class Topology:
    gpus_per_node: int
    nodes_per_rack: int
    intra: LinkSpec
    inter: LinkSpec

    def link_for(self, stride: int, degree: int) -> LinkSpec:
        """The slowest link a group of `degree` ranks spaced `stride` apart crosses."""
        return self.intra if stride * degree <= self.gpus_per_node else self.inter

    def ring_link(self, stride: int, degree: int) -> LinkSpec:
        """The link a ring collective of `degree` ranks spaced `stride` apart runs at (module doc)."""
        link = self.link_for(stride, degree)
        per_node = min(degree, self.gpus_per_node // stride) if stride < self.gpus_per_node else 1
        if link is self.intra or per_node <= 1:
            return link
        rate = min(link.bytes_per_s * per_node, self.intra.bytes_per_s)
        return LinkSpec(f"{link.name} x {per_node} rails", rate, link.latency_s)

    def scope(self, stride: int, degree: int) -> str:
        span = stride * degree
        if degree == 1:
            return "none"
        if span <= self.gpus_per_node:
            return "node"
        return "rack" if span <= self.gpus_per_node * self.nodes_per_rack else "cluster"


def topology_of_group(group: NodeGroup, gpu: GpuSpec | None = None) -> Topology:
    gpu = gpu or gpu_spec(group.gpu_type.value)
    return Topology(group.gpus_per_node, group.nodes_per_rack,
                    link_spec(group.intra_node_link, gpu.generation, group.intra_node_gb_per_s),
                    link_spec(group.inter_node_link, gpu.generation, group.inter_node_gb_per_s))


def topology_for(cluster: ClusterSpec, gpu_type: str, gpus_per_node: int | None = None) -> Topology:
    """The topology of the cluster's largest group of this GPU type; `gpus_per_node` narrows the node size."""
    groups = cluster.groups_of(gpu_type)
    if not groups:
        return default_topology(gpu_type, gpus_per_node or 8)
    group = max(groups, key=lambda g: g.total_gpus)
    topo = topology_of_group(group)
    if gpus_per_node and gpus_per_node < topo.gpus_per_node:
        return Topology(gpus_per_node, topo.nodes_per_rack, topo.intra, topo.inter)
    return topo


def default_topology(gpu_type: str, gpus_per_node: int = 8, nodes_per_rack: int = 32) -> Topology:
    """A DGX-class cluster: NVSwitch inside the node, one InfiniBand NIC per GPU (CPU: loopback)."""
    gpu = gpu_spec(gpu_type)
    if gpu.generation == "cpu":
        loop = link_spec("loopback", "cpu")
        return Topology(gpus_per_node, 1, loop, loop)
    return Topology(gpus_per_node, nodes_per_rack, link_spec("nvswitch", gpu.generation),
                    link_spec("infiniband", gpu.generation))
