"""DDP's gradient reduction: `fixed-order` (the default, trainer/parallel/ddp.py: all-to-all, a rank-order sum, an
all-gather) against the named baseline `fast` (torch's all-reduce hook), in the same run. Each side trains the same
MLP (about 4.2 M parameters, 16 MiB of fp32 gradients, several DDP buckets) for --steps steps on --world gloo ranks
under torchrun; the sides alternate --repeats times and the median step times are compared. Prints the ratio
fixed-order / fast (1.00 = no cost).

What it leaves out: NCCL on GPUs (gloo on CPU here, where the ranks share 2 cores, so communication and compute do
not overlap as they do on a GPU), and worlds past what 2 cores run.

  .venv/bin/python bench/ddp_reduction.py [--world 4] [--steps 30] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKER = """
import json, sys, time
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from trainforge.trainer.parallel.ddp import apply_ddp

order, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo")
rank, n = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(1024, 1024), nn.Tanh())], nn.Linear(1024, 16))
ddp, _ = apply_ddp(model, init_device_mesh("cpu", (n,)), None, order)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(rank)
x, y = torch.randn(16, 1024, generator=g), torch.randn(16, 16, generator=g)
times = []
for step in range(steps + 2):  # two warm-up steps: the first runs on DDP's initial layout
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()
    dist.barrier()
    if step >= 2:
        times.append(time.perf_counter() - t0)
if rank == 0:
    open(out, "w").write(json.dumps(times))
dist.destroy_process_group()
"""


def run(order: str, world: int, steps: int, folder: Path) -> float:
    from trainforge.infra.backends.local import free_port

    script, out = folder / "worker.py", folder / f"{order}.json"
    script.write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
                    f"--master-port={free_port()}", str(script), order, str(steps), str(out)],
                   env=env, capture_output=True, text=True, timeout=600, check=True)
    return statistics.median(json.loads(out.read_text()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    medians: dict[str, list[float]] = {"fast": [], "fixed-order": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for order in ("fast", "fixed-order") if i % 2 == 0 else ("fixed-order", "fast"):
                medians[order].append(run(order, args.world, args.steps, Path(tmp)))
                print(f"repeat {i + 1}/{args.repeats} {order}: median step {medians[order][-1] * 1000:.1f} ms",
                      flush=True)
    fast, fixed = statistics.median(medians["fast"]), statistics.median(medians["fixed-order"])
    print(f"world {args.world}, {args.steps} steps x {args.repeats}: fast (torch's all-reduce) {fast * 1000:.1f} ms/step, "
          f"fixed-order {fixed * 1000:.1f} ms/step, ratio fixed-order / fast {fixed / fast:.2f}")


if __name__ == "__main__":
    main()
