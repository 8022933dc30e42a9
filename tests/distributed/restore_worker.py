"""torchrun worker for restore tests and bench/restore_bytes.py: an FSDP2 or HSDP model of Linear layers trained and
checkpointed with the trainer's Checkpointer, then restored by fresh gangs from the object store.

Config (json in $RESTORE_CONFIG): out (folder), store (URL: a path or s3://bucket/prefix), layout (fsdp | hsdp),
width, layers, steps, interval, phases (list, run in order, each by a fresh model, optimizer and Checkpointer with
its own staging folder):
- train: steps 0..steps, a checkpoint after every `interval` steps except the last; writes the per-rank digest of
  the weights and optimizer state after the last step (the uninterrupted reference);
- resume: restore (Checkpointer.restore: the newest committed checkpoint that loads) and train to `steps`;
- corrupt: rank 0 flips a byte in a middle chunk of rank 1's shard file in the newest commit, then `resume`;
- restore: the new path only (no training), timed: the bench's phase;
- legacy: main's restore before the ranged reader (rank 0 downloads and verifies every file into its node's
  folder; local rank 0 of every other node downloads them all again; DCP reads from that copy), timed;
  `ranks_per_node` says how many ranks share a node (and a folder).
$RESTORE_ENDPOINT_TEMPLATE (optional, e.g. http://127.0.0.1:{port}) with $RESTORE_ENDPOINT_PORTS (comma-separated,
one per rank) points each rank's S3 client at its own endpoint, so a counting proxy in front of the store can tell
the ranks apart. Results: out/{phase}-{index}-rank{r}.json.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from trainforge.infra.storage import open_store
from trainforge.trainer.distributed import DistContext, shutdown

JOB = "teams/t/jobs/restore"


def build(cfg: dict[str, Any], world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    width = cfg["width"]
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(cfg["layers"])])
    if cfg["layout"] == "hsdp":
        replicas = 2 if world % 2 == 0 else 1
        mesh = init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def train(cfg: dict[str, Any], ctx: DistContext, model: torch.nn.Module, opt: torch.optim.Optimizer,
          ckpt: Any, start: int) -> None:
    for step in range(start, cfg["steps"]):
        g = torch.Generator().manual_seed(step * 1000 + ctx.rank)
        x = torch.randn(8, cfg["width"], generator=g)
        opt.zero_grad()
        # the RNG state is part of the checkpoint: a dropout-like draw makes a wrong restore of it visible
        model(x + 0.01 * torch.randn(8, cfg["width"])).pow(2).mean().backward()
        opt.step()
        if ckpt is not None and (step + 1) % cfg["interval"] == 0 and step + 1 < cfg["steps"]:
            ckpt.save(step + 1, model, opt, {})


def digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """This rank's shards of the weights and optimizer state, and its RNG, bit for bit."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().to_local().contiguous().numpy().tobytes())
    for state in opt.state.values():
        for key in sorted(state):
            v = state[key]
            t = v.to_local() if hasattr(v, "to_local") else v
            h.update(key.encode())
            h.update(t.detach().contiguous().numpy().tobytes())
    h.update(torch.get_rng_state().numpy().tobytes())
    return h.hexdigest()


def corrupt_newest(store: Any) -> dict[str, Any]:
    from trainforge.registry.dedup import chunk_key
    from trainforge.registry.manifest import list_committed

    newest = list_committed(store, JOB)[-1]
    entry = next(f for f in newest.files if f["name"] == "__1_0.distcp")
    sha = entry["chunks"][len(entry["chunks"]) // 2][0]
    key = chunk_key(JOB, sha, entry.get("codec"))
    data = bytearray(store.get_bytes(key))
    data[len(data) // 2] ^= 0x55
    store.put_bytes(key, bytes(data))
    return {"step": newest.step, "chunk": sha}


def legacy_restore(cfg: dict[str, Any], ctx: DistContext, store: Any, staging: Path, model: torch.nn.Module,
                   opt: torch.optim.Optimizer) -> int:
    """What main's Checkpointer did (trainer/checkpoint.py before the ranged reader), node = `ranks_per_node` ranks."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from trainforge.registry.manifest import latest_intact, materialize, ref_dirname
    from trainforge.trainer.checkpoint import restore_rng
    from trainforge.trainer.checkpointing.safe_dcp import SafeFileSystemReader, SafeLoadPlanner

    per_node = cfg.get("ranks_per_node", 1)
    node_folder = staging / f"node-{ctx.rank // per_node}"
    found = latest_intact(store, JOB, folder=node_folder) if ctx.rank == 0 else None
    box = [found]
    dist.broadcast_object_list(box, src=0)
    ref, _ = box[0]
    folder = node_folder / ref_dirname(ref)
    if ctx.rank % per_node == 0 and ctx.rank != 0:
        assert materialize(store, ref, folder) == []
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, storage_reader=SafeFileSystemReader(str(folder)), planner=SafeLoadPlanner())
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    restore_rng(load_file(str(folder / f"rng-rank{ctx.rank:05d}.safetensors")))
    return ref.step


def main() -> None:
    cfg = json.loads(os.environ["RESTORE_CONFIG"])
    out = Path(cfg["out"])
    ctx = DistContext.from_env(120.0)
    if template := os.environ.get("RESTORE_ENDPOINT_TEMPLATE"):
        port = os.environ["RESTORE_ENDPOINT_PORTS"].split(",")[ctx.rank]
        os.environ["TRAINFORGE_S3_ENDPOINT"] = template.format(port=port)
    store = open_store(cfg["store"])
    from trainforge.trainer.checkpoint import Checkpointer

    for index, phase in enumerate(cfg["phases"]):
        model, opt = build(cfg, ctx.world_size)
        staging = out / f"staging-{index}-{phase}" / f"rank{ctx.rank}"
        result: dict[str, Any] = {"phase": phase, "rank": ctx.rank}
        if phase == "corrupt":
            if ctx.rank == 0:
                result["corrupted"] = corrupt_newest(store)
            dist.barrier()
        if phase == "legacy":
            dist.barrier()
            t0 = time.perf_counter()
            result["start"] = legacy_restore(cfg, ctx, store, staging, model, opt)
            dist.barrier()
            result["restore_s"] = time.perf_counter() - t0
        else:
            ckpt = Checkpointer(ctx, store, JOB, staging, lambda *a: None, replicate=False)
            start = 0
            if phase != "train":
                dist.barrier()
                t0 = time.perf_counter()
                ref, skipped = ckpt.restore(lambda r, c=ckpt, m=model, o=opt: c.load(r, m, o))
                dist.barrier()
                result.update(restore_s=time.perf_counter() - t0, skipped=[s for s, _ in skipped],
                              bytes=ckpt.stats.get("restore_bytes"))
                start = ref.step if ref is not None else 0
            result["start"] = start
            if phase != "restore":
                train(cfg, ctx, model, opt, ckpt, start)
            ckpt.close()
        result["digest"] = digest(model, opt)
        (out / f"{phase}-{index}-rank{ctx.rank}.json").write_text(json.dumps(result))
        del model, opt
    shutdown(ctx)


if __name__ == "__main__":
    main()
