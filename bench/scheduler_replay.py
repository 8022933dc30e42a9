"""Replay the Philly 50k-job trace through `ours`, `fifo` and `fifo-backfill`, side by side.

The trace alone loads a 10,240-GPU fleet to ~6% (486k GPU-h over 35 days, 95% single-GPU jobs), so by default it
is replayed on the fleet with arrivals compressed 12x and a generated large-job tail (256..4,096-GPU gangs; said in
the output), with random node failures (MTBF 5,000 h per node) and spot waves on the fleet's spot rack.
Target: each 50k replay in under 2 minutes.

Run: .venv/bin/python bench/scheduler_replay.py [--speedup 12] [--tail 50] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rich.console import Console

from trainforge.infra.scheduler.state import nodes_from_spec
from trainforge.infra.simulator import SimConfig, Simulation, generate_tail, load_trace, mix
from trainforge.infra.simulator.report import render
from trainforge.plan.cluster import load_cluster

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cluster", default=str(ROOT / "examples" / "clusters" / "fleet-10k.yaml"))
    ap.add_argument("--trace", default=str(ROOT.parent / "shared" / "traces" / "philly_jobs_50k.csv"))
    ap.add_argument("--speedup", type=float, default=12.0)
    ap.add_argument("--tail", type=int, default=50)
    ap.add_argument("--policies", default="ours,fifo,fifo-backfill")
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args()
    cluster = load_cluster(args.cluster)
    trace = load_trace(args.trace)
    span = max(j.submit_s for j in trace.jobs)
    if args.tail:
        trace = mix(trace, generate_tail(num_jobs=args.tail, span_s=span, gpu_types=["h100", "h200", "a100-80gb"],
                                         max_gang=4096))
    reports = []
    for policy in args.policies.split(","):
        t0 = time.perf_counter()
        cfg = SimConfig(policy=policy, speedup=args.speedup, node_mtbf_hours=5000, spot_every_s=6 * 3600)
        reports.append(Simulation(nodes_from_spec(cluster), trace, cfg, cluster.name).run())
        print(f"{policy}: {len(trace.jobs):,} jobs replayed in {time.perf_counter() - t0:.1f} s", flush=True)
    render(reports, Console(width=170))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(reports, indent=2))


if __name__ == "__main__":
    main()
