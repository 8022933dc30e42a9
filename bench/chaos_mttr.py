"""Chaos MTTR bench: runs the fault scenarios against a real 2-worker job (tiny model, 24 steps, checkpoint every
8 steps, gloo on CPU) and prints detection latency, MTTR (detection -> first step completed after the restore) and
lost steps per failure class, from the run's own records (events.jsonl + fault markers).

Multi-node rows run 4 workers as 2 "nodes" of 2 (one torchrun agent per node on this host, one rendezvous),
placed and re-placed by the live scheduler (tests/chaos/harness.py). `baseline` runs the kill -9 scenario under
plain `torchrun --max-restarts=1` with a script that restarts from `torch.save` files (bench/chaos_baseline_worker.py)
and prints it beside trainforge's in-segment restart, as a ratio.

Run: OMP_NUM_THREADS=1 .venv/bin/python bench/chaos_mttr.py [scenario ...]   (about 5 minutes on 2 cores)
     e.g. `bench/chaos_mttr.py baseline`, `bench/chaos_mttr.py node wave outage`
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

SCENARIOS = {
    # name: (fault, max_restarts, fault marker kind, detected kind)
    "kill-9 (in-segment restart)": ("kill:rank=1:step=10", 1, "kill", "rank_lost"),
    "kill-9 (segment retry)": ("kill:rank=1:step=10", 0, "kill", "rank_lost"),
    "SIGSTOP (heartbeat timeout)": ("stop:rank=1:step=10", 1, "stop", "rank_lost"),
    "hang (watchdog + stacks)": ("hang:rank=1:step=10", 0, "hang", "hang"),
    "NaN (rollback + skip)": ("nan:rank=0:step=12", 0, "nan", "divergence"),
    "SIGTERM (emergency ckpt)": ("sigterm:rank=1:step=13", 0, "sigterm", "preemption"),
}
WAVE = ",".join(f"sigterm:rank={r}:step=12" for r in range(4))
MULTI = {
    # name: (fault, fault marker kind, detected kind); 4 workers = 2 nodes x 2, 20 steps
    "node lost (2 of 4 ranks)": ("node:rank=2:step=14", "node", "rank_lost"),
    "spot wave (SIGTERM x4)": (WAVE, "sigterm", "preemption"),
}
ROOT = Path(__file__).resolve().parents[1]


def baseline(interval: int = 8, steps: int = 24, kill_step: int = 10) -> dict:
    """kill -9 of rank 1 at `kill_step` under plain torchrun --max-restarts=1 + torch.save checkpoints."""
    from tests.chaos.harness import make_job

    with tempfile.TemporaryDirectory() as home:
        os.environ["TRAINFORGE_HOME"] = home
        job = make_job("bench-baseline", steps=steps, interval=interval)
        folder = Path(home) / "baseline"
        folder.mkdir()
        cfg = {"model": job.config.model, "steps": steps, "interval": interval, "batch": 8, "seq_len": 64,
               "kill_rank": 1, "kill_step": kill_step, "dir": str(folder)}
        env = {**os.environ, "BASELINE_CONFIG": json.dumps(cfg), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=1",
               "--master-addr=127.0.0.1", f"--master-port={_port()}", str(ROOT / "bench/chaos_baseline_worker.py")]
        t0 = time.monotonic()
        with open(folder / "torchrun.log", "wb") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = proc.wait(timeout=120)
            except subprocess.TimeoutExpired:  # the agent and its workers (each in its own session): no orphans
                import psutil

                for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
                    p.kill()
                proc.wait(timeout=10)
                code = None
        evs = [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines()]
        killed = next(e for e in evs if e["event"] == "killed")
        restart = [e for e in evs if e["event"] == "start" and e["time"] > killed["time"]]
        reached = max(e["step"] for e in evs if e["event"] == "step" and e["time"] < killed["time"])
        first = min((e["time"] for e in evs if e["event"] == "step" and e["time"] > killed["time"]), default=None)
        resumed = restart[0]["resumed_from"] if restart else None
        out = {"scenario": "baseline: torchrun --max-restarts=1 + torch.save", "exit_code": code,
               "fault_to_step_s": round(first - killed["time"], 2) if first else None,
               "lost_steps": reached - resumed if resumed is not None else None,
               "resumed_from": resumed, "wall_s": round(time.monotonic() - t0, 1)}
        print(f"CHAOS {out['scenario']}: kill -9 rank 1 at step {kill_step}: fault->first step after restore "
              f"{out['fault_to_step_s']}s lost_steps={out['lost_steps']} (resumed from {resumed}) exit={code} "
              f"wall={out['wall_s']}s")
        return out


def _port() -> int:
    from trainforge.infra.backends.local import free_port

    return free_port()


def compare_baseline() -> None:
    from tests.chaos.harness import make_job, measure, run_job

    with tempfile.TemporaryDirectory() as home:
        os.environ["TRAINFORGE_HOME"] = home
        job = run_job(make_job("bench-chaos-kill"), fault="kill:rank=1:step=10", max_restarts=1)
        ours = measure(job, "trainforge kill -9 (in-segment restart)", "kill", "rank_lost")
    base = baseline()
    total = (ours["detection_s"] or 0) + (ours["mttr_s"] or 0)
    if base["fault_to_step_s"] is None:
        print(f"baseline did not recover within 120 s (exit {base['exit_code']}); trainforge: {total:.2f}s, "
              f"{ours['lost_steps']} lost steps")
        return
    print(f"\n{'kill -9 rank 1 at step 10 (24 steps, ckpt every 8)':52} {'fault->step s':>13} {'lost':>5}")
    print(f"{'trainforge (heartbeats + torchrun restart + replica)':52} {total:13.2f} {ours['lost_steps']:>5}")
    print(f"{'baseline (torchrun --max-restarts=1 + torch.save)':52} {base['fault_to_step_s']:13.2f} "
          f"{base['lost_steps']:>5}")
    print(f"ratio baseline/trainforge: MTTR {base['fault_to_step_s'] / max(total, 1e-9):.2f}x, lost steps "
          f"{base['lost_steps']} vs {ours['lost_steps']}")


def multi_node(selected: list[str]) -> list[dict]:
    from tests.chaos.harness import make_job, measure, run_job

    rows = []
    for i, (name, (fault, marker, kind)) in enumerate(MULTI.items()):
        if selected and not any(s in name for s in selected):
            continue
        with tempfile.TemporaryDirectory() as home:
            os.environ["TRAINFORGE_HOME"] = home
            job = run_job(make_job(f"bench-multi-{i}", steps=20, interval=4, workers=4), fault=fault,
                          max_retries=1)
            row = measure(job, name, marker, kind)
            row["placements"] = job.placements
            print(f"  placements {job.placements}, re-gang {job.regang_s}s")
            rows.append(row)
    return rows


def main(selected: list[str]) -> None:
    from tests.chaos.harness import make_job, measure, run_job

    if "baseline" in selected:
        compare_baseline()
        selected = [s for s in selected if s != "baseline"]
        if not selected:
            return
    rows = []
    for i, (name, (fault, restarts, marker, kind)) in enumerate(SCENARIOS.items()):
        if selected and not any(s in name for s in selected):
            continue
        with tempfile.TemporaryDirectory() as home:
            os.environ["TRAINFORGE_HOME"] = home
            job = run_job(make_job(f"bench-chaos-{i}"), fault=fault, max_restarts=restarts)
            rows.append(measure(job, name, marker, kind))
    if not selected or any(s in n for s in selected for n in MULTI):
        rows += multi_node(selected)
    print(f"\n{'scenario':32} {'detected':12} {'detect s':>9} {'MTTR s':>8} {'lost':>5}  tier")
    for r in rows:
        print(f"{r['scenario']:32} {r['detected'] or '-':12} {r['detection_s'] or 0:9.2f} {r['mttr_s'] or 0:8.2f} "
              f"{r['lost_steps'] if r['lost_steps'] is not None else '-':>5}  {r['tier']}")
    print("(policy: heartbeat 0.25 s / timeout 3 s, hang timeout 4 s; checkpoint interval 8 steps of ~0.1 s)")


if __name__ == "__main__":
    main(sys.argv[1:])
