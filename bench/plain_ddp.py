"""Baseline for bench/spine_overhead.py: a plain torchrun DDP script, no platform. Same model, same batches,
same optimizer as the managed loop; no checkpoints, no events, no tracking.

  torchrun --nproc-per-node 2 bench/plain_ddp.py --dataset DIR --steps 40 --global-batch 16 --micro 4 --seq 128
Prints one JSON line (rank 0): median step time and wall time.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from trainforge.datasets.catalog import load_version_dir
from trainforge.datasets.sampler import SampleOrder
from trainforge.datasets.shards import ShardReader
from trainforge.plan.model import preset
from trainforge.trainer.models.llama import build_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    args = p.parse_args()
    t_start = time.perf_counter()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    shape = preset("tiny")
    torch.manual_seed(1234)
    model = DDP(build_model({"layers": shape.layers, "hidden": shape.hidden, "heads": shape.heads,
                             "kv_heads": shape.kv_heads, "ffn_hidden": shape.ffn_hidden, "vocab": shape.vocab,
                             "max_seq_len": args.seq}))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    ds = load_version_dir(Path(args.dataset), "bench")
    reader = ShardReader(ds.path, ds.manifest)
    order = SampleOrder(ds.manifest.num_samples, 0.02, ds.version, 1234)
    times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        idx = order.rank_slice(step, args.global_batch, rank, world)
        tokens = torch.from_numpy(reader.get(idx))[:, : args.seq + 1]
        chunks = tokens.split(args.micro)
        opt.zero_grad(set_to_none=True)
        for i, c in enumerate(chunks):
            ctx = model.no_sync() if i < len(chunks) - 1 else torch.enable_grad()
            with ctx:
                loss = F.cross_entropy(model(c[:, :-1]).float().flatten(0, 1), c[:, 1:].flatten()) / len(chunks)
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
    del model, opt
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({"median_step_s": statistics.median(times[3:]), "wall_s": time.perf_counter() - t_start,
                          "pid": os.getpid()}))


if __name__ == "__main__":
    main()
