"""Replays where queues form: each public trace on a cluster sized to its own offered load, the policies side by
side, runtime estimates learned (no oracle) and, for the policies that read estimates, the oracle too. Prints
the table docs/scheduler.md carries; every ratio is against FIFO measured in the same run.

- Offered load = the trace's GPU-seconds over its arrival span (every job at its full size). The cluster is sized
  so that this is `--load` (default 0.9) of its GPUs: nothing is compressed and nothing generated.
  - Philly (50k jobs, 35 days): that many 8-GPU nodes, one GPU type.
  - Alibaba openb 2023: its own heterogeneous node list cut down to the same number of GPUs, each GPU model
    keeping its share of the GPUs (largest remainder, at least one node of the largest node size).
- Priorities: every job `normal` (neither trace records one; the hash fill of `load_trace` is not used here, so
  no policy gains from priority classes). Teams: Philly's virtual clusters, Alibaba's QoS classes; weight 1 each.
- `las` and `fifo` read no estimates: one row each. `fifo-backfill` and `ours` run with `history` (what the
  platform learns from ended jobs, the default) and `oracle` (1.5 x the true runtime, for comparison only).

Run: .venv/bin/python bench/scheduler_queues.py [--traces philly,alibaba] [--load 0.9] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table

from trainforge.infra.scheduler.state import NodeInfo
from trainforge.infra.simulator import SimConfig, Simulation, Trace, load_trace
from trainforge.infra.simulator.traces import load_node_list

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
RUNS = [("fifo", "-"), ("fifo-backfill", "history"), ("fifo-backfill", "oracle"), ("las", "-"),
        ("ours", "history"), ("ours", "oracle")]


def offered_gpus(trace: Trace) -> float:
    span = max(j.submit_s for j in trace.jobs) - min(j.submit_s for j in trace.jobs)
    return sum(j.num_gpus * j.duration_s for j in trace.jobs) / span


def all_normal(trace: Trace) -> Trace:
    jobs = [dataclasses.replace(j, priority="normal") for j in trace.jobs]
    return Trace(jobs, trace.source, [n for n in trace.notes if "priority" not in n]
                 + ["every job normal priority (the trace has none)"])


def sized_nodes(nodes: list[NodeInfo], gpus: int) -> list[NodeInfo]:
    """`nodes` cut to about `gpus` GPUs, each GPU model keeping its share (largest remainder over models, then
    that model's nodes in file order); at least one node of the largest size, so that every job still fits."""
    by_model: dict[str, list[NodeInfo]] = {}
    for n in nodes:
        by_model.setdefault(n.gpu_type, []).append(n)
    total = sum(n.num_gpus for n in nodes)
    share = {m: gpus * sum(n.num_gpus for n in ns) / total for m, ns in by_model.items()}
    out: list[NodeInfo] = []
    for m, ns in sorted(by_model.items(), key=lambda kv: -share[kv[0]]):
        want, got = share[m], 0
        for n in ns:
            if got + n.num_gpus / 2 > want:
                break
            out.append(n)
            got += n.num_gpus
    biggest = max(nodes, key=lambda n: n.num_gpus)
    if not any(n.num_gpus == biggest.num_gpus for n in out):
        out.append(biggest)
    return out


def settings(name: str, load: float) -> tuple[Trace, list[NodeInfo], str]:
    if name == "philly":
        trace = all_normal(load_trace(TRACES / "philly_jobs_50k.csv"))
        n = math.ceil(offered_gpus(trace) / load / 8)
        nodes = [NodeInfo(f"n{i}", "v100", 8, f"r{i // 16}") for i in range(n)]
    elif name == "alibaba":
        trace = all_normal(load_trace(TRACES / "alibaba_openb_2023_jobs.csv"))
        nodes = sized_nodes(load_node_list(TRACES / "alibaba_openb_node_list_gpu_node.csv"),
                            round(offered_gpus(trace) / load))
    else:
        raise SystemExit(f"--traces: unknown trace {name!r}; use philly or alibaba")
    gpus = sum(n.num_gpus for n in nodes)
    mix = ", ".join(f"{m} {g}" for m, g in Counter(n.gpu_type for n in nodes for _ in range(n.num_gpus)).items())
    what = (f"{name}: {len(trace.jobs):,} jobs, offered load {offered_gpus(trace):,.1f} GPUs on {len(nodes)} nodes / "
            f"{gpus} GPUs ({mix}) = {offered_gpus(trace) / gpus:.0%}")
    return trace, nodes, what


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--traces", default="philly,alibaba")
    ap.add_argument("--load", type=float, default=0.9)
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args()
    console = Console(width=150)
    results = []
    for name in args.traces.split(","):
        trace, nodes, what = settings(name, args.load)
        console.print(what)
        rows = []
        for policy, estimates in RUNS:
            t0 = time.perf_counter()
            cfg = SimConfig(policy=policy, estimates="oracle" if estimates == "oracle" else "history")
            report = Simulation(nodes, trace, cfg, f"{name}-sized").run()
            wall = time.perf_counter() - t0
            rows.append((policy, estimates, report, wall))
            console.print(f"  {policy} ({estimates}): {wall:.1f} s", highlight=False)
        fifo = rows[0][2]
        table = Table(title=what, title_justify="left")
        for col in ("policy", "estimates", "avg JCT h", "vs FIFO", "p99 JCT h", "vs FIFO", "util (arriving)",
                    "Jain", "vs FIFO", "preemptions", "replay s"):
            table.add_column(col, justify="left" if col in ("policy", "estimates") else "right")
        for policy, estimates, r, wall in rows:
            table.add_row(policy, estimates, f"{r['jct_s']['mean'] / 3600:.2f}",
                          f"{r['jct_s']['mean'] / fifo['jct_s']['mean']:.2f}", f"{r['jct_s']['p99'] / 3600:.1f}",
                          f"{r['jct_s']['p99'] / fifo['jct_s']['p99']:.2f}", f"{r['utilization_while_arriving']:.1%}",
                          f"{r['fairness_jain']:.3f}", f"{r['fairness_jain'] / fifo['fairness_jain']:.2f}",
                          f"{r['preemptions']:,}", f"{wall:.1f}")
            results.append({"trace": name, "setting": what, "policy": policy, "estimates": estimates,
                            "replay_s": round(wall, 2), **{k: r[k] for k in (
                                "completed", "unfinished", "jct_s", "wait_s", "utilization",
                                "utilization_while_arriving", "fairness_jain", "preemptions", "lost_gpu_h")}})
        console.print(table)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
