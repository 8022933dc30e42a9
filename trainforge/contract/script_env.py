"""Script mode's distributed environment: the variables each framework's own script reads (torch env://,
jax.distributed, TF_CONFIG), derived on each rank from torchrun's (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT).

Part of the contract between the launcher and the worker: the worker (trainer/worker.py) applies it before it runs
the user's script, and `trainforge.runtime.init()` reads what it wrote; the launcher side
(trainforge.infra.launch) re-exports it. Pure and stdlib-only.
"""

from __future__ import annotations

import json


def torch_script_env(*, rank: int, world_size: int, local_rank: int, master_addr: str, master_port: int) -> dict[str, str]:
    """What torch.distributed's env:// init reads (torchrun sets the same names)."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local_rank),
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}


def jax_script_env(*, rank: int, world_size: int, local_rank: int, master_addr: str,
                   master_port: int) -> dict[str, str]:
    """What `jax.distributed.initialize` needs. JAX itself reads JAX_COORDINATOR_ADDRESS and JAX_LOCAL_DEVICE_IDS
    from the environment (jax/_src/distributed.py); the process count and id it takes only as arguments or from a
    cluster it detects (SLURM, Open MPI, ...), none of which this is, so they travel as JAX_NUM_PROCESSES /
    JAX_PROCESS_ID and `trainforge.runtime.init()` passes them (a script may do the same itself). The coordinator
    (process 0) listens on a port of its own, master_port + 1, so it never collides with torch's store.
    JAX_LOCAL_DEVICE_IDS = the local rank: one process per accelerator, as torchrun starts them (on GPU nodes JAX
    would otherwise give every process all of the node's devices; on CPU it is ignored)."""
    return {"JAX_COORDINATOR_ADDRESS": f"{master_addr}:{master_port + 1}", "JAX_NUM_PROCESSES": str(world_size),
            "JAX_PROCESS_ID": str(rank), "JAX_LOCAL_DEVICE_IDS": str(local_rank)}


def tf_script_env(*, rank: int, worker_hosts: list[str]) -> dict[str, str]:
    """TF_CONFIG for tf.distribute.MultiWorkerMirroredStrategy: the cluster's workers and this task's index."""
    return {"TF_CONFIG": json.dumps({"cluster": {"worker": worker_hosts}, "task": {"type": "worker", "index": rank}})}


def script_environment(framework: str, env: dict[str, str]) -> dict[str, str]:
    """The framework's distributed variables for one rank, derived from torchrun's (RANK, WORLD_SIZE, ...).
    TF workers get one port each above master_port + 1 on the master host (single-node jobs; multi-node TF
    needs the node list, which the Kubernetes backend provides)."""
    rank, world = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
    addr, port = env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", "29500"))
    out = torch_script_env(rank=rank, world_size=world, local_rank=int(env.get("LOCAL_RANK", "0")),
                           master_addr=addr, master_port=port)
    if framework == "jax":
        out.update(jax_script_env(rank=rank, world_size=world, local_rank=int(env.get("LOCAL_RANK", "0")),
                                  master_addr=addr, master_port=port))
    elif framework == "tensorflow":
        out.update(tf_script_env(rank=rank, worker_hosts=[f"{addr}:{port + 2 + r}" for r in range(world)]))
    elif framework != "pytorch":
        raise ValueError(f"unknown framework {framework!r}: use pytorch, jax or tensorflow")
    return out
