"""Data-wait in the demo job: the fraction of step time the training loop spends waiting for its batch, with and
without online preprocessing workers (issue 9, target <= 1%).

Runs the tiny CPU job's trainer exactly as a segment does (trainforge.trainer.worker under torchrun, 2 ranks, no
flow; see bench/spine_overhead.py) on the demo dataset, in four configurations, alternating, `--repeats` times:
  sync            dataset read in the training process (the default: no spec field set)
  workers         `dataset.num_workers: 1` per rank: DataLoader worker processes, pipelined with training
  sync+prep       plus a CPU transform (`--prep-ms` of per-sample work) run in the training process
  workers+prep    the same transform in the worker processes
Data-wait % = sum(data_wait_s) / sum(step_time_s) over each run's metrics events (rank 0), after `--skip` warm-up
steps (worker start-up is reported separately, as the first step's wait).

  OMP_NUM_THREADS=1 .venv/bin/python bench/data_wait.py [--steps 60] [--repeats 2] [--prep-ms 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
PREP_S = float(os.environ.get("DATA_WAIT_PREP_MS", "2")) / 1e3


def cpu_transform(sample: np.ndarray, index: int) -> np.ndarray:
    """A deterministic per-sample CPU transform standing in for real preprocessing: busy for PREP_S, then a
    token-preserving rewrite (identity on the values, so the loss curve is the job's own)."""
    end = time.perf_counter() + PREP_S
    acc = np.uint64(index)
    while time.perf_counter() < end:
        acc = np.uint64((int(acc) * 6364136223846793005 + 1442695040888963407) & (2**64 - 1))
    return sample.copy()


def run_worker(spec_path: Path, home: Path, env: dict[str, str]) -> list[dict]:
    """The trainer as a segment runs it (shared with bench/spine_overhead.py); its per-step metrics events."""
    from spine_overhead import run_worker as run_trainer  # bench/ is on sys.path when run as a script

    events, _ = run_trainer(spec_path, home, env)
    return [e for e in events if e["type"] == "metrics"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the steady-state fraction")
    p.add_argument("--prep-ms", type=float, default=2.0, help="CPU time of the transform per sample")
    p.add_argument("--workers", type=int, default=1, help="DataLoader workers per rank (2 ranks)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="tf-bench-") as tmp:
        home = Path(tmp) / "home"
        env = {**os.environ, "TRAINFORGE_HOME": str(home), "PREFECT_HOME": str(Path(tmp) / "prefect"),
               "OMP_NUM_THREADS": "1", "DATA_WAIT_PREP_MS": str(args.prep_ms),
               "PYTHONPATH": os.pathsep.join([str(REPO / "bench"), os.environ.get("PYTHONPATH", "")])}
        os.environ.update({k: env[k] for k in ("TRAINFORGE_HOME", "PREFECT_HOME")})
        from trainforge.datasets.demo import ensure_demo_dataset

        ensure_demo_dataset()
        base = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
        base["training"]["max_steps"] = args.steps
        base["checkpoint"]["interval_steps"] = args.steps
        configs = {
            "sync": {},
            "workers": {"num_workers": args.workers},
            "sync+prep": {"transforms": ["data_wait:cpu_transform"]},
            "workers+prep": {"transforms": ["data_wait:cpu_transform"], "num_workers": args.workers},
        }
        results: dict[str, list[tuple[float, float, float, float]]] = {k: [] for k in configs}
        for r in range(args.repeats):
            for name, extra in configs.items():
                doc = json.loads(json.dumps(base))
                doc["dataset"].update(extra)
                spec_path = Path(tmp) / f"job-{name.replace('+', '-')}.yaml"
                spec_path.write_text(yaml.safe_dump(doc))
                metrics = run_worker(spec_path, home, env)
                steady = metrics[args.skip:]
                wait = sum(e["data_wait_s"] for e in steady)
                step = sum(e["step_time_s"] for e in steady)
                med_step = statistics.median(e["step_time_s"] for e in steady)
                results[name].append((100 * wait / step, med_step, metrics[0]["data_wait_s"],
                                      max(e["data_wait_s"] for e in steady)))
                print(f"round {r + 1} {name:13s}: data-wait {100 * wait / step:6.2f}% of step time, median step "
                      f"{med_step * 1e3:6.1f} ms, first-step wait {metrics[0]['data_wait_s'] * 1e3:6.1f} ms, "
                      f"worst steady wait {results[name][-1][3] * 1e3:5.1f} ms", flush=True)
        print(f"\nsummary: {args.steps} steps, global batch {base['training']['global_batch_size']}, 2 ranks, "
              f"{args.workers} worker(s)/rank, transform {args.prep_ms} ms/sample, median over {args.repeats} runs")
        for name, rows in results.items():
            pct = statistics.median(x[0] for x in rows)
            print(f"  {name:13s} data-wait {pct:6.2f}% (target <= 1%: {'ok' if pct <= 1 else 'MISSED'}), "
                  f"median step {statistics.median(x[1] for x in rows) * 1e3:6.1f} ms, first-step wait "
                  f"{statistics.median(x[2] for x in rows) * 1e3:6.1f} ms")


if __name__ == "__main__":
    main()
