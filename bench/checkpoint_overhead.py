"""Checkpoint cost on ~200 MB of state (single process, this CPU): loop time blocked per checkpoint with the async
Checkpointer vs a synchronous torch.save and a synchronous DCP save of the same state; overhead as % of training
time at the chosen interval; bytes written by an incremental checkpoint of a half-frozen model vs a full one;
restore time from in-memory replica vs local disk vs object store (local folder, and S3 when `weed` exists).

Blocked time per save is what the loop actually waits: the `save()` call (including any wait for the previous
save's write) plus the wait for the host copy before the next optimizer step (`Checkpointer.take_staged`, the
number the trainer reports as `checkpoint_staged.blocked_s`). The first save allocates the host staging buffers
(page faults on every byte), later ones reuse them: the first is printed apart, the ratio uses the median of the
later ones. The host-copy line measures that reuse directly: fresh buffers vs reused ones, same state.

  OMP_NUM_THREADS=1 .venv/bin/python bench/checkpoint_overhead.py [--interval 50] [--saves 5] [--gap 4]
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
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--gap", type=int, default=4, help="training steps between two saves of the blocked-time runs")
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

        # Host copy of the state: into fresh buffers (what a stager without a cache does on every save) vs into
        # buffers allocated once and reused (what the Checkpointer's stager does after its first save).
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        sd = {"model": model.state_dict(), "optim": opt.state_dict()}
        fresh, reused = [], []
        host = _create_cpu_state_dict(sd)
        for _ in range(args.saves):
            t0 = time.perf_counter()
            _copy_state_dict(sd, _create_cpu_state_dict(sd))
            fresh.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            _copy_state_dict(sd, host)
            reused.append(time.perf_counter() - t0)
        del host, sd

        def run(async_save: bool, tag: str) -> tuple[list[float], list[float], list[float]]:
            """Per save: total blocked, of which waiting for the host copy before the next optimizer step; and the
            time of the training steps that ran while saves were in the background."""
            store = LocalObjectStore(root / f"store-{tag}").scoped(JOB)
            os.environ["TRAINFORGE_REPLICA_DIR"] = str(root / f"shm-{tag}")
            ck = Checkpointer(ctx, store, JOB, root / f"staging-{tag}", lambda *a: None, async_save=async_save,
                              replicate=True)
            staged: list[tuple[int, float]] = []
            steps = []
            for i in range(args.saves):
                train_step(model, opt, x)
                ck.save(i + 1, model, opt, {})
                staged += ck.take_staged()
                for _ in range(args.gap):  # written, replicated and uploaded while these run
                    t0 = time.perf_counter()
                    train_step(model, opt, x)  # its optimizer step waits for the host copy
                    steps.append(time.perf_counter() - t0)
                    staged += ck.take_staged()
            ck.close()
            staged += ck.take_staged()
            waits = {r["step"]: r["staging_wait_s"] for r in ck.stats["saves"]}
            return [b for _, b in sorted(staged)], [waits[s] for s, _ in sorted(staged)], steps

        sync_blocked, _, _ = run(False, "sync")
        async_blocked, async_waits, bg_steps = run(True, "async")
        b_async, b_sync = (statistics.median(v[1:]) for v in (async_blocked, sync_blocked))
        b_torch = statistics.median(sync_torch)
        print(f"state: {size / 1e6:.0f} MB, step time {step_s:.3f} s (fp32, {torch.get_num_threads()} thread)")
        print(f"host copy of the state: fresh buffers {statistics.median(fresh) * 1e3:.0f} ms, reused buffers "
              f"{statistics.median(reused) * 1e3:.0f} ms (ratio {statistics.median(reused) / statistics.median(fresh):.2f})")
        print(f"blocked per checkpoint (median of saves 2..{args.saves}, {args.gap} steps apart): "
              f"async {b_async * 1e3:.1f} ms | sync DCP {b_sync * 1e3:.0f} ms | sync torch.save {b_torch * 1e3:.0f} ms")
        print(f"  async per save (ms): {[round(b * 1e3, 1) for b in async_blocked]}; of which the wait for the host "
              f"copy before the next optimizer step: {[round(w * 1e3, 1) for w in async_waits]}; first save "
              f"allocates the buffers")
        print(f"ratio async / sync torch.save = {b_async / b_torch:.3f} (target <= 0.10); "
              f"async / sync DCP = {b_async / b_sync:.3f}")
        print(f"steps while saves run in the background: median {statistics.median(bg_steps):.3f} s vs "
              f"{step_s:.3f} s without (CPU shared with the background write; not counted as blocked)")
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


def restore(ctx: DistContext, root: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
            repeats: int = 3) -> None:
    """Median of `repeats` restores of the same checkpoint from each tier, into the live model and optimizer."""
    # The replicas live where production keeps them: the node's shared memory (tmpfs), not the bench's temp folder.
    shm = Path(tempfile.mkdtemp(prefix="tf-ckpt-bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    os.environ["TRAINFORGE_REPLICA_DIR"] = str(shm)
    stores = {"local-folder": LocalObjectStore(root / "store-restore").scoped(JOB)}
    server = None
    from trainforge.infra.storage.seaweedfs import SeaweedFSServer, find_weed

    if find_weed():
        server = SeaweedFSServer(root / "weed", weed=find_weed())
        server.start()
        stores["s3"] = server.store(server.make_bucket()).scoped(JOB)

    def timed(staging: Path, replicate: bool) -> float:
        ck = Checkpointer(ctx, store, JOB, staging, lambda *a: None, replicate=replicate)
        t0 = time.perf_counter()
        ref, _ = ck.latest()
        ck.load(ref, model, opt)
        took = time.perf_counter() - t0
        if not replicate:
            ck.close()
        else:  # close() would drop the replicas the next repeat restores from
            ck._writer.shutdown()
            ck._uploader.shutdown()
            ck._puts.shutdown()
        return took

    try:
        for name, store in stores.items():
            ck = Checkpointer(ctx, store, JOB, root / f"staging-r-{name}", lambda *a: None)
            ck.save(1, model, opt, {})
            ck.wait()
            # memory: what a restarted process finds in /dev/shm (its own shard and its peer's copy)
            os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"
            t_mem = [timed(root / f"staging-r2-{name}", True) for _ in range(repeats)]
            os.environ["TORCHELASTIC_RESTART_COUNT"] = "0"
            # local disk: the staging copy kept on this node (its sha256s are checked against the manifest)
            t_disk = [timed(root / f"staging-r-{name}", False) for _ in range(repeats)]
            # object store: an empty staging folder, everything read and verified from the store
            t_store = [timed(root / f"staging-r4-{name}-{i}", False) for i in range(repeats)]
            ck.close()
            m, d, o = (statistics.median(v) for v in (t_mem, t_disk, t_store))
            print(f"restore [{name}] (median of {repeats}): peer/host memory {m:.2f} s | node-local disk {d:.2f} s | "
                  f"object store {o:.2f} s; memory / disk = {m / d:.2f}")
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    main()
