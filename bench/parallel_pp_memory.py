"""Pipeline activation memory: peak live activations per stage under GPipe / 1F1B / interleaved 1F1B, vs the planner.

How it is measured (torch has no CPU allocator counters): every tensor autograd saves for backward passes through
`torch.autograd.graph.saved_tensors_hooks` around `schedule.step`; the pack hook counts its storage's bytes once
(storages saved twice, e.g. a tensor and its view, count once) and the count drops when autograd frees the saved
tensor (after that micro-batch's backward). Parameters (the weights a matmul saves) are excluded: they are model
state, not activations. Peak live bytes over the measured step, minus those alive when it began = the stage's activation high-water mark.
"Micro-batches in flight" = peak / (bytes saved per micro-batch on that rank = all bytes saved in the step / m).
Planner: trainforge.plan.memory.micro_batches_in_flight (GPipe m, 1F1B min(p, m), interleaved p + (p-1)/v), which
models the first stage (the busiest); stage s of 1F1B holds p - s. Baseline: GPipe in the same run.
Model: tiny Llama (8 layers, hidden 64, seq 64), fp32, micro-batch 1, m = 8 micro-batches, p gloo ranks on CPU.
Run: .venv/bin/python bench/parallel_pp_memory.py [--p 4]   (3 torchrun launches of p ranks, ~1 min)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODEL = {"layers": 8, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn_hidden": 176, "vocab": 256}
SEQ, M = 64, 8
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)]


class LiveSaved:
    """Bytes of distinct storages autograd currently holds for backward, and the peak of that since reset()."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude  # storage pointers of parameters
        self.refs: dict[int, list[int]] = {}  # storage ptr -> [nbytes, saved references alive]
        self.live = self.peak = self.total = self.base = 0

    def reset(self) -> None:
        self.base = self.peak = self.live
        self.total = 0

    def pack(self, t: Any) -> Any:
        import torch

        base = t._base if t._base is not None else t
        # Weights are model state: parameters and their views (a linear saves weight.t()); FSDP2's gathered
        # (unsharded) weights are Parameters too, whose storage is not the sharded one in `exclude`.
        if isinstance(t, torch.nn.Parameter) or isinstance(base, torch.nn.Parameter):
            return t
        local = plain(t)  # DTensor (TP): count this rank's shard
        if local.device.type != "cpu" or local.layout != torch.strided:
            return t
        try:
            storage = local.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
        except RuntimeError:  # a wrapper subclass without real storage: count its own bytes, keyed by identity
            ptr, nbytes = id(local), local.numel() * local.element_size()
        if ptr in self.exclude or ptr == 0:
            return t
        entry = self.refs.setdefault(ptr, [nbytes, 0])
        if entry[1] == 0:
            self.live += entry[0]
            self.total += entry[0]
            self.peak = max(self.peak, self.live)
        entry[1] += 1
        return _Held(t, ptr, self)

    @staticmethod
    def unpack(h: Any) -> Any:
        return h.t if isinstance(h, _Held) else h

    def release(self, ptr: int) -> None:
        entry = self.refs[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self.refs[ptr]


def plain(t: Any) -> Any:
    """The plain tensor inside tensor subclasses: a DTensor's local shard, an async collective's result."""
    while True:
        inner = getattr(t, "_local_tensor", None)
        if inner is None:
            inner = getattr(t, "elem", None)
        if inner is None or inner is t:
            return t
        t = inner


def local_storage_ptr(t: Any) -> int:
    """Storage address of a tensor, or of this rank's shard of a DTensor (FSDP2 / TP parameters)."""
    return int(plain(t).untyped_storage().data_ptr())


class _Held:
    """A saved tensor; autograd drops it when the node that saved it has run backward (or the graph is freed)."""

    __slots__ = ("t", "ptr", "owner")

    def __init__(self, t: Any, ptr: int, owner: LiveSaved) -> None:
        self.t, self.ptr, self.owner = t, ptr, owner

    def __del__(self) -> None:
        self.owner.release(self.ptr)


def rank_main(schedule: str, vpp: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from trainforge.trainer.distributed import DistContext, shutdown
    from trainforge.trainer.models.llama import build_model
    from trainforge.trainer.parallel.parallelize import parallelize

    ctx = DistContext.from_env(120)
    torch.manual_seed(0)
    layout = {"dp": 1, "pp": ctx.world_size, "vpp": vpp, "schedule": schedule, "micro_batch_size": 1}
    pm = parallelize(build_model({**MODEL, "max_seq_len": SEQ}), layout, world_size=ctx.world_size, rank=ctx.rank,
                     device=ctx.device, local_batch=M)
    counter = LiveSaved({local_storage_ptr(p) for p in pm.model.parameters()})
    for step in range(2):  # step 0 includes the stages' shape inference; step 1 is measured
        tok = torch.randint(0, MODEL["vocab"], (M, SEQ + 1), generator=torch.Generator().manual_seed(step))
        xs, ys = list(tok[:, :-1].split(1)), list(tok[:, 1:].split(1))
        counter.reset()
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            pm.forward_backward(xs, ys)
        for p in pm.model.parameters():
            p.grad = None
    # Peak above what was alive when the step began: stage 0 keeps one graph (1.1 MiB here, the same storages at
    # every step) from the first step for the rest of the run, most likely the pipeline stage's first-step shape
    # inference; it is constant, not per-step activation memory, so it is reported apart.
    res = torch.tensor([counter.peak - counter.base, counter.total, counter.base], dtype=torch.float64)
    gathered = [torch.zeros(3, dtype=torch.float64) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, res)
    if ctx.rank == 0:
        Path(out).write_text(json.dumps([g.tolist() for g in gathered]))
    del pm
    shutdown(ctx)


def measure(p: int, schedule: str, vpp: int) -> list[list[float]]:
    out = ROOT / f".bench-ppmem-{schedule}.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={p}",
                           f"--master-port={port}", __file__, "--rank", schedule, str(vpp), str(out)],
                          timeout=300, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        raise SystemExit(f"{schedule} on {p} ranks failed:\n{proc.stderr[-3000:]}")
    res = json.loads(out.read_text())
    out.unlink()
    return res


def main() -> None:
    from trainforge.plan.layout import Layout
    from trainforge.plan.memory import micro_batches_in_flight

    ap = argparse.ArgumentParser()
    ap.add_argument("--p", type=int, default=4, help="pipeline stages = gloo ranks (2-4 here)")
    p = ap.parse_args().p
    print(f"p={p} m={M} tiny Llama {MODEL['layers']} layers h={MODEL['hidden']} seq {SEQ} micro-batch 1, fp32; "
          "live bytes of tensors saved for backward (saved_tensors_hooks, parameters excluded); baseline GPipe")
    results = {}
    for schedule, vpp in SCHEDULES:
        if MODEL["layers"] < p * vpp:
            continue
        results[schedule] = measure(p, schedule, vpp)
        planner = micro_batches_in_flight(Layout(dp=1, pp=p, vpp=vpp, schedule=schedule), M)
        print(f"\n{schedule} v={vpp} (planner, stage 0: {planner:g} micro-batches in flight)")
        for stage, (peak, total, held) in enumerate(results[schedule]):
            base = results["gpipe"][stage][0]
            print(f"  stage {stage}: peak {peak / 2**20:6.2f} MiB = {peak / (total / M):4.2f} micro-batches in flight"
                  f"  {schedule}/GPipe {peak / base:.3f}" + (f"  (+{held / 2**20:.2f} MiB held since step 0)" if held else ""))
        g0 = results["gpipe"][0][0]
        print(f"  stage 0 ratio {schedule}/GPipe: measured {results[schedule][0][0] / g0:.3f}, "
              f"planner {planner / micro_batches_in_flight(Layout(dp=1, pp=p, schedule='gpipe'), M):.3f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        rank_main(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        main()
