"""Pure builders for the launch of a gang: each node's launch (`gang_launch`), the torchrun command line and the
worker environment. The backends only run what is built here (infra/backends/local.py on this host,
infra/backends/hosts.py on the cluster description's machines): the split Determined's harness makes between
building the launch command and starting it."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

# Script mode's per-rank environment is computed on the worker; it lives in the contract, below both sides.
from trainforge.contract.script_env import jax_script_env as jax_script_env
from trainforge.contract.script_env import script_environment as script_environment
from trainforge.contract.script_env import tf_script_env as tf_script_env
from trainforge.contract.script_env import torch_script_env as torch_script_env
from trainforge.infra.storage.credentials import KEY_ENV, SECRET_ENV, TOKEN_ENV, without_platform_credentials

WORKER_MODULE = "trainforge.trainer.worker"


Rendezvous = Literal["static", "c10d"]


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchSpec:
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    """The rendezvous's address: the static rendezvous's master, or the c10d store's endpoint (the first node)."""
    master_port: int
    max_restarts: int = 0
    log_dir: str
    python: str = sys.executable
    rendezvous: Rendezvous = "static"
    run_id: str = "none"
    """The c10d rendezvous's id (one per segment attempt, so a late agent of an old attempt never joins)."""
    is_host: bool = False
    """c10d: this agent hosts the rendezvous store (the first node only; set, never guessed from hostnames)."""
    local_addr: str | None = None
    """c10d: the address this node is known by (its peers connect to it; torch orders the nodes by it)."""


def torchrun_command(spec: LaunchSpec) -> list[str]:
    """torchrun with per-rank stdout/stderr redirected to files under log_dir and the worker module as the entry
    point. One node (and the local emulation of several) uses the static rendezvous: the agent's store is
    recreated per restart attempt (clean restarts) and `--node-rank` is exact. A gang across machines meets at a
    c10d rendezvous hosted by its first node (`is_host` there only, so no agent has to guess from hostnames)."""
    if spec.rendezvous == "static":
        meet = [f"--node-rank={spec.node_rank}", f"--master-addr={spec.master_addr}",
                f"--master-port={spec.master_port}"]
    else:
        meet = ["--rdzv-backend=c10d", f"--rdzv-endpoint={spec.master_addr}:{spec.master_port}",
                f"--rdzv-id={spec.run_id}", f"--rdzv-conf=is_host={int(spec.is_host)}"]
        if spec.local_addr:
            meet.append(f"--local-addr={spec.local_addr}")
    return [
        spec.python, "-m", "torch.distributed.run",
        f"--nnodes={spec.nnodes}",
        f"--nproc-per-node={spec.nproc_per_node}",
        *meet,
        f"--max-restarts={spec.max_restarts}",
        "--monitor-interval=0.5",
        f"--log-dir={spec.log_dir}",
        "--redirects=3",
        "--tee=3",
        "-m", WORKER_MODULE,
    ]


def with_rendezvous_port(argv: list[str], port: int) -> list[str]:
    """A c10d torchrun command whose rendezvous port was left 0 (to be picked on the first node), with `port`."""
    return [f"{a[:-2]}:{port}" if a.startswith("--rdzv-endpoint=") and a.endswith(":0") else a for a in argv]


@dataclass(frozen=True, slots=True)
class GangNode:
    """One node of a gang as the scheduler placed it: its name (the scheduler's), the address its peers reach it at,
    its rack and the accelerator indices it was given there."""

    name: str
    address: str = "127.0.0.1"
    rack: str | None = None
    devices: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeLaunch:
    """Everything one node's agent starts with: its torchrun launch and what its processes add to the gang's
    environment (accelerators, the collectives' interface, the node's channel socket)."""

    node: GangNode
    launch: LaunchSpec
    env: dict[str, str] = field(default_factory=dict)

    @property
    def ranks(self) -> range:
        """The global ranks this node runs (torchrun numbers them node by node)."""
        n = self.launch.nproc_per_node
        return range(self.launch.node_rank * n, (self.launch.node_rank + 1) * n)

    def command(self) -> list[str]:
        return torchrun_command(self.launch)


