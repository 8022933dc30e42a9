"""Memory model vs measured peak RSS of real 2-worker runs on this CPU (gloo, fp32, AdamW): DDP, FSDP2 full-shard and
FSDP2 with reshard_after_forward=False (the planner's shard-grad-op, as trainforge's trainer maps it).

Prints, per strategy, the planner's per-worker estimate (trainforge.plan.memory.estimate_memory with the `cpu`
slot's process baseline) and the measured peak RSS per worker (the larger of the two), and their ratio. Baseline:
the measured RSS, in the same run. Each strategy runs under three host allocators:
  jemalloc           the workers as trainforge's local backend starts them with TRAINFORGE_ALLOCATOR=jemalloc
                     (Debian's libjemalloc2 preloaded): freed memory goes back to the kernel, so peak RSS tracks
                     live memory. Skipped when not installed.
  glibc default      glibc's malloc raises its mmap threshold to the size of the largest block freed so far (up to
                     32 MiB on 64-bit; mallopt(3), M_MMAP_THRESHOLD), so after the first step every tensor under
                     32 MiB comes from the brk heap, and freed heap chunks stay resident (only a free top of the
                     heap is trimmed). `retained` is what glibc held freed at the end (mallinfo2 fordblks):
                     resident memory that no tensor uses, which grows with the step count.
  mmap threshold     MALLOC_MMAP_THRESHOLD_=131072 pins glibc's threshold at its default start value, so every block
                     of 128 KiB or more is mmapped and returned to the kernel at free(): peak RSS is then the peak of
                     live memory, the quantity the planner models (as the CUDA caching allocator's reserved memory is
                     on a GPU) — but every large tensor is a fresh mmap, ~1.5x the step time here.
bench/memory_phases.py shows the same runs phase by phase (where the memory goes).
Run: .venv/bin/python bench/memory_vs_rss.py   (2 workers, OMP_NUM_THREADS=1, ~4-6 min on 2 busy cores)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from trainforge.infra.launch import allocator_environment
from trainforge.plan.hardware import gpu_spec
from trainforge.plan.layout import Layout
from trainforge.plan.memory import estimate_memory
from trainforge.plan.model import ModelShape, swiglu_ffn

ROOT = Path(__file__).resolve().parents[1]
LAYERS, HIDDEN, HEADS, VOCAB, MB, SEQ = 8, 768, 12, 8192, 4, 128
MiB = 2**20


def _jemalloc() -> dict[str, str]:
    try:
        return allocator_environment({"TRAINFORGE_ALLOCATOR": "jemalloc"})
    except ValueError:  # not installed: that row is skipped
        return {}

STRATEGIES = (("ddp", "none"), ("fsdp", "full-shard"), ("fsdp-noreshard", "shard-grad-op"))
ALLOCATORS = (("jemalloc", _jemalloc()), ("glibc default", {}),
              ("mmap threshold", {"MALLOC_MMAP_THRESHOLD_": "131072"}))


def measure(mode: str, extra_env: dict[str, str]) -> list[dict]:
    # Start from a clean glibc configuration: an inherited MALLOC_* tunable would change the "default" run.
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra_env})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "bench/memory_vs_rss_worker.py"), mode, *map(str, (LAYERS, HIDDEN, HEADS, VOCAB, MB, SEQ))]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, check=True)
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    shape = ModelShape("bench-llama", LAYERS, HIDDEN, HEADS, HEADS, swiglu_ffn(HIDDEN), VOCAB)
    cpu = gpu_spec("cpu")
    print(f"model: {shape.total_params / 1e6:.1f}M params, fp32 AdamW, 2 workers, micro-batch {MB} x {SEQ} tokens")
    print(f"{'strategy':<15} {'sharding':<14} {'allocator':<15} {'model MiB':>9} {'measured MiB':>12} "
          f"{'ratio':>6} {'baseline MiB':>12} {'retained MiB':>12}")
    for mode, sharding in STRATEGIES:
        layout = Layout(dp=2, micro_batch_size=MB, sharding=sharding)
        est = estimate_memory(shape, layout, seq_len=SEQ, global_batch_size=2 * MB, precision="fp32",
                              capacity_bytes=cpu.memory_bytes, gpus_per_node=2, flash_attention=False,
                              runtime_overhead_bytes=cpu.runtime_overhead_bytes, engine="native")
        for label, env in ALLOCATORS:
            if label == "jemalloc" and not env:
                print(f"{mode:<15} {sharding:<14} {label:<15} not installed (Debian: libjemalloc2)", flush=True)
                continue
            results = measure(mode, env)
            peak = max(r["peak"] for r in results)
            base = max(r["baseline"] for r in results)
            retained = max(r["retained"] for r in results)
            print(f"{mode:<15} {sharding:<14} {label:<15} {est.total_bytes / MiB:9.0f} {peak / MiB:12.0f} "
                  f"{est.total_bytes / peak:6.2f} {base / MiB:12.0f} {retained / MiB:12.0f}", flush=True)
        print("   model: " + ", ".join(f"{i.name} {i.bytes / MiB:.0f}" for i in est.items), flush=True)


if __name__ == "__main__":
    main()
