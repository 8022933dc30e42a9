"""torchrun worker for tests/integration/test_checkpoint_replica.py: a tiny DDP model trained for 8 steps with a
checkpoint every 2, optionally SIGKILLed on one rank once; prints where the restart restored from."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch

from trainforge.infra.storage import LocalObjectStore
from trainforge.trainer.checkpoint import Checkpointer
from trainforge.trainer.distributed import DistContext, shutdown


def _init_per_attempt(restart: int) -> None:
    """The agent's store outlives a restart attempt; keys prefixed per attempt keep restarted workers from reading
    the dead attempt's addresses (ENVIRONMENT.md, elastic restarts)."""
    from datetime import timedelta

    import torch.distributed as dist

    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt_{restart}", base),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timedelta(seconds=60))


def main() -> None:
    out = Path(sys.argv[1])
    kill_at = int(os.environ.get("KILL_AT_STEP", "0"))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    _init_per_attempt(restart)
    ctx = DistContext.from_env(60.0)
    job = "teams/t/jobs/replica"
    store = LocalObjectStore(out / "store").scoped(job)
    if restart and os.environ.get("DROP_OWN_SHARD") and ctx.rank == 1:
        import shutil

        from trainforge.trainer.checkpointing.replica import replica_root
        for d in replica_root(job).glob("attempt-*/holder-00001"):
            shutil.rmtree(d)  # rank 1's node lost its memory: the shard must come from the peer
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                                                          torch.nn.Linear(64, 8)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ckpt = Checkpointer(ctx, store, job, out / "staging", lambda *a: None)
    ref, _ = ckpt.latest()
    start = 0
    if ref is not None:
        ckpt.load(ref, model, opt)
        start = ref.step
    for step in range(start, 8):
        if kill_at and step == kill_at and restart == 0 and ctx.rank == 1:
            ckpt.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(step * 10 + ctx.rank)
        x = torch.randn(16, 64, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        if (step + 1) % 2 == 0:
            ckpt.save(step + 1, model, opt, {})
    ckpt.close()
    digest = float(sum(p.detach().double().sum() for p in model.parameters()))
    (out / f"result-{ctx.rank}.json").write_text(json.dumps({
        "restart": restart, "start": start, "restored_from": ckpt.stats["restored_from"],
        "restore_s": ckpt.stats.get("restore_s"), "digest": digest}))
    del model, opt
    shutdown(ctx)


if __name__ == "__main__":
    main()
