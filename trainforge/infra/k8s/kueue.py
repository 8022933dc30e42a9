"""The cluster-admin side of Kueue, rendered from the cluster description (pure: dicts out; `trainforge
render-cluster` prints them, a cluster admin applies them once and after each change of the description).

- **Topology**: the levels from the widest to the node: `trainforge.io/block` (groups with `racks_per_block`),
  `trainforge.io/rack`, `kubernetes.io/hostname`. One per distinct level list.
- **ResourceFlavor** per (GPU type, interconnect, capacity, pool): node labels select exactly those nodes, so a
  gang (one pod set, one flavor) is never admitted half on InfiniBand and half on EFA, half on spot, or on a
  dedicated pool it does not own. Spot flavors carry the spot taint (only gangs that tolerate it are admitted
  there) and every flavor names its Topology (`topologyName`).
- **Cohort** `trainforge`: every team's ClusterQueue is in it, so unused quota is borrowed across teams. Capacity
  no team's nominal quota claims (hard caps left it over) is the Cohort's own quota, borrowable by all.
- **ClusterQueue** `team-<team>` and its **LocalQueue** (same name, in the jobs' namespace, which is the queue
  the JobSet names with `kueue.x-k8s.io/queue-name`).
- **WorkloadPriorityClass** and PriorityClass per priority (render.py; also rendered per job, idempotently).

Quota policy (the values, and why):
- Nominal quota per flavor: the flavor's nodes shared among the teams by their fair-share `weight`, in whole
  nodes (a pod takes a whole node: a fractional node of quota can never be used), largest remainder first, and
  never above the team's hard `quota` for the GPU type (or `*`). A team's cap on a GPU type is split over that
  type's flavors by their size (Kueue caps per flavor; splitting keeps the sum within the cap, never above it).
- `borrowingLimit` = cap - nominal: borrowing never takes a team past its hard quota; no cap = no limit.
- `lendingLimit`: none on shared flavors (idle GPUs are lent, all of them: reclaiming them is cheap, a preempted
  gang writes its emergency checkpoint on SIGTERM within the grace period); 0 on a dedicated pool (the owner's
  hardware: trainforge's scheduler never gives it to other teams either).
- Preemption: `withinClusterQueue: LowerPriority` (a team's urgent job may evict its own lower jobs);
  `reclaimWithinCohort: Any` (a team always gets its nominal quota back from borrowers, whatever their priority:
  nominal quota is a guarantee); `borrowWithinCohort: Never` (a borrower never evicts another team's work to grow).
  So a gang within its team's nominal quota is admitted within the grace period however busy the cohort is; one
  larger than that quota has no bound on Kueue (docs/scheduler.md, "On Kubernetes"; the simulator's `kueue`
  policy models these rules).
- Fair sharing: each ClusterQueue's `fairSharing.weight` is the team's weight (enable `fairSharing` in Kueue's
  Configuration: borrowed capacity is then divided by weighted share, as the simulator's DRF does).
- `queueingStrategy: BestEffortFIFO`: a big gang waiting for quota does not block smaller jobs behind it.
- Covered resources: every resource a gang pod requests (GPUs, the fabric's devices, CPU, memory): Kueue refuses
  a workload asking for a resource its ClusterQueue does not cover. CPU and memory quotas are per node what one
  gang pod requests (render.pod_requests), so the GPU quota is the binding one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from trainforge.infra.k8s.render import (
    BLOCK_LABEL,
    CAPACITY_LABEL,
    GPU_TYPE_LABEL,
    INTERCONNECT_LABEL,
    KUEUE_API,
    NODE_LABEL,
    POOL_LABEL,
    RACK_LABEL,
    K8sOptions,
    dns_label,
    pod_requests,
    quantity,
    render_priority_class,
    render_workload_priority_class,
)
from trainforge.plan.cluster import ClusterSpec, NodeGroup, TeamSpec
from trainforge.spec import Priority

COHORT = "trainforge"
SHARED_POOL = "shared"
_MANAGED = {"app.kubernetes.io/managed-by": "trainforge"}


PREEMPTION: dict[str, Any] = {"withinClusterQueue": "LowerPriority", "reclaimWithinCohort": "Any",
                              "borrowWithinCohort": {"policy": "Never"}}
"""Every ClusterQueue's `preemption` (the module docstring says why); the simulator's `kueue` policy reads it."""


@dataclass(frozen=True, slots=True)
class Flavor:
    name: str
    gpu_type: str
    link: str
    spot: bool
    pool: str
    groups: tuple[NodeGroup, ...]
    topology: str

    @property
    def nodes(self) -> int:
        return sum(g.nodes for g in self.groups)

    @property
    def gpus(self) -> int:
        return sum(g.total_gpus for g in self.groups)

    @property
    def node_labels(self) -> dict[str, str]:
        return {GPU_TYPE_LABEL: self.gpu_type, INTERCONNECT_LABEL: self.link,
                CAPACITY_LABEL: "spot" if self.spot else "on-demand", POOL_LABEL: self.pool}


def queue_name(team: str) -> str:
    """The ClusterQueue and LocalQueue of a team (render.py's default `queue`)."""
    return f"team-{team}"


def _levels(group: NodeGroup) -> tuple[str, ...]:
    return ((BLOCK_LABEL,) if group.racks_per_block else ()) + (RACK_LABEL, NODE_LABEL)


def topology_name(cluster: ClusterSpec, levels: Sequence[str]) -> str:
    return dns_label(f"{cluster.name}-{'block' if BLOCK_LABEL in levels else 'rack'}")


def flavors(cluster: ClusterSpec) -> list[Flavor]:
    """One flavor per (GPU type, interconnect, spot, pool), in the order Kueue should try them: on-demand before
    spot, so a gang lands on spot capacity only when it tolerates spot and on-demand quota is short."""
    keyed: dict[tuple[str, str, bool, str], list[NodeGroup]] = {}
    for g in cluster.node_groups:
        keyed.setdefault((g.gpu_type.value, g.inter_node_link, g.spot, g.pool), []).append(g)
    out = []
    for (gpu, link, spot, pool), groups in sorted(keyed.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1],
                                                                                   kv[0][3])):
        # Nodes without a block label are invisible to a Topology with a block level: the block level only when
        # every group of the flavor has blocks.
        levels = _levels(groups[0]) if all(g.racks_per_block for g in groups) else (RACK_LABEL, NODE_LABEL)
        name = dns_label("-".join([gpu, link] + (["spot"] if spot else []) + ([pool] if pool != SHARED_POOL else [])))
        out.append(Flavor(name, gpu, link, spot, pool, tuple(groups), topology_name(cluster, levels)))
    return out


