"""Chaos MTTR bench: runs the fault scenarios against a real 2-worker job (tiny model, 24 steps, checkpoint every
8 steps, gloo on CPU) and prints detection latency, MTTR (detection -> first step completed after the restore) and
lost steps per failure class, from the run's own records (events.jsonl + fault markers).

Run: OMP_NUM_THREADS=1 .venv/bin/python bench/chaos_mttr.py [scenario ...]   (about 3 minutes on 2 cores)
"""

from __future__ import annotations

import os
import sys
import tempfile
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


def main(selected: list[str]) -> None:
    from tests.chaos.harness import make_job, measure, run_job

    rows = []
    for i, (name, (fault, restarts, marker, kind)) in enumerate(SCENARIOS.items()):
        if selected and not any(s in name for s in selected):
            continue
        with tempfile.TemporaryDirectory() as home:
            os.environ["TRAINFORGE_HOME"] = home
            job = run_job(make_job(f"bench-chaos-{i}"), fault=fault, max_restarts=restarts)
            rows.append(measure(job, name, marker, kind))
    print(f"\n{'scenario':32} {'detected':12} {'detect s':>9} {'MTTR s':>8} {'lost':>5}  tier")
    for r in rows:
        print(f"{r['scenario']:32} {r['detected'] or '-':12} {r['detection_s'] or 0:9.2f} {r['mttr_s'] or 0:8.2f} "
              f"{r['lost_steps'] if r['lost_steps'] is not None else '-':>5}  {r['tier']}")
    print("(policy: heartbeat 0.25 s / timeout 3 s, hang timeout 4 s; checkpoint interval 8 steps of ~0.1 s)")


if __name__ == "__main__":
    main(sys.argv[1:])
