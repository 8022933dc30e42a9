"""Pipeline bubble: measured idle fraction of GPipe / 1F1B / interleaved 1F1B vs the formula (p-1)/(m+p-1).

Each stage has a synthetic cost (sleep: forward c, backward 2c, so 4 ranks fit on 2 cores without contention).
Idle fraction = 1 - (busy time per rank) / (step wall time). Baseline: the 1F1B formula.
Run: .venv/bin/python bench/parallel_pp_bubble.py   (4 gloo ranks, ~1 min)
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

P, M, COST = 4, 8, 0.05
ROOT = Path(__file__).resolve().parents[1]


class Sleep(__import__("torch").autograd.Function):
    @staticmethod
    def forward(ctx, x, cost):  # type: ignore[no-untyped-def]
        ctx.cost = cost
        time.sleep(cost)
        return x * 1.0

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        time.sleep(2 * ctx.cost)
        return g * 1.0, None


def rank_main(schedule: str, vpp: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage

    from trainforge.trainer.parallel.pp import SCHEDULES

    class Stage(nn.Module):
        def __init__(self, cost: float):
            super().__init__()
            self.w = nn.Parameter(torch.ones(8))
            self.cost = cost

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Sleep.apply(x * self.w, self.cost)

    dist.init_process_group("gloo")
    rank, n_stages = dist.get_rank(), P * vpp
    stages = [PipelineStage(Stage(COST / vpp), rank + i * P, n_stages, torch.device("cpu")) for i in range(vpp)]
    cls = SCHEDULES[schedule]
    sched = cls(stages if vpp > 1 else stages[0], n_microbatches=M, loss_fn=lambda y, t: (y - t).pow(2).mean())
    x, t = torch.ones(M, 8), torch.zeros(M, 8)
    times = []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            sched.step(x)
        elif rank == P - 1:
            sched.step(target=t)
        else:
            sched.step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps({"step_s": min(times[1:])}))
    del sched, stages
    dist.barrier()
    dist.destroy_process_group()


def measure(schedule: str, vpp: int) -> float:
    out = ROOT / f".bench-bubble-{schedule}.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={P}", f"--master-port={port}",
                    __file__, "--rank", schedule, str(vpp), str(out)], check=True, timeout=300, cwd=ROOT,
                   env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}, capture_output=True)
    step = json.loads(out.read_text())["step_s"]
    out.unlink()
    busy = M * 3 * COST
    return 1 - busy / step


def main() -> None:
    from trainforge.trainer.parallel.pp import bubble_fraction

    formula = bubble_fraction(P, M)
    print(f"p={P} m={M} stage cost fwd {COST * 1e3:.0f} ms / bwd {2 * COST * 1e3:.0f} ms; "
          f"baseline = 1F1B formula (p-1)/(m+p-1) = {formula:.3f}")
    for schedule, vpp in [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)]:
        idle = measure(schedule, vpp)
        expect = bubble_fraction(P, M, vpp)
        print(f"{schedule:17s} v={vpp}: idle {idle:.3f}  formula {expect:.3f}  measured/1F1B-formula "
              f"{idle / formula:.2f}x")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        rank_main(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        main()
