"""Cluster description: racks -> nodes -> GPUs, grouped into node groups of one GPU type.

Loaded from YAML (`examples/clusters/*.yaml`). Pure data; the scheduler and the planner both read it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from trainforge.spec import GpuType, Problem, SpecError, _problems_from_validation, read_document

HOST_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
"""A host's name in the cluster description: it names the node in the scheduler, in runner templates and in
sandboxes, so it is kept to what a hostname, a shell word and a file name all allow."""

Link = Literal["nvlink", "nvswitch", "pcie", "infiniband", "efa", "gpudirect-tcpx", "ethernet", "loopback"]


class HostSpec(BaseModel):
    """One machine of a node group, for the `hosts` launcher: the launcher starts the node's agent on it through
    the runner template and its peers reach it at `address`."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    name: str = Field(pattern=HOST_NAME)
    """The host's name: the node's name in the scheduler and `{host}` in the runner template (`ssh {host} ...`)."""
    address: str = Field(min_length=1)
    """The address the other hosts and the control plane reach it at (rendezvous, collectives, `--local-addr`)."""
    rack: str | None = None
    """Its rack (gangs are placed rack-aware); None: the group's racks filled in order (`nodes_per_rack`)."""

    @field_validator("name")
    @classmethod
    def _not_a_segment_folder(cls, name: str) -> str:
        # a job's folder on a host holds `<node>/` and `segment-<n>/` side by side (infra/backends/node_folders.py)
        if re.fullmatch(r"segment-\d+", name):
            raise ValueError(f"host name {name!r} is also the name of a job's segment folder on the hosts: rename "
                             "the host (for example gpu-" + name.removeprefix("segment-") + ")")
        return name


