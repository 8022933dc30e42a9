"""Checkpoint cost on ~200 MB of state (single process, this CPU): loop time blocked per checkpoint with the async
Checkpointer vs a synchronous torch.save and a synchronous DCP save of the same state; overhead as % of training
time at the chosen interval; bytes written by an incremental checkpoint of a half-frozen model vs a full one;
restore time from in-memory replica vs local disk vs object store (local folder, and S3 when `weed` exists).

  OMP_NUM_THREADS=1 .venv/bin/python bench/checkpoint_overhead.py [--interval 50] [--saves 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from trainforge.infra.storage import LocalObjectStore
from trainforge.trainer.checkpoint import Checkpointer
from trainforge.trainer.distributed import DistContext

JOB = "teams/bench/jobs/ckpt"


def build(frozen_half: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    # 8 x 2048x2048 linear layers = 33.6M params: 134 MB weights + 268 MB AdamW state when all train.
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)])
    if frozen_half:
        for layer in list(model)[:4]:
            layer.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return model, opt


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    model(x).float().pow(2).mean().backward()
    opt.step()


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    n = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for s in opt.state.values():
        n += sum(t.numel() * t.element_size() for t in s.values() if torch.is_tensor(t))
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--interval", type=int, default=50, help="steps between checkpoints for the overhead figure")
    ap.add_argument("--saves", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    root = Path(tempfile.mkdtemp(prefix="tf-ckpt-bench-"))
    ctx = DistContext(0, 1, 0, torch.device("cpu"), "gloo")
    x = torch.randn(16, 2048)
    try:
        model, opt = build()
        for _ in range(2):
            train_step(model, opt, x)
        size = state_bytes(model, opt)
        t0 = time.perf_counter()
        for _ in range(3):
            train_step(model, opt, x)
        step_s = (time.perf_counter() - t0) / 3

        # Synchronous baselines: torch.save of the same state, and a synchronous DCP save through the Checkpointer.
        sync_torch = []
        for i in range(args.saves):
            t0 = time.perf_counter()
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, root / f"torch-{i}.pt")
            sync_torch.append(time.perf_counter() - t0)
            (root / f"torch-{i}.pt").unlink()

        def run(async_save: bool, tag: str) -> tuple[list[float], float]:
            store = LocalObjectStore(root / f"store-{tag}").scoped(JOB)
            ck = Checkpointer(ctx, store, JOB, root / f"staging-{tag}", lambda *a: None, async_save=async_save,
                              replicate=True)
            os.environ["TRAINFORGE_REPLICA_DIR"] = str(root / f"shm-{tag}")
            blocked = []
            t_loop = time.perf_counter()
            for i in range(args.saves):
                train_step(model, opt, x)
                blocked.append(ck.save(i + 1, model, opt, {}))
                # the next steps run while the save is written, replicated and uploaded
                for _ in range(3):
                    train_step(model, opt, x)
            blocked[-1] += ck._unreported_wait  # the optimizer hook's staging wait after the last save
            wall = time.perf_counter() - t_loop
            ck.close()
            return blocked, wall

        sync_blocked, _ = run(False, "sync")
        async_blocked, _ = run(True, "async")
        b_async, b_sync, b_torch = (statistics.median(v) for v in (async_blocked, sync_blocked, sync_torch))
        print(f"state: {size / 1e6:.0f} MB, step time {step_s:.3f} s (fp32, {torch.get_num_threads()} thread)")
        print(f"blocked per checkpoint: async {b_async * 1e3:.1f} ms | sync DCP {b_sync * 1e3:.0f} ms | "
              f"sync torch.save {b_torch * 1e3:.0f} ms")
        print(f"ratio async / sync torch.save = {b_async / b_torch:.3f} (target <= 0.10); "
              f"async / sync DCP = {b_async / b_sync:.3f}")
        print(f"overhead at interval {args.interval}: async {100 * b_async / (args.interval * step_s):.2f}% of step "
              f"time (target <= 2%), sync torch.save {100 * b_torch / (args.interval * step_s):.2f}%")

        # Incremental dedup: half-frozen model, two checkpoints a few steps apart.
        fmodel, fopt = build(frozen_half=True)
        store = LocalObjectStore(root / "store-dedup").scoped(JOB)
        commits = []
        ck = Checkpointer(ctx, store, JOB, root / "staging-dedup", lambda s, p, m: commits.append(m["dedup"]),
                          replicate=False)
        for i in range(2):
            for _ in range(2):
                train_step(fmodel, fopt, x)
            ck.save(i + 1, fmodel, fopt, {})
            ck.wait()
        ck.close()
        full, incr = commits
        print(f"dedup (half-frozen): full {full['bytes_written'] / 1e6:.0f} MB written; incremental "
              f"{incr['bytes_written'] / 1e6:.0f} MB of {incr['bytes_logical'] / 1e6:.0f} MB "
              f"({100 * (1 - incr['bytes_written'] / incr['bytes_logical']):.0f}% saved, "
              f"{incr['chunks_reused']} chunks reused)")

        # Restore: memory replica vs local staging disk vs object store (local folder) [vs S3].
        restore(ctx, root, model, opt, x)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def restore(ctx: DistContext, root: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    os.environ["TRAINFORGE_REPLICA_DIR"] = str(root / "shm-restore")
    stores = {"local-folder": LocalObjectStore(root / "store-restore").scoped(JOB)}
    server = None
    from trainforge.infra.storage.seaweedfs import SeaweedFSServer, find_weed

    if find_weed():
        server = SeaweedFSServer(root / "weed", weed=find_weed())
        server.start()
        stores["s3"] = server.store(server.make_bucket()).scoped(JOB)
    try:
        for name, store in stores.items():
            ck = Checkpointer(ctx, store, JOB, root / f"staging-r-{name}", lambda *a: None)
            ck.save(1, model, opt, {})
            ck.wait()
            # memory: what a restarted process finds in /dev/shm
            os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"
            ck2 = Checkpointer(ctx, store, JOB, root / f"staging-r2-{name}", lambda *a: None)
            t0 = time.perf_counter()
            ref, _ = ck2.latest()
            ck2.load(ref, model, opt)
            t_mem = time.perf_counter() - t0
            os.environ["TORCHELASTIC_RESTART_COUNT"] = "0"
            # local disk: the staging copy kept on this node
            ck3 = Checkpointer(ctx, store, JOB, root / f"staging-r-{name}", lambda *a: None, replicate=False)
            t0 = time.perf_counter()
            ref, _ = ck3.latest()
            ck3.load(ref, model, opt)
            t_disk = time.perf_counter() - t0
            # object store: an empty staging folder, everything read and verified from the store
            ck4 = Checkpointer(ctx, store, JOB, root / f"staging-r4-{name}", lambda *a: None, replicate=False)
            t0 = time.perf_counter()
            ref2, _ = ck4.latest()
            ck4.load(ref2, model, opt)
            t_store = time.perf_counter() - t0
            for c in (ck, ck2, ck3, ck4):
                c.close()
            print(f"restore [{name}]: peer/host memory {t_mem:.2f} s | node-local disk {t_disk:.2f} s | "
                  f"object store {t_store:.2f} s")
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
