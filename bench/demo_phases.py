"""Where `make demo`'s time goes: install, dataset, and the demo job's phases, from a fresh clone.

With `--fresh-clone` (what a newcomer runs): the checkout is cloned into a temporary folder and `make demo` is
replayed there step by step, each step timed: the virtual environment, torch's CPU wheel, the project and the
extra the demo needs, then `trainforge demo` in a home of its own. Without it, only the demo, with this checkout's
.venv, in a fresh home (the dataset is built again). pip's cache is left as it is: say which you measured.

The demo's phases come from what the demo leaves behind, not from a timer inside it: the dataset's catalog entry
(its mtime), the job record (`created_at`, each segment's `started_at` / `ended_at`, `completed_at`) and the job's
events (`segment_start` once the workers have restored and begin, the first `metrics`, `segment_end`):

  cli+dataset   the command's start to the dataset's catalog entry (interpreter, imports, the dataset build)
  to job        dataset to the job record (Prefect's temporary server, the flow run's start)
  prepare       the record to the segment's launch (validate, resolve, plan, provision)
  workers up    the launch to `segment_start` (torchrun, each worker's imports, the rendezvous)
  first step    `segment_start` to the first step's metrics
  training      the first step to `segment_end` (the steps, the checkpoints)
  after         `segment_end` to the job's `completed_at` (the last commit, evaluation, export, promotion)
  exit          `completed_at` to the command's exit (the servers' shutdown)

Run: .venv/bin/python bench/demo_phases.py [--fresh-clone [--rev COMMIT]] [--repeat N]
     (the baseline: --fresh-clone --rev 5ca88b9, main before `make demo` was cut down; about 3 minutes each)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("cli+dataset", "to job", "prepare", "workers up", "first step", "training", "after", "exit")


def timed(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> float:
    t = time.monotonic()
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return time.monotonic() - t


def install(clone: Path) -> dict[str, float]:
    """`make demo`'s install, step by step, as the Makefile's demo stamp does it."""
    steps = make_steps(clone)
    out = {}
    for name, argv in steps:
        out[name] = timed(argv, clone)
    return out


def make_steps(clone: Path) -> list[tuple[str, list[str]]]:
    """The demo stamp's recipe lines from the clone's Makefile (`make -n`), each a timed step: what a newcomer's
    `make demo` runs, not a copy of it."""
    # the demo's own stamp where the Makefile has one; before it had, `make demo` built the whole dev set
    stamp = ".venv/.installed-demo" if ".installed-demo" in (clone / "Makefile").read_text() else ".venv/.installed"
    listing = subprocess.run(["make", "-n", "-B", stamp], cwd=clone, capture_output=True,
                             text=True, timeout=60, check=True).stdout
    steps = []
    for line in listing.replace("\\\n", " ").splitlines():  # a recipe line continued with a backslash is one
        line = line.strip()
        if not line or line.startswith(("#", "touch", "echo")):
            continue
        name = ("venv" if " -m venv " in line else "pip" if "--upgrade pip" in line else
                "torch" if "torch==" in line else "project" if " -e " in line else
                "compile" if "compileall" in line else line.split()[0])
        steps.append((name, ["sh", "-c", line]))
    return steps


def demo(venv_bin: Path, cwd: Path) -> dict[str, float]:
    home = Path(tempfile.mkdtemp(prefix="demo-home-"))
    try:
        env = {**os.environ, "TRAINFORGE_HOME": str(home)}
        env.pop("PREFECT_API_URL", None)  # the demo's own temporary server, as on a fresh machine
        t0 = time.time()
        done = subprocess.run([str(venv_bin / "trainforge"), "demo", "--json"], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=1800)
        t_end = time.time()
        if done.returncode != 0:
            sys.exit(f"trainforge demo failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        [job] = list((home / "jobs").iterdir())
        record = json.loads((job / "job.json").read_text())
        events = [json.loads(line) for line in (job / "events.jsonl").read_text().splitlines()]
        catalog = sorted(home.glob("datasets/**/*.json"), key=lambda p: p.stat().st_mtime)
        dataset_at = catalog[-1].stat().st_mtime if catalog else t0
        seg = record["segments"][0]
        start = next(e["time"] for e in events if e["type"] == "segment_start")
        first = next(e["time"] for e in events if e["type"] == "metrics")
        end = next(e["time"] for e in events if e["type"] == "segment_end")
        marks = [t0, dataset_at, record["created_at"], seg["started_at"], start, first, end,
                 record["completed_at"], t_end]
        out = {name: b - a for name, a, b in zip(PHASES, marks[:-1], marks[1:], strict=True)}
        out["demo"] = t_end - t0
        out["job"] = record["completed_at"] - record["created_at"]
        return out
    finally:
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fresh-clone", action="store_true", help="clone, install and run as `make demo` does")
    ap.add_argument("--repeat", type=int, default=1, help="demo runs (the install is timed once)")
    ap.add_argument("--rev", default="HEAD", help="with --fresh-clone: the commit to clone (a baseline's)")
    args = ap.parse_args()
    rows: list[dict[str, float]] = []
    if args.fresh_clone:
        parent = Path(tempfile.mkdtemp(prefix="demo-clone-"))
        try:
            clone = parent / "trainforge"
            subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=300)
            subprocess.run(["git", "-C", str(clone), "checkout", "--quiet", args.rev], check=True, timeout=60)
            steps = install(clone)
            for _ in range(args.repeat):
                rows.append(demo(clone / ".venv" / "bin", clone))
        finally:
            shutil.rmtree(parent, ignore_errors=True)
        total = sum(steps.values())
        print("install (fresh clone, pip's cache as it is): " + ", ".join(f"{k} {v:.1f} s" for k, v in
                                                                          steps.items()) + f"; total {total:.1f} s")
    else:
        steps, total = {}, 0.0
        for _ in range(args.repeat):
            rows.append(demo(ROOT / ".venv" / "bin", ROOT))
    for name in (*PHASES, "job", "demo"):
        values = [r[name] for r in rows]
        print(f"{name:12} {statistics.median(values):6.1f} s" + (f"   (runs: {', '.join(f'{v:.1f}' for v in values)})"
                                                                if len(values) > 1 else ""))
    if args.fresh_clone:
        print(f"make demo    {total + statistics.median(r['demo'] for r in rows):6.1f} s   (install + demo)")


if __name__ == "__main__":
    main()