def gang_launch(nodes: Sequence[GangNode], *, nproc_per_node: int, port: int, run_id: str, max_restarts: int,
                log_dir: Callable[[int, GangNode], str], python: str = sys.executable, gpu_type: str = "cpu",
                interface: str | None = None, rendezvous: Rendezvous = "static",
                base: Mapping[str, str] | None = None) -> list[NodeLaunch]:
    """Each node's launch, in node-rank order, every value from the allocation and the launcher's settings.

    One torchrun agent per node running `nproc_per_node` workers. The static rendezvous keeps the nodes in the
    order given (`--node-rank`) at the first node's address. The c10d rendezvous runs on the first node, which alone
    hosts its store (`is_host`); torch numbers its nodes by their addresses in string order, so the nodes are put
    in that order here and the ranks each one runs are known before it starts (a gang whose racks are contiguous
    in address order keeps each rack's nodes consecutive). `base` is the environment the node's accelerators are
    narrowed within (`device_environment`); None leaves the narrowing to the node (`devices` stay in GangNode)."""
    if not nodes:
        raise ValueError("a gang needs at least one node")
    if nproc_per_node < 1:
        raise ValueError(f"nproc_per_node must be >= 1, got {nproc_per_node}")
    names = [n.name for n in nodes]
    if len(set(names)) != len(names):
        raise ValueError(f"a node appears twice in the gang: {names}")
    ordered = list(nodes)
    if rendezvous == "c10d":
        addresses = [n.address for n in nodes]
        if len(set(addresses)) != len(addresses):
            raise ValueError(f"the c10d rendezvous orders nodes by address, but two share one: {addresses} (use "
                             "the static rendezvous for several agents on one host)")
        ordered.sort(key=lambda n: n.address)
    first = ordered[0]
    out = []
    for rank, node in enumerate(ordered):
        env: dict[str, str] = {"TRAINFORGE_NODE": node.name}
        if interface:
            env["GLOO_SOCKET_IFNAME"] = interface
            env["NCCL_SOCKET_IFNAME"] = interface
        if base is not None:
            env.update(device_environment(gpu_type, node.devices, base))
        spec = LaunchSpec(nproc_per_node=nproc_per_node, nnodes=len(ordered), node_rank=rank,
                          master_addr=first.address, master_port=port, max_restarts=max_restarts,
                          log_dir=log_dir(rank, node), python=python, rendezvous=rendezvous, run_id=run_id,
                          is_host=rendezvous == "c10d" and rank == 0,
                          local_addr=node.address if rendezvous == "c10d" else None)
        out.append(NodeLaunch(node=node, launch=spec, env=env))
    return out


