"""Memory model vs measured peak RSS of real 2-worker runs on this CPU (gloo, fp32, AdamW): DDP and FSDP2.

Prints, per strategy, the planner's per-worker estimate (trainforge.plan.memory.estimate_memory with the `cpu`
slot's process baseline) and the measured peak RSS per worker, and their ratio. Baseline: the measured RSS.
Run: .venv/bin/python bench/memory_vs_rss.py   (2 workers, OMP_NUM_THREADS=1, ~1-2 min)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from trainforge.plan.hardware import gpu_spec
from trainforge.plan.layout import Layout
from trainforge.plan.memory import estimate_memory
from trainforge.plan.model import ModelShape, swiglu_ffn

ROOT = Path(__file__).resolve().parents[1]
LAYERS, HIDDEN, HEADS, VOCAB, MB, SEQ = 8, 768, 12, 8192, 4, 128
MiB = 2**20


def measure(mode: str) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "bench/memory_vs_rss_worker.py"), mode, *map(str, (LAYERS, HIDDEN, HEADS, VOCAB, MB, SEQ))]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, check=True)
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    shape = ModelShape("bench-llama", LAYERS, HIDDEN, HEADS, HEADS, swiglu_ffn(HIDDEN), VOCAB)
    cpu = gpu_spec("cpu")
    print(f"model: {shape.total_params / 1e6:.1f}M params, fp32 AdamW, 2 workers, micro-batch {MB} x {SEQ} tokens")
    print(f"{'strategy':<10} {'model MiB':>10} {'measured MiB':>13} {'ratio':>7} {'baseline MiB':>13}")
    for mode, sharding in (("ddp", "none"), ("fsdp", "full-shard")):
        layout = Layout(dp=2, micro_batch_size=MB, sharding=sharding)
        est = estimate_memory(shape, layout, seq_len=SEQ, global_batch_size=2 * MB, precision="fp32",
                              capacity_bytes=cpu.memory_bytes, gpus_per_node=2, flash_attention=False,
                              runtime_overhead_bytes=cpu.runtime_overhead_bytes)
        results = measure(mode)
        peak = max(r["peak"] for r in results)
        base = max(r["baseline"] for r in results)
        print(f"{mode:<10} {est.total_bytes / MiB:10.0f} {peak / MiB:13.0f} {est.total_bytes / peak:7.2f} "
              f"{base / MiB:13.0f}")
        print("   " + ", ".join(f"{i.name} {i.bytes / MiB:.0f}" for i in est.items))


if __name__ == "__main__":
    main()
