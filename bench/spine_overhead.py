"""Platform overhead of the spine, measured in one run against named baselines (this machine is noisy, so the
two sides alternate and the medians are compared):

1. Loop overhead: median step time of the managed trainer (trainforge.trainer.worker under torchrun: DDP, events,
   LR schedule, loss all-reduce, final checkpoint) vs `bench/plain_ddp.py` (plain torchrun DDP, same model, same
   batches). Prints steps/s ratio managed / plain (target >= 0.97).
2. End to end: wall time of a whole job through `trainforge submit` (Prefect flow, MLflow, evaluation, export,
   registry) vs the plain script's wall time for the same steps.
3. Orchestration tax: time from `trainforge submit` to the first training step, median of N.

  .venv/bin/python bench/spine_overhead.py [--steps 40] [--repeats 3] [--submits 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


def torchrun(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    from trainforge.infra.backends.local import free_port

    cmd = [PY, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=True)


def prepare_segment(spec_path: Path, cluster=None) -> tuple[Any, Path, dict]:
    """What a segment's launch gets, without the flow: the spec validated (against `cluster`, default this
    machine's), its dataset resolved, planned, a job record and its worker config. Returns (record, config path,
    plan). Shared by the data-wait bench and bench/gpu_check.py."""
    from trainforge.registry.jobs import JobStore, new_job_id
    from trainforge.spec import read_document
    from trainforge.tasks import prepare

    spec = prepare.validate_spec(read_document(spec_path), str(spec_path), spec_path.parent, cluster)
    ds = prepare.resolve_dataset(spec, spec_path.parent)
    plan = prepare.make_plan(spec, cluster)
    job_id = new_job_id(spec.name)
    record = JobStore().create(job_id)
    config = prepare.worker_config(spec, job_id, record.folder, spec_path.parent, ds, plan, "bench")
    return record, config.write(record.folder / "worker-config.json"), plan


def run_worker(spec_path: Path, home: Path, env: dict[str, str]) -> tuple[list[dict], float]:
    """Run the trainer exactly as a segment does, without the flow: (its events, wall seconds). Shared by the
    data-wait bench."""
    os.environ["TRAINFORGE_HOME"] = str(home)
    record, path, _ = prepare_segment(spec_path)
    t0 = time.perf_counter()
    torchrun(["-m", "trainforge.trainer.worker"], {**env, "TRAINFORGE_JOB_CONFIG": str(path),
                                                   "TRAINFORGE_HOME": str(home)})
    wall = time.perf_counter() - t0
    return [json.loads(line) for line in (record.folder / "events.jsonl").read_text().splitlines()], wall


def managed_worker(spec_path: Path, home: Path, steps: int, env: dict[str, str]) -> tuple[float, float]:
    """Median steady-state step time and wall time of the managed trainer."""
    events, wall = run_worker(spec_path, home, env)
    step_times = [e["step_time_s"] for e in events if e["type"] == "metrics"][3:]
    return statistics.median(step_times), wall


def plain(dataset_dir: str, steps: int, env: dict[str, str]) -> tuple[float, float]:
    t0 = time.perf_counter()
    out = torchrun([str(REPO / "bench" / "plain_ddp.py"), "--dataset", dataset_dir, "--steps", str(steps),
                    "--global-batch", "16", "--micro", "4", "--seq", "128"], env)
    wall = time.perf_counter() - t0
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return result["median_step_s"], wall


def submit_to_first_step(spec_path: Path, home: Path, env: dict[str, str]) -> tuple[float, float]:
    """Seconds from launching `trainforge submit` to the first metrics event, and the whole job's wall time."""
    t0 = time.time()
    subprocess.run([PY, "-m", "trainforge", "submit", str(spec_path), "--json"], env={**env,
                   "TRAINFORGE_HOME": str(home)}, capture_output=True, text=True, timeout=900, check=True)
    wall = time.time() - t0
    first = None
    for events in sorted(home.glob("jobs/*/events.jsonl"), key=lambda p: p.stat().st_mtime)[-1:]:
        for line in events.read_text().splitlines():
            e = json.loads(line)
            if e["type"] == "metrics":
                first = e["time"] - e["step_time_s"]
                break
    assert first is not None
    return first - t0, wall


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--submits", type=int, default=5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="tf-bench-") as tmp:
        home = Path(tmp) / "home"
        env = {**os.environ, "TRAINFORGE_HOME": str(home), "PREFECT_HOME": str(Path(tmp) / "prefect"),
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "OMP_NUM_THREADS": "1"}
        os.environ.update({k: env[k] for k in ("TRAINFORGE_HOME", "PREFECT_HOME")})
        from trainforge.datasets.demo import ensure_demo_dataset

        ds = ensure_demo_dataset()
        doc = yaml.safe_load((REPO / "examples" / "tiny-cpu.yaml").read_text())
        doc["training"]["max_steps"] = args.steps
        doc["checkpoint"]["interval_steps"] = args.steps  # one final checkpoint, as a real run ends
        spec_path = Path(tmp) / "bench-job.yaml"  # code.repo "." = this folder; the entrypoint is installed
        spec_path.write_text(yaml.safe_dump(doc))
        try:
            managed, baseline, managed_wall, plain_wall = [], [], [], []
            for i in range(args.repeats):
                s, w = plain(str(ds.path), args.steps, env)
                baseline.append(s)
                plain_wall.append(w)
                s, w = managed_worker(spec_path, home, args.steps, env)
                managed.append(s)
                managed_wall.append(w)
                print(f"round {i + 1}: plain {baseline[-1] * 1e3:.1f} ms/step, managed {managed[-1] * 1e3:.1f} ms/step",
                      flush=True)
            ratio = statistics.median(baseline) / statistics.median(managed)
            print(f"loop: managed {1 / statistics.median(managed):.3f} steps/s vs plain torchrun DDP "
                  f"{1 / statistics.median(baseline):.3f} steps/s -> ratio {ratio:.3f} (target >= 0.97)")
            print(f"launch+train wall (worker only): managed {statistics.median(managed_wall):.1f} s vs plain "
                  f"{statistics.median(plain_wall):.1f} s")
            taxes, walls = [], []
            for _ in range(args.submits):
                tax, wall = submit_to_first_step(spec_path, home, env)
                taxes.append(tax)
                walls.append(wall)
            print(f"submit -> first step: median {statistics.median(taxes):.1f} s over {args.submits} "
                  f"(min {min(taxes):.1f}, max {max(taxes):.1f}); Prefect's temporary server start is inside it")
            print(f"end to end: `trainforge submit` job {statistics.median(walls):.1f} s vs plain torchrun "
                  f"{statistics.median(plain_wall):.1f} s for the same {args.steps} steps -> "
                  f"{statistics.median(walls) / statistics.median(plain_wall):.2f}x")
        finally:
            spec_path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