def render_topologies(cluster: ClusterSpec) -> list[dict[str, Any]]:
    seen: dict[str, tuple[str, ...]] = {}
    for f in flavors(cluster):
        seen.setdefault(f.topology, (BLOCK_LABEL, RACK_LABEL, NODE_LABEL) if f.topology.endswith("-block")
                        else (RACK_LABEL, NODE_LABEL))
    return [{"apiVersion": KUEUE_API, "kind": "Topology", "metadata": {"name": name, "labels": dict(_MANAGED)},
             "spec": {"levels": [{"nodeLabel": label} for label in levels]}} for name, levels in sorted(seen.items())]


def render_resource_flavor(f: Flavor, options: K8sOptions) -> dict[str, Any]:
    spec: dict[str, Any] = {"nodeLabels": f.node_labels, "topologyName": f.topology}
    if f.spot:
        spec["nodeTaints"] = [{"key": options.spot_taint_key, "value": "true", "effect": "NoSchedule"}]
    return {"apiVersion": KUEUE_API, "kind": "ResourceFlavor", "metadata": {"name": f.name, "labels": dict(_MANAGED)},
            "spec": spec}


def apportion(units: int, weights: dict[str, float], caps: dict[str, int | None]) -> dict[str, int]:
    """`units` whole units shared by weight, none above its cap: capped teams take their cap, the rest is
    re-shared among the others (water filling), then floors plus the largest remainders."""
    share = dict.fromkeys(weights, 0)
    active = set(weights)
    left = units
    while active and left > 0:
        total = sum(weights[t] for t in active)
        ideal = {t: left * weights[t] / total for t in active}
        capped = {t: cap for t in active if (cap := caps[t]) is not None and cap <= ideal[t]}
        if not capped:
            floors = {t: int(ideal[t]) for t in active}
            for t in sorted(active, key=lambda t: (floors[t] - ideal[t], t))[:left - sum(floors.values())]:
                floors[t] += 1
            for t, n in floors.items():
                share[t] += n
            break
        for t, cap in capped.items():
            share[t] = cap
            left -= cap
        active -= set(capped)
    return share