class NodeGroup(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    name: str
    """Name of this group of identical nodes (e.g. `h100-onprem`)."""
    gpu_type: GpuType
    """GPU type of every node in the group."""
    nodes: int = Field(ge=1)
    """Number of nodes."""
    gpus_per_node: int = Field(ge=1, le=16)
    """GPUs (or CPU worker slots) per node."""
    nodes_per_rack: int = Field(default=32, ge=1)
    """Nodes per rack; racks are filled in order."""
    racks_per_block: int | None = Field(default=None, ge=1)
    """Racks per network block (the racks under one spine / leaf group, one level above the rack); blocks are
    filled in order. None = the group has no block level. On Kubernetes the nodes carry `trainforge.io/block`
    and Kueue's Topology gets a block level (docs/production.md, "Kueue")."""
    memory_per_node_gb: float = Field(default=2048, gt=0)
    """Host memory per node in GiB."""
    intra_node_link: Link = "nvswitch"
    """Link between GPUs of one node."""
    inter_node_link: Link = "infiniband"
    """Link between nodes (within and across racks)."""
    intra_node_gb_per_s: float | None = Field(default=None, gt=0)
    """Measured GPU-to-GPU bandwidth within a node, GB/s per GPU per direction; None = the catalog value for the
    link and GPU generation (trainforge/plan/hardware.py)."""
    inter_node_gb_per_s: float | None = Field(default=None, gt=0)
    """Measured network bandwidth between nodes, GB/s per GPU per direction; None = the catalog value."""
    spot: bool = False
    """Spot / preemptible cloud capacity."""
    pool: str = "shared"
    """`shared`, or the name of the team that owns this dedicated pool."""
    hosts: list[HostSpec] = Field(default_factory=list)
    """The machines of the group, one per node in order (the `hosts` launcher needs them; `nodes` must equal their
    number). Empty: nodes are named `<group>-<n>` and launched by the local or Kubernetes backend."""

    @model_validator(mode="after")
    def _hosts_match_nodes(self) -> NodeGroup:
        if self.hosts and len(self.hosts) != self.nodes:
            raise ValueError(f"node group {self.name!r} lists {len(self.hosts)} hosts for nodes: {self.nodes}: "
                             "give one host per node (or leave `hosts` out)")
        return self

    def node_name(self, index: int) -> str:
        """The scheduler's name of the group's node `index`: its host's name, else `<group>-<index>`."""
        return self.hosts[index].name if self.hosts else f"{self.name}-{index}"

    def rack_name(self, index: int) -> str:
        """The rack of node `index`: its host's `rack`, else `<group>-r<k>` with racks filled in order."""
        if self.hosts and self.hosts[index].rack:
            return str(self.hosts[index].rack)
        return f"{self.name}-r{index // self.nodes_per_rack}"

    @property
    def racks(self) -> int:
        if self.hosts:
            return len({self.rack_name(i) for i in range(self.nodes)})
        return -(-self.nodes // self.nodes_per_rack)

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def nodes_per_block(self) -> int | None:
        return None if self.racks_per_block is None else self.racks_per_block * self.nodes_per_rack


class TeamSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    weight: float = Field(default=1.0, gt=0)
    """Fair-share weight of the team in the shared pool (DRF over GPUs of each type)."""
    quota: dict[str, int] = Field(default_factory=dict)
    """Hard cap on GPUs the team may hold, per GPU type (`*` = all types together)."""
    critical_quota: int | None = Field(default=None, ge=0)
    """GPUs (all types together) the team's `critical` jobs may ask for at once: `critical` is the one priority
    that crosses teams, so it is capped; a `critical` job beyond the cap is scheduled as `high`. None = 10% of the
    cluster's GPUs, rounded down (the scheduler's `critical_share`)."""


class LauncherSpec(BaseModel):
    """How a gang's nodes are started (trainforge/infra/launch.py builds each node's launch; a backend runs it)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    backend: Literal["local", "hosts"] = "local"
    """`local`: every node's agent on the flow's own host (one node: the plain local job). `hosts`: each node's
    agent on its machine from the node groups' `hosts`, started through `runner`."""
    runner: str = "ssh {host} {command}"
    """How a command is run on a host: `{host}` is the host's name, `{command}` the command as one shell-quoted
    string for a shell (`ssh`, `sh -c`; DeepSpeed's and torchx's multi-node launchers start remote agents over ssh
    the same way), or `{argv}` the command as separate words for a program that takes one (`sudo -u svc {argv}`,
    `docker exec -i box {argv}`)."""
    python: str | None = None
    """The Python interpreter with trainforge installed on every host; None: this interpreter's path (the same
    virtual environment at the same path on every host)."""
    interface: str | None = None
    """The network interface the collectives use on every host (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME); None:
    the libraries' own choice, which is wrong on hosts whose hostname resolves to a loopback address."""
    rendezvous_port: int | None = Field(default=None, ge=1024, le=65535)
    """The TCP port of the c10d rendezvous on a gang's first node (its agent hosts the store); None: a free port
    the first node picks at each start (two gangs whose first node is one host never collide). Set one where a
    firewall opens only that port, and then run one gang's first node per host."""
    work_dir: str = "/tmp/trainforge-node"
    """The node-local folder for a segment's logs, staging and config on each host."""
    shared_filesystem: bool = False
    """Every host mounts the flow's folders at the same paths (one NFS home): a `file://` object store is then one
    store for all of them. Without it a `hosts` job needs a store every host reaches (s3://)."""
    start_timeout_s: float = Field(default=60.0, gt=0)
    """How long a node's agent may take to start before the launch is given up (every agent stopped, the
    allocation released, the error naming the host)."""
    inputs_timeout_s: float = Field(default=3600.0, gt=0)
    """How long a node may take to fetch the job's inputs from the store (its code, a dataset on the flow's disk,
    the initial weights), counted from when its agent reports it is fetching. The fetch comes before any node starts
    torchrun, so it is bounded by this, never by the rendezvous's or the process group's timeouts."""
    keep_node_folders_h: float = Field(default=0.0, ge=0)
    """How long a job's folders stay on each host after the job ends (its inputs fetched from the store, staging,
    the segments' configs and logs), for inspection; 0: removed when the job ends (the logs are in the store and the
    job's record). A host that did not see the end (unreachable then, the flow killed) keeps them until a later
    agent there finds them unused for this long, and never less than 6 hours (a job between segments would
    otherwise fetch its inputs again: infra/backends/node_folders.py `SWEEP_FLOOR_H`)."""

    @model_validator(mode="after")
    def _runner_fields(self) -> LauncherSpec:
        if "{host}" not in self.runner or ("{command}" in self.runner) == ("{argv}" in self.runner):
            raise ValueError(f"launcher.runner {self.runner!r} needs {{host}} and one of {{command}} (a shell "
                             "string) or {argv} (separate words): write e.g. 'ssh {host} {command}'")
        return self


class ClusterSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    name: str
    """Cluster name."""
    node_groups: list[NodeGroup] = Field(min_length=1)
    """Groups of identical nodes."""
    node_mtbf_hours: float = Field(default=50_000, gt=0)
    """Mean time between failures of one node, in hours (for checkpoint intervals and the simulator)."""
    teams: dict[str, TeamSpec] = Field(default_factory=dict)
    """Fair-share weights and quotas per team; teams not listed get weight 1 and no quota."""
    launcher: LauncherSpec = LauncherSpec()
    """How gangs are started on the nodes (`local` by default; `hosts`: on the machines the groups list)."""

    @model_validator(mode="after")
    def _unique_names(self) -> ClusterSpec:
        names = [g.name for g in self.node_groups]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"node group names must be unique; repeated: {', '.join(dupes)}")
        hosts = [h.name for g in self.node_groups for h in g.hosts]
        dupes = sorted({n for n in hosts if hosts.count(n) > 1})
        if dupes:
            raise ValueError(f"host names must be unique across node groups; repeated: {', '.join(dupes)}")
        if self.launcher.backend == "hosts":
            missing = [g.name for g in self.node_groups if not g.hosts]
            if missing:
                raise ValueError(f"launcher.backend 'hosts' starts agents on the listed machines, but node group(s) "
                                 f"{', '.join(missing)} list no `hosts`: add them (name, address, rack)")
        return self

    def host(self, name: str) -> HostSpec | None:
        """The machine a node of the scheduler's is, when the groups list hosts."""
        return next((h for g in self.node_groups for h in g.hosts if h.name == name), None)

    def groups_of(self, gpu_type: str) -> list[NodeGroup]:
        return [g for g in self.node_groups if g.gpu_type == gpu_type]

    def gpu_types(self) -> list[str]:
        return sorted({g.gpu_type.value for g in self.node_groups})

    def total_gpus(self, gpu_type: str | None = None) -> int:
        groups: Iterable[NodeGroup] = self.node_groups if gpu_type is None else self.groups_of(gpu_type)
        return sum(g.total_gpus for g in groups)

    def max_gpus_per_node(self, gpu_type: str) -> int:
        return max((g.gpus_per_node for g in self.groups_of(gpu_type)), default=0)


def local_cluster() -> ClusterSpec:
    """This machine as a cluster: one node of CPU worker slots (gloo). Slots = max(2, cores), capped at 4
    because more oversubscribes a small machine (see ENVIRONMENT: 4 workers on 2 cores is ~2x slower/step)."""
    slots = min(4, max(2, os.cpu_count() or 2))
    return ClusterSpec(
        name="this-machine",
        node_groups=[
            NodeGroup(name="local", gpu_type=GpuType.CPU, nodes=1, gpus_per_node=slots, nodes_per_rack=1,
                      memory_per_node_gb=16, intra_node_link="loopback", inter_node_link="loopback")
        ],
        node_mtbf_hours=10_000,
    )


def load_cluster(path: str | Path) -> ClusterSpec:
    """Read a cluster description; raises SpecError naming the file and field on any problem."""
    doc = read_document(path)
    if not isinstance(doc, dict):
        raise SpecError([Problem("<root>", "a cluster description must be a mapping", None,
                                 "see examples/clusters/fleet-10k.yaml")], str(path))
    try:
        return ClusterSpec.model_validate(doc)
    except ValidationError as exc:
        raise SpecError(_problems_from_validation(exc), str(path)) from None


def default_cluster() -> ClusterSpec:
    """The configured cluster ($TRAINFORGE_CLUSTER), else this machine."""
    configured = os.environ.get("TRAINFORGE_CLUSTER")
    return load_cluster(configured) if configured else local_cluster()


def dump_cluster(cluster: ClusterSpec) -> str:
    return yaml.safe_dump(cluster.model_dump(mode="json"), sort_keys=False)
