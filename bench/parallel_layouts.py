"""Per-layout steps/s and model-state memory per rank on this CPU (2 gloo ranks), next to the planner's prediction.

State bytes = what a rank holds of parameters + gradients + AdamW states (local shards), measured after a step;
the planner's `model_states_bytes` (fp32, DeepSpeed's accounting, no gather buffer) predicts it. Peak RSS is the
process's ru_maxrss (includes the ~300 MB torch runtime). Activations/rank = peak live bytes of the tensors
autograd saves for backward during a step (saved_tensors_hooks, parameters excluded: parallel_pp_memory.LiveSaved),
the busiest rank, next to the planner's `estimate_memory` activations + logits items for the same layout.
Baseline: DDP on the same 2 ranks.
Run: .venv/bin/python bench/parallel_layouts.py   (~2 min)
"""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = {"layers": 4, "hidden": 256, "heads": 8, "kv_heads": 4, "ffn_hidden": 704, "vocab": 4096}
SEQ, BATCH, MICRO, STEPS = 128, 8, 2, 5
LAYOUTS = {
    "ddp": {"dp": 2},
    "fsdp shard-grad-op": {"dp": 2, "sharding": "shard-grad-op"},
    "fsdp full-shard": {"dp": 2, "sharding": "full-shard"},
    "tp=2 (sp, loss-parallel)": {"dp": 1, "tp": 2},
    "pp=2 1f1b": {"dp": 1, "pp": 2, "schedule": "1f1b"},
    "pp=2 gpipe": {"dp": 1, "pp": 2, "schedule": "gpipe"},
}


def local_bytes(t) -> int:  # type: ignore[no-untyped-def]
    t = t._local_tensor if hasattr(t, "_local_tensor") else t
    return t.numel() * t.element_size()


def rank_main(layout: dict, out: str) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from parallel_pp_memory import LiveSaved, local_storage_ptr

    from trainforge.trainer.distributed import DistContext, shutdown
    from trainforge.trainer.models.llama import build_model
    from trainforge.trainer.parallel.parallelize import parallelize

    ctx = DistContext.from_env(120)
    torch.manual_seed(0)
    layout = {"micro_batch_size": MICRO, **layout}
    pm = parallelize(build_model({**MODEL, "max_seq_len": SEQ}), layout, world_size=ctx.world_size, rank=ctx.rank,
                     device=ctx.device, local_batch=BATCH // layout["dp"])
    opt = torch.optim.AdamW(pm.model.parameters(), lr=1e-4)
    per = BATCH // pm.dims.dp
    times, act = [], 0
    counter = LiveSaved({local_storage_ptr(p) for p in pm.model.parameters()})
    for step in range(STEPS + 1):
        tok = torch.randint(0, MODEL["vocab"], (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
        mine = tok[pm.dp_rank * per:(pm.dp_rank + 1) * per].split(MICRO)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        counter.reset()
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            pm.forward_backward([c[:, :-1] for c in mine], [c[:, 1:] for c in mine])
        if step:  # step 0 includes one-time work (pipeline shape inference)
            act = max(act, counter.peak - counter.base)
        pm.clip_grad_norm(1.0)
        opt.step()
        times.append(time.perf_counter() - t0)
    params = list(pm.model.parameters())
    state = sum(local_bytes(p) + (local_bytes(p.grad) if p.grad is not None else 0) for p in params)
    state += sum(local_bytes(v) for s in opt.state.values() for v in s.values() if hasattr(v, "numel") and v.dim())
    n = torch.tensor([state, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, act], dtype=torch.float64)
    acts = [torch.zeros((), dtype=torch.float64) for _ in range(ctx.world_size)]
    torch.distributed.all_gather(acts, torch.tensor(float(act), dtype=torch.float64))
    torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MAX)
    if ctx.rank == 0:
        Path(out).write_text(json.dumps({"step_s": sorted(times[1:])[len(times[1:]) // 2], "state": n[0].item(),
                                         "rss": n[1].item(), "act": n[2].item(),
                                         "acts": [a.item() for a in acts], "kind": pm.kind}))
    del pm, opt
    shutdown(ctx)


def run(layout: dict) -> dict:
    out = ROOT / ".bench-layout.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={port}",
                    __file__, "--rank", json.dumps(layout), str(out)], check=True, timeout=300, cwd=ROOT,
                   env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}, capture_output=True)
    res = json.loads(out.read_text())
    out.unlink()
    return res


def main() -> None:
    from trainforge.plan.layout import Layout
    from trainforge.plan.memory import estimate_memory, model_states_bytes
    from trainforge.plan.model import ModelShape
    from trainforge.trainer.models.llama import build_model

    n_params = sum(p.numel() for p in build_model({**MODEL, "max_seq_len": SEQ}).parameters())
    print(f"model {n_params / 1e6:.2f}M params, seq {SEQ}, global batch {BATCH}, micro {MICRO}, 2 gloo ranks, fp32")
    base = None
    for name, layout in LAYOUTS.items():
        r = run(layout)
        div = layout.get("tp", 1) * layout.get("pp", 1)
        predicted = sum(model_states_bytes(n_params // div, num_gpus=layout["dp"],
                                           sharding=layout.get("sharding", "none"), precision="fp32").values())
        plan = estimate_memory(ModelShape("bench", **MODEL), Layout(micro_batch_size=MICRO, **layout), seq_len=SEQ,
                               global_batch_size=BATCH, precision="fp32", capacity_bytes=2**40,
                               engine="native").by_name()
        act = plan["activations"] + plan["logits"]
        # The planner models the first pipeline stage; show each stage's measurement for PP layouts.
        per_stage = (", stages " + " / ".join(f"{a / 2**20:.1f}" for a in r["acts"])) if layout.get("pp", 1) > 1 else ""
        base = base or r
        print(f"{name:25s} {1 / r['step_s']:6.2f} steps/s ({base['step_s'] / r['step_s']:.2f}x ddp)  "
              f"state/rank {r['state'] / 2**20:6.1f} MiB ({r['state'] / base['state']:.2f}x ddp, planner "
              f"{predicted / 2**20:6.1f} MiB)  activations/rank {r['act'] / 2**20:5.1f} MiB (planner {act / 2**20:5.1f} MiB, "
              f"{r['act'] / act:.2f}x{per_stage})  peak rss {r['rss'] / 2**20:6.0f} MiB  [{r['kind']}]")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        rank_main(json.loads(sys.argv[2]), sys.argv[3])
    else:
        main()
