"""The flood with priorities (docs/scheduler.md, "No gang starves"): on 64 GPUs (8 nodes x 8), team `flood` keeps
the cluster full for two days with 1-8 GPU jobs, 5%, 25% or 50% of them `high`; the idle team `gang` (same weight)
submits one `normal` gang an hour in. Prints the gang's wait under `ours`, `fifo` and `kueue` for each fraction and
seed, against the bound (patience 1 h + the flood's checkpoint interval 30 min + grace 2 min) and against FIFO in
the same run. A generated workload (simulator/scenarios.py), not a trace: it is the worst case the bound is about,
one team flooding, not a typical mix.

Run: .venv/bin/python bench/scheduler_flood.py [--gangs 64,32] [--seeds 0-4] [--json out.json]   (~3-4 min)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from rich.console import Console
from rich.table import Table

from trainforge.infra.simulator.scenarios import H, flood_nodes, flood_trace, gang, gang_bound_s, gang_wait

FRACTIONS = (0.05, 0.25, 0.5)
POLICIES = ("ours", "fifo", "kueue")
PATIENCE_S, INTERVAL_S, GRACE_S = H, 1800.0, 120.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gangs", default="64,32", help="gang sizes, GPUs")
    ap.add_argument("--seeds", default="0-4", help="flood seeds, a range a-b")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    lo, hi = (int(x) for x in args.seeds.split("-"))
    bound = gang_bound_s(PATIENCE_S, INTERVAL_S, GRACE_S)
    nodes = flood_nodes(8)
    rows = []
    t0 = time.monotonic()
    for size in (int(g) for g in args.gangs.split(",")):
        for frac in FRACTIONS:
            for seed in range(lo, hi + 1):
                jobs = flood_trace(seed, high_fraction=frac, checkpoint_interval_s=INTERVAL_S) + [gang(size)]
                waits = {}
                for policy in POLICIES:
                    run, _ = gang_wait(policy, jobs, nodes, patience_s=PATIENCE_S, grace_s=GRACE_S)
                    waits[policy] = run.wait_s
                    if policy == "ours":
                        lost, kills = run.lost_to_preemption_gpu_s, run.kills
                rows.append({"gang_gpus": size, "high_fraction": frac, "seed": seed, **{f"{p}_h": waits[p] / H
                                                                                        for p in POLICIES},
                             "bound_h": bound / H, "ours_lost_gpu_s": lost, "ours_kills": kills})
    table = Table(title=f"the idle team's gang on 64 GPUs: wait in hours (bound {bound / H:.2f} h), "
                        f"{time.monotonic() - t0:.0f} s")
    for col in ("gang GPUs", "high", "ours max", "ours mean", "within bound", "fifo mean", "ours/fifo",
                "kueue mean", "kueue/fifo"):
        table.add_column(col, justify="right")
    for size in sorted({r["gang_gpus"] for r in rows}, reverse=True):
        for frac in FRACTIONS:
            rs = [r for r in rows if r["gang_gpus"] == size and r["high_fraction"] == frac]
            ours = [r["ours_h"] for r in rs]
            fifo = statistics.mean(r["fifo_h"] for r in rs)
            kueue = statistics.mean(r["kueue_h"] for r in rs)
            table.add_row(str(size), f"{frac:.0%}", f"{max(ours):.2f}", f"{statistics.mean(ours):.2f}",
                          f"{sum(o <= bound / H + 1e-9 for o in ours)}/{len(ours)}", f"{fifo:.2f}",
                          f"{statistics.mean(ours) / fifo:.2f}", f"{kueue:.2f}", f"{kueue / fifo:.1f}")
    Console(width=140).print(table)
    print(f"ours: work lost to preemption {sum(r['ours_lost_gpu_s'] for r in rows):.0f} GPU-s, "
          f"{sum(r['ours_kills'] for r in rows)} victims killed after their grace period")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
