"""Pure builders for the launch of a gang: the torchrun command line and the worker environment."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

# Script mode's per-rank environment is computed on the worker; it lives in the contract, below both sides.
from trainforge.contract.script_env import jax_script_env as jax_script_env
from trainforge.contract.script_env import script_environment as script_environment
from trainforge.contract.script_env import tf_script_env as tf_script_env
from trainforge.contract.script_env import torch_script_env as torch_script_env
from trainforge.infra.storage.credentials import KEY_ENV, SECRET_ENV, TOKEN_ENV, without_platform_credentials

WORKER_MODULE = "trainforge.trainer.worker"


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchSpec:
    nproc_per_node: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int
    max_restarts: int = 0
    log_dir: str
    python: str = sys.executable


def torchrun_command(spec: LaunchSpec) -> list[str]:
    """torchrun with the static rendezvous (the agent's store is recreated per restart attempt: clean restarts),
    per-rank stdout/stderr redirected to files under log_dir, and the worker module as the entry point."""
    return [
        spec.python, "-m", "torch.distributed.run",
        f"--nnodes={spec.nnodes}",
        f"--nproc-per-node={spec.nproc_per_node}",
        f"--node-rank={spec.node_rank}",
        f"--master-addr={spec.master_addr}",
        f"--master-port={spec.master_port}",
        f"--max-restarts={spec.max_restarts}",
        "--monitor-interval=0.5",
        f"--log-dir={spec.log_dir}",
        "--redirects=3",
        "--tee=3",
        "-m", WORKER_MODULE,
    ]


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
