"""Where does a CPU worker's memory go? Per-phase memory profile of the bench/memory_vs_rss.py runs (DDP, FSDP2).

Each of 2 gloo workers trains the same small Llama (fp32, AdamW) and records, at every phase boundary (idle
process, after `import torch`, after init_process_group, after model build, after wrapping/sharding, after the
optimizer, then forward / backward / optimizer step / zero_grad of each step):
  rss       resident set size now (/proc/self/statm)
  hwm       peak RSS *within the phase* (VmHWM, reset at each boundary by writing 5 to /proc/self/clear_refs)
  in_use    bytes glibc malloc has handed out and not taken back (mallinfo2 uordblks + hblkhd): live tensors plus
            Python objects -- torch's CPU allocator has no counters of its own, every tensor is a malloc
  free      bytes glibc keeps in its arenas after free() (mallinfo2 fordblks): freed, still resident
  peak_in_use  the highest in_use seen at any module boundary inside the phase (forward/backward hooks on
            every block and on the root), i.e. the allocator-level peak that RSS cannot separate from retention

Run: .venv/bin/python bench/memory_phases.py [ddp|fsdp|fsdp-noreshard ...] [--env NAME=VALUE ...]
     (2 workers, OMP_NUM_THREADS=1; ~30 s per mode). `--env MALLOC_MMAP_THRESHOLD_=131072` re-runs with glibc's
     dynamic mmap threshold pinned, which separates allocator retention from live memory. `--env BENCH_STEPS=10`
     trains longer (default 3 steps); `--env BENCH_TRACE=1` prints malloc in-use at every probe of the last step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
LAYERS, HIDDEN, HEADS, VOCAB, MB, SEQ = 8, 768, 12, 8192, 4, 128


def run(mode: str, extra_env: dict[str, str]) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra_env}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "bench/memory_phases_worker.py"), mode, *map(str, (LAYERS, HIDDEN, HEADS, VOCAB, MB, SEQ))]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    if out.returncode != 0 and "RESULT " not in out.stdout:
        sys.exit(f"{mode}: torchrun failed ({out.returncode}):\n{out.stderr[-3000:]}")
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("modes", nargs="*", default=["ddp", "fsdp"])
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for the workers")
    args = ap.parse_args()
    extra = dict(kv.split("=", 1) for kv in args.env)
    for mode in args.modes:
        ranks = run(mode, extra)
        print(f"\n== {mode} {' '.join(args.env)} (rank 0; MiB) ==")
        print(f"{'phase':<22} {'rss':>7} {'hwm':>7} {'in_use':>7} {'free':>7} {'peak_in_use':>11} {'mmapped':>10}")
        for p in ranks[0]["phases"]:
            print(f"{p['phase']:<22} {p['rss'] / MiB:7.0f} {p['hwm'] / MiB:7.0f} {p['in_use'] / MiB:7.0f} "
                  f"{p['free'] / MiB:7.0f} {p['peak_in_use'] / MiB:11.0f} {p['max_total'] / MiB:10.0f}")
        ph = ranks[0]["phases"]
        t0 = next(p["t"] for p in ph if p["phase"] == "0 zero_grad")
        later = [p for p in ph if p["phase"][0].isdigit() and not p["phase"].startswith("0 ")]
        if later:
            print(f"step time (steps after the first): {(later[-1]['t'] - t0) / (len(later) // 4):.3f} s")
        if "trace" in ranks[0]:
            trace = ranks[0]["trace"]
            print("trace of the last step (in_use MiB at each probe):")
            print("  " + ", ".join(f"{w} {b / MiB:.0f}" for w, b in trace[-len(trace) // 3:]))
        for r in ranks:
            print(f"rank {r['rank']}: peak RSS {r['peak'] / MiB:.0f} MiB, threads {r['threads']}, "
                  f"malloc arenas {r['arenas']}, tensors {json.dumps(r.get('tensors', {}))}")


if __name__ == "__main__":
    main()