def _team_cap_nodes(team: TeamSpec, f: Flavor, all_flavors: list[Flavor]) -> int | None:
    """The team's hard quota on this flavor, in nodes: its cap for the GPU type (and for `*`), split over the
    flavors it covers by their GPU count."""
    per_node = max(g.gpus_per_node for g in f.groups)
    caps = []
    for key, covered in ((f.gpu_type, [x for x in all_flavors if x.gpu_type == f.gpu_type]), ("*", all_flavors)):
        if key in team.quota:
            caps.append(team.quota[key] * f.gpus / sum(x.gpus for x in covered))
    return None if not caps else min(int(min(caps) // per_node), f.nodes)


def _node_resources(f: Flavor, options: K8sOptions) -> dict[str, int]:
    """Per node of the flavor, what one gang pod requests (the quota unit)."""
    requests, _ = pod_requests(min(f.groups, key=lambda g: g.gpus_per_node), options)
    return requests


def team_specs(cluster: ClusterSpec, extra_teams: Iterable[str] = ()) -> dict[str, TeamSpec]:
    teams = dict(cluster.teams)
    for t in extra_teams:
        teams.setdefault(t, TeamSpec())
    if not teams:
        raise ValueError(f"cluster {cluster.name!r} lists no teams: add `teams:` to the cluster description (one "
                         "ClusterQueue per team) or name them with --team")
    return teams


Quota = tuple[int, int | None, int | None]
"""(nominal nodes, borrowing limit in nodes or None = unlimited, lending limit in nodes or None = all)."""


def quotas(cluster: ClusterSpec, teams: dict[str, TeamSpec]) -> dict[str, dict[str, Quota]]:
    """flavor -> team -> Quota. A dedicated pool's flavor is its owner's alone (nominal = all of it within the
    owner's cap, lends nothing); a dedicated pool whose owner is not a team gets no queue."""
    all_flavors = flavors(cluster)
    out: dict[str, dict[str, Quota]] = {}
    for f in all_flavors:
        caps = {t: _team_cap_nodes(spec, f, all_flavors) for t, spec in teams.items()}
        if f.pool != SHARED_POOL:
            if f.pool in teams:
                cap = caps[f.pool]
                out[f.name] = {f.pool: (f.nodes if cap is None else min(f.nodes, cap), 0, 0)}
            continue
        nominal = apportion(f.nodes, {t: s.weight for t, s in teams.items()}, caps)
        out[f.name] = {t: (nominal[t], None if (cap := caps[t]) is None else cap - nominal[t], None) for t in teams}
    return out


def _covered(all_flavors: list[Flavor], options: K8sOptions) -> list[str]:
    names: set[str] = set()
    for f in all_flavors:
        names |= set(_node_resources(f, options))
    return sorted(names)


def _flavor_quotas(f: Flavor, nodes: int, borrow: int | None, lend: int | None, covered: list[str],
                   options: K8sOptions) -> dict[str, Any]:
    per_node = _node_resources(f, options)
    resources = []
    for r in covered:
        entry: dict[str, Any] = {"name": r, "nominalQuota": quantity(r, nodes * per_node.get(r, 0))}
        if borrow is not None:
            entry["borrowingLimit"] = quantity(r, borrow * per_node.get(r, 0))
        if lend is not None:
            entry["lendingLimit"] = quantity(r, lend * per_node.get(r, 0))
        resources.append(entry)
    return {"name": f.name, "resources": resources}


def _weight(w: float) -> int | str:
    # Kueue's weight is a resource.Quantity (int-or-string): an integer as such, a fraction as a decimal string.
    return int(w) if float(w).is_integer() else f"{w:g}"


def render_cluster_queue(team: str, spec: TeamSpec, cluster: ClusterSpec, table: dict[str, dict[str, Quota]],
                         options: K8sOptions) -> dict[str, Any]:
    all_flavors = flavors(cluster)
    covered = _covered(all_flavors, options)
    entries = [_flavor_quotas(f, *table[f.name][team], covered, options)
               for f in all_flavors if team in table.get(f.name, {})]
    return {"apiVersion": KUEUE_API, "kind": "ClusterQueue",
            "metadata": {"name": queue_name(team), "labels": _MANAGED | {"trainforge.io/team": team}},
            "spec": {
                "cohortName": COHORT,
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": options.namespace}},
                "queueingStrategy": "BestEffortFIFO",
                "fairSharing": {"weight": _weight(spec.weight)},
                "preemption": {k: (dict(v) if isinstance(v, dict) else v) for k, v in PREEMPTION.items()},
                "resourceGroups": [{"coveredResources": covered, "flavors": entries}],
            }}


def render_cohort(cluster: ClusterSpec, table: dict[str, dict[str, Quota]], options: K8sOptions) -> dict[str, Any]:
    """The shared cohort; what no team's nominal quota holds (left over by hard caps) is its own quota."""
    all_flavors = flavors(cluster)
    covered = _covered(all_flavors, options)
    left = [(f, f.nodes - sum(n for n, _, _ in table[f.name].values())) for f in all_flavors
            if f.name in table and f.pool == SHARED_POOL]
    spec: dict[str, Any] = {}
    if any(n > 0 for _, n in left):
        spec["resourceGroups"] = [{"coveredResources": covered,
                                   "flavors": [_flavor_quotas(f, n, None, None, covered, options) for f, n in left]}]
    return {"apiVersion": KUEUE_API, "kind": "Cohort", "metadata": {"name": COHORT, "labels": dict(_MANAGED)},
            "spec": spec}


def render_local_queue(team: str, options: K8sOptions) -> dict[str, Any]:
    return {"apiVersion": KUEUE_API, "kind": "LocalQueue",
            "metadata": {"name": queue_name(team), "namespace": options.namespace,
                         "labels": _MANAGED | {"trainforge.io/team": team}},
            "spec": {"clusterQueue": queue_name(team)}}


def render_cluster_admin(cluster: ClusterSpec, options: K8sOptions | None = None,
                         extra_teams: Iterable[str] = ()) -> list[dict[str, Any]]:
    """Every cluster-admin object, in apply order (what the others refer to first)."""
    options = options or K8sOptions()
    teams = team_specs(cluster, extra_teams)
    table = quotas(cluster, teams)
    out: list[dict[str, Any]] = []
    for p in sorted(Priority, key=lambda p: p.rank):
        out += [render_priority_class(p), render_workload_priority_class(p)]
    out += render_topologies(cluster)
    out += [render_resource_flavor(f, options) for f in flavors(cluster)]
    out.append(render_cohort(cluster, table, options))
    for team in sorted(teams):
        out.append(render_cluster_queue(team, teams[team], cluster, table, options))
    out += [render_local_queue(team, options) for team in sorted(teams)]
    return out