def worker_environment(base: dict[str, str], *, config_path: str, segment_attempt: int, threads_per_worker: int,
                       secrets: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(base)
    env.update({
        "TRAINFORGE_JOB_CONFIG": config_path,
        "TRAINFORGE_SEGMENT_ATTEMPT": str(segment_attempt),
        # workers x threads must not exceed the cores, or every step slows down (ENVIRONMENT.md).
        "OMP_NUM_THREADS": str(threads_per_worker),
        "PYTHONUNBUFFERED": "1",
    })
    # Every team's env-store secrets stay with the control plane: the job's own are injected by name below.
    env = {k: v for k, v in env.items() if not k.startswith("TRAINFORGE_SECRET_")}
    env.update(secrets or {})
    job_key, job_secret = env.get(KEY_ENV), env.get(SECRET_ENV)
    if job_key and job_secret:
        # Least privilege: with a per-job identity, the platform's own object-store credentials never reach user
        # code; everything the workers do in S3 goes through the job's own identity (credentials.py).
        token = env.get(TOKEN_ENV)
        env = without_platform_credentials(env)
        env.update({KEY_ENV: job_key, SECRET_ENV: job_secret, "AWS_ACCESS_KEY_ID": job_key,
                    "AWS_SECRET_ACCESS_KEY": job_secret})
        if token:  # STS session credentials
            env.update({TOKEN_ENV: token, "AWS_SESSION_TOKEN": token})
    return env


NODE_ENV_PREFIXES = ("TRAINFORGE_", "AWS_", "NCCL_", "GLOO_", "TORCH_", "TORCHELASTIC_", "HF_", "OMP_", "MKL_",
                     "PYTORCH_")
NODE_ENV_NAMES = frozenset({"PYTHONUNBUFFERED", "PYTHONHASHSEED", "PYTHONFAULTHANDLER", "LD_PRELOAD"})
NODE_ENV_NEVER = frozenset({
    # the flow host's own folders and devices: another machine has its own (its home, caches, accelerators)
    "TRAINFORGE_HOME", "TRAINFORGE_CLUSTER", "CUDA_VISIBLE_DEVICES", "TRAINFORGE_DATA_CACHE",
    "TRAINFORGE_REPLICA_DIR", "TRAINFORGE_DATA_SHARED_CACHE", "TORCH_EXTENSIONS_DIR", "TORCH_HOME", "HF_HOME",
    "HF_HUB_CACHE", "HF_DATASETS_CACHE", "HF_XET_CACHE", "HF_TOKEN_PATH",
    # the flow host's credential files, and the profiles that name entries in them (a node has its own, or none)
    "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_PROFILE",
    "AWS_DEFAULT_PROFILE",
    # the flow's own: the node agent names the config it writes, and the catalogs and issuer are the flow's
    "TRAINFORGE_JOB_CONFIG", "TRAINFORGE_DATASETS_URL", "TRAINFORGE_LINEAGE_URL", "TRAINFORGE_JOB_CREDENTIALS",
    "TRAINFORGE_SCHEDULER_URL", "TRAINFORGE_SECRETS_DIR", "TRAINFORGE_SECRET_STORE", "TRAINFORGE_ARTIFACT_ROOT",
    "TRAINFORGE_ALERT_RULES",
})
"""What never passes to another machine: paths on the flow's host and settings only the flow reads. A node's own
values (its cache or replica folder) are the node's environment, set where its runner logs in."""


def node_environment(worker_env: Mapping[str, str], secrets: Mapping[str, str]) -> dict[str, str]:
    """What a node on another machine gets of the workers' environment, on top of its own: trainforge's and the
    libraries' settings (the prefixes above) and the job's own secrets and identity (`secrets`, by name), never
    the flow host's PATH, home, folders or accelerators."""
    keep = {k: v for k, v in worker_env.items()
            if (k.startswith(NODE_ENV_PREFIXES) or k in NODE_ENV_NAMES) and k not in NODE_ENV_NEVER}
    keep.update({k: worker_env[k] for k in secrets if k in worker_env})
    return keep


def device_environment(gpu_type: str, gpus: Sequence[int] | None, base: Mapping[str, str]) -> dict[str, str]:
    """What makes a node's workers see only the accelerators the scheduler allocated to their job there:
    CUDA_VISIBLE_DEVICES from the allocation's GPU indices on the node (the scheduler never gives one GPU to two
    jobs: its free-GPU bitmasks, infra/scheduler/state.py). The indices are the node's own, 0..gpus_per_node-1;
    where the host already narrows what the platform may use (CUDA_VISIBLE_DEVICES set for it, by an operator
    or a device plugin), index i is the i-th device of that list. Nothing for CPU jobs or a placement without
    indices."""
    if gpu_type == "cpu" or not gpus:
        return {}
    host = base.get("CUDA_VISIBLE_DEVICES")
    if host is not None:
        visible = [d.strip() for d in host.split(",") if d.strip()]
        if max(gpus) >= len(visible):
            raise ValueError(f"the scheduler allocated GPU {max(gpus)} of this node but the platform's "
                             f"CUDA_VISIBLE_DEVICES={host!r} lists {len(visible)}: describe the node with "
                             f"{len(visible)} GPUs in the cluster description, or widen CUDA_VISIBLE_DEVICES")
        return {"CUDA_VISIBLE_DEVICES": ",".join(visible[g] for g in gpus)}
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus)}


# Debian/Ubuntu (libjemalloc2) and RPM locations of jemalloc's shared library.
JEMALLOC_PATHS = ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
                  "/usr/lib64/libjemalloc.so.2", "/usr/lib/libjemalloc.so.2")
ALLOCATOR_VAR = "TRAINFORGE_ALLOCATOR"


def allocator_environment(base: dict[str, str], exists: Callable[[str], bool] = os.path.exists) -> dict[str, str]:
    """Host-memory allocator for locally launched workers: TRAINFORGE_ALLOCATOR=jemalloc preloads jemalloc (Debian
    libjemalloc2); `system` (the default) leaves glibc's malloc. A user's own LD_PRELOAD is never replaced.

    Why offer it: glibc's malloc raises its mmap threshold as large blocks are freed (up to 32 MiB), after which
    every tensor below that comes from the heap and freed chunks stay resident: a 2-rank FSDP2 run held 1.1 GiB
    freed, growing with steps, so host RSS was 1.5x live memory; under jemalloc RSS tracks live memory
    (bench/memory_vs_rss.py). Not the default yet: its step-time cost on CPU was not settled by our A/B runs."""
    choice = base.get(ALLOCATOR_VAR, "system")
    if choice not in ("jemalloc", "system"):
        raise ValueError(f"{ALLOCATOR_VAR}={choice!r}: use system (glibc's malloc, the default) or jemalloc")
    if choice == "system" or base.get("LD_PRELOAD"):
        return {}
    lib = next((path for path in JEMALLOC_PATHS if exists(path)), None)
    if lib is None:
        raise ValueError(f"{ALLOCATOR_VAR}=jemalloc but no jemalloc library is installed (looked in "
                         f"{', '.join(JEMALLOC_PATHS)}): install it (Debian: apt-get install libjemalloc2, or "
                         "scripts/setup-debian.sh) or unset it")
    return {"LD_PRELOAD": lib}
