"""The baseline the chaos bench compares against: a plain DDP training script for `torchrun --max-restarts=1`
that checkpoints with `torch.save` every `interval` steps (rank 0 writes, after a barrier) and, on (re)start,
loads the newest file. No heartbeats, no supervisor, no replica: torchrun's agent notices the dead worker and
restarts the whole gang. Same tiny model and batch as the chaos job (random tokens).

Env: BASELINE_CONFIG (json: model, steps, interval, batch, seq_len, kill_rank, kill_step, dir, and optional
pg_timeout_s, prefix_store).
Appends `{"event": ..., "time": ...}` lines to dir/events.jsonl: start (with resumed_from), step, killed.
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainforge.trainer.models.llama import build_model


def emit(folder: Path, **fields) -> None:
    with open(folder / "events.jsonl", "a") as f:
        f.write(json.dumps({**fields, "time": time.time()}) + "\n")


def main() -> None:
    cfg = json.loads(os.environ["BASELINE_CONFIG"])
    folder = Path(cfg["dir"])
    # `prefix_store`: the known fix for torchrun restarts (docs/fault-tolerance.md): a store prefixed per restart
    # attempt, so restarted workers never read the dead attempt's addresses. `pg_timeout_s`: the process-group
    # timeout (plain: torch's 30-minute default), which bounds a hang in the rendezvous or a collective.
    timeout = timedelta(seconds=float(cfg.get("pg_timeout_s", 1800)))
    if cfg.get("prefix_store"):
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=timeout)
        dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt_{attempt}", base),
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234)
    model = DDP(build_model(cfg["model"]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    start = 0
    files = sorted(folder.glob("ckpt-*.pt"))
    if files:
        state = torch.load(files[-1], weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        start = int(state["step"])
    emit(folder, event="start", rank=rank, resumed_from=start)
    vocab, per_rank = cfg["model"]["vocab"], cfg["batch"] // world
    marker = folder / "killed"
    for step in range(start, cfg["steps"]):
        if rank == cfg["kill_rank"] and step == cfg["kill_step"] and not marker.exists():
            marker.write_text(str(time.time()))
            emit(folder, event="killed", rank=rank, step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(step * world + rank)
        tokens = torch.randint(0, vocab, (per_rank, cfg["seq_len"] + 1), generator=g)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0:
            emit(folder, event="step", step=step + 1)
        if (step + 1) % cfg["interval"] == 0:
            dist.barrier()
            if rank == 0:
                tmp = folder / f"ckpt-{step + 1:06d}.tmp"
                torch.save({"model": model.module.state_dict(), "optim": optimizer.state_dict(), "step": step + 1},
                           tmp)
                tmp.rename(folder / f"ckpt-{step + 1:06d}.pt")
            dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
