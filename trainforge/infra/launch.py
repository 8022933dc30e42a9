"""Pure builders for the launch of a gang: the torchrun command line and the worker environment."""

from __future__ import annotations

import sys
from dataclasses import dataclass

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
    env.update(secrets or {})
    return env
