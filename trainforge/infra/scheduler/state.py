"""Runtime cluster state: nodes with free-GPU bitmasks, and the indexes placement reads.

Built from a `ClusterSpec` (or from a raw node list, for traces whose GPU types the spec does not know). Indexes:
per (gpu type, pool) a bucket of healthy nodes per free-GPU count, free GPU totals, and racks per (type, pool).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from trainforge.infra.scheduler.model import SHARED_POOL, TeamPolicy
from trainforge.plan.cluster import ClusterSpec


@dataclass(slots=True, eq=False)
class Node:
    idx: int
    name: str
    gpu_type: str
    rack: int
    pool: str
    spot: bool
    num_gpus: int
    free_mask: int = 0
    healthy: bool = True
    jobs: dict[str, int] = field(default_factory=dict)
    """job id -> mask of the GPUs it holds here."""

    @property
    def free(self) -> int:
        return self.free_mask.bit_count()


@dataclass(slots=True, eq=False)
class Rack:
    idx: int
    name: str
    gpu_type: str
    pool: str
    nodes: list[int]


@dataclass(frozen=True, slots=True)
class NodeInfo:
    name: str
    gpu_type: str
    num_gpus: int
    rack: str
    pool: str = SHARED_POOL
    spot: bool = False


def nodes_from_spec(cluster: ClusterSpec) -> list[NodeInfo]:
    """Node names are `<group>-<n>` (or the hosts' names), racks `<group>-r<k>` filled in order (or the hosts'
    racks), as NodeGroup documents."""
    out = []
    for g in cluster.node_groups:
        for i in range(g.nodes):
            out.append(NodeInfo(g.node_name(i), str(g.gpu_type), g.gpus_per_node, g.rack_name(i), g.pool, g.spot))
    return out


class ClusterState:
    def __init__(self, nodes: Iterable[NodeInfo]):
        self.nodes: list[Node] = []
        self.racks: list[Rack] = []
        self.by_name: dict[str, int] = {}
        rack_ids: dict[str, int] = {}
        for info in nodes:
            if info.name in self.by_name:
                raise ValueError(f"node name {info.name!r} appears twice")
            if info.rack not in rack_ids:
                rack_ids[info.rack] = len(self.racks)
                self.racks.append(Rack(len(self.racks), info.rack, info.gpu_type, info.pool, []))
            rack = self.racks[rack_ids[info.rack]]
            if (rack.gpu_type, rack.pool) != (info.gpu_type, info.pool):
                raise ValueError(f"rack {info.rack!r} mixes GPU types or pools; one rack holds one node group")
            node = Node(len(self.nodes), info.name, info.gpu_type, rack.idx, info.pool, info.spot, info.num_gpus,
                        (1 << info.num_gpus) - 1)
            rack.nodes.append(node.idx)
            self.by_name[info.name] = node.idx
            self.nodes.append(node)
        self.gpu_types: list[str] = sorted({n.gpu_type for n in self.nodes})
        self.pools: list[str] = sorted({n.pool for n in self.nodes})
        self.max_gpus_per_node = {t: max(n.num_gpus for n in self.nodes if n.gpu_type == t) for t in self.gpu_types}
        # (type, pool) -> [set of healthy node idx with k free GPUs for k in 0..max]
        self.buckets: dict[tuple[str, str], list[set[int]]] = {}
        self.free_gpus: dict[tuple[str, str], int] = {}
        self.capacity: dict[str, int] = dict.fromkeys(self.gpu_types, 0)
        """Healthy GPUs per type."""
        self.installed: dict[str, int] = dict.fromkeys(self.gpu_types, 0)
        self.racks_of: dict[tuple[str, str], list[int]] = {}
        for rack in self.racks:
            self.racks_of.setdefault((rack.gpu_type, rack.pool), []).append(rack.idx)
        for node in self.nodes:
            key = (node.gpu_type, node.pool)
            b = self.buckets.setdefault(key, [set() for _ in range(self.max_gpus_per_node[node.gpu_type] + 1)])
            b[node.num_gpus].add(node.idx)
            self.free_gpus[key] = self.free_gpus.get(key, 0) + node.num_gpus
            self.capacity[node.gpu_type] += node.num_gpus
            self.installed[node.gpu_type] += node.num_gpus

    @classmethod
    def from_spec(cls, cluster: ClusterSpec) -> ClusterState:
        return cls(nodes_from_spec(cluster))

    # -- queries -------------------------------------------------------------------------------------------
    def free_in(self, gpu_type: str, pools: Iterable[str]) -> int:
        return sum(self.free_gpus.get((gpu_type, p), 0) for p in pools)

    def nodes_with_free(self, gpu_type: str, pools: Iterable[str], at_least: int) -> int:
        total = 0
        for p in pools:
            b = self.buckets.get((gpu_type, p))
            if b:
                total += sum(len(s) for s in b[at_least:])
        return total

    def total_free(self) -> int:
        return sum(self.free_gpus.values())

    # -- mutations (keep the indexes in step) ----------------------------------------------------------------
    def _set_mask(self, node: Node, mask: int) -> None:
        key = (node.gpu_type, node.pool)
        if node.healthy:
            before = node.free
            self.buckets[key][before].discard(node.idx)
            self.free_gpus[key] += mask.bit_count() - before
            self.buckets[key][mask.bit_count()].add(node.idx)
        node.free_mask = mask

    def allocate(self, job_id: str, assignments: Iterable[tuple[int, tuple[int, ...]]]) -> None:
        for idx, gpus in assignments:
            node = self.nodes[idx]
            mask = 0
            for g in gpus:
                mask |= 1 << g
            assert node.free_mask & mask == mask, f"GPUs {gpus} of {node.name} are not all free (double booking)"
            node.jobs[job_id] = node.jobs.get(job_id, 0) | mask
            self._set_mask(node, node.free_mask & ~mask)

    def release(self, job_id: str, node_indices: Iterable[int]) -> None:
        for idx in node_indices:
            node = self.nodes[idx]
            mask = node.jobs.pop(job_id, 0)
            self._set_mask(node, node.free_mask | mask)

    def set_healthy(self, idx: int, healthy: bool) -> None:
        node = self.nodes[idx]
        if node.healthy == healthy:
            return
        key = (node.gpu_type, node.pool)
        if healthy:
            node.healthy = True
            self.buckets[key][node.free].add(node.idx)
            self.free_gpus[key] += node.free
            self.capacity[node.gpu_type] += node.num_gpus
        else:
            self.buckets[key][node.free].discard(node.idx)
            self.free_gpus[key] -= node.free
            self.capacity[node.gpu_type] -= node.num_gpus
            node.healthy = False


def teams_from_spec(cluster: ClusterSpec) -> dict[str, TeamPolicy]:
    """The policy's view of the teams the cluster description lists (weight, quotas, critical quota)."""
    return {name: TeamPolicy(weight=t.weight, quota=dict(t.quota), critical_quota=t.critical_quota)
            for name, t in cluster.teams.items()}
