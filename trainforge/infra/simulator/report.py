"""Simulation metrics: utilization, goodput, JCT and queue wait percentiles per priority and team, Jain's fairness,
preemptions, work lost, decision latency, cost (allocated GPU-hours priced per GPU type and market, per team);
as a dict (JSON) and as rich tables."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Protocol

from trainforge.infra.cost import load_prices
from trainforge.infra.scheduler.policy import Scheduler
from trainforge.infra.scheduler.state import ClusterState
from trainforge.infra.simulator.traces import Trace

PRIORITY_ORDER = ["critical", "high", "normal", "low", "preemptible"]


class FinishedSimulation(Protocol):
    """What the report reads of a finished simulation (`engine.Simulation` is one). A protocol rather than an
    import of the engine, which calls `summarize` at the end of its run: the report stays below it."""

    cluster_name: str
    config: Any  # engine.SimConfig: the policy and the arrival speed-up
    trace: Trace
    state: ClusterState
    sched: Scheduler
    runs: dict[str, Any]  # job id -> engine._Run (its trace job, submit / first start / end times, allocation)
    now: float
    t0: float
    last_submit: float
    busy_integral: float
    arrival_integral: float | None
    latencies: list[float]
    lost: dict[str, float]
    gpu_seconds: dict[tuple[str, str, str], float]
    counts: dict[str, int]


def percentiles(values: list[float]) -> dict[str, float | int]:
    if not values:
        return {"n": 0}
    v = sorted(values)

    def p(q: float) -> float:
        return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]

    return {"n": len(v), "p50": round(p(0.50), 1), "p95": round(p(0.95), 1), "p99": round(p(0.99), 1),
            "mean": round(sum(v) / len(v), 1)}


def jain(xs: list[float]) -> float:
    xs = [x for x in xs if x > 0]
    return (sum(xs) ** 2) / (len(xs) * sum(x * x for x in xs)) if xs else 1.0


def cost_summary(gpu_seconds: dict[tuple[str, str, str], float], useful_gpu_s: float, lost_gpu_s: float,
                 prices: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Dollars of a simulated schedule: allocated GPU-seconds per (team, GPU type, market) at the price table's
    $/GPU-h (spot nodes at the spot price). GPU types without a price are reported, never guessed."""
    by_type: dict[str, dict[str, float]] = defaultdict(lambda: {"gpu_h": 0.0, "spot_gpu_h": 0.0, "usd": 0.0})
    by_team: dict[str, float] = defaultdict(float)
    unpriced: dict[str, float] = defaultdict(float)
    for (team, gpu_type, market), secs in gpu_seconds.items():
        hours = secs / 3600
        row = by_type[gpu_type]
        row["gpu_h"] += hours
        row["spot_gpu_h"] += hours if market == "spot" else 0.0
        if gpu_type not in prices:
            unpriced[gpu_type] += hours
            continue
        usd = hours * float(prices[gpu_type][market])
        row["usd"] += usd
        by_team[team] += usd
    total_h = sum(gpu_seconds.values()) / 3600
    priced_h = total_h - sum(unpriced.values())
    usd = sum(by_team.values())
    mean_price = usd / priced_h if priced_h > 0 else 0.0
    return {
        "allocated_gpu_h": round(total_h, 1),
        "usd": round(usd, 2),
        "usd_per_useful_gpu_h": round(usd / (useful_gpu_s / 3600), 4) if useful_gpu_s > 0 else None,
        # Lost work is booked in GPU-seconds without a type: priced at the schedule's mean $/GPU-h.
        "lost_usd": round(lost_gpu_s / 3600 * mean_price, 2),
        "by_gpu_type": {t: {k: round(v, 2) for k, v in row.items()} for t, row in sorted(by_type.items())},
        "by_team": {t: round(v, 2) for t, v in sorted(by_team.items(), key=lambda kv: -kv[1])},
        "unpriced_gpu_h": {t: round(h, 1) for t, h in sorted(unpriced.items())},
    }


def summarize(sim: FinishedSimulation, wall_s: float) -> dict[str, Any]:
    done = [r for r in sim.runs.values() if not math.isnan(r.end)]
    end = max((r.end for r in done), default=sim.now)
    span = max(end - sim.t0, 1e-9)
    installed = sum(n.num_gpus for n in sim.state.nodes)
    useful = sum(r.tj.duration_s * r.tj.num_gpus for r in done)
    groups: dict[str, dict[str, list[tuple[float, float]]]] = {"priority": defaultdict(list), "team": defaultdict(list)}
    for r in done:
        jct, wait = r.end - r.submit, r.first_start - r.submit
        groups["priority"][r.tj.priority].append((jct, wait))
        groups["team"][r.tj.team].append((jct, wait))
    slowdown = {t: sum(min(1.0, r.tj.duration_s / max(r.end - r.submit, 1e-9)) for r in rs) / len(rs)
                for t, rs in _by_team(done).items()}
    lat = [x * 1000 for x in sim.latencies]

    def table(key: str) -> dict[str, Any]:
        names = groups[key]
        order = [p for p in PRIORITY_ORDER if p in names] if key == "priority" else sorted(names)
        return {n: {"jct_s": percentiles([j for j, _ in names[n]]), "wait_s": percentiles([w for _, w in names[n]])}
                for n in order}

    tail = [r for r in sim.runs.values() if r.tj.generated]
    billed = dict(sim.gpu_seconds)
    for r in sim.runs.values():  # allocations still open when the simulation stopped
        for (gpu_type, market), gpus in r.alloc.items():
            key = (r.tj.team, gpu_type, market)
            billed[key] = billed.get(key, 0.0) + gpus * (sim.now - r.alloc_since)
    cost = cost_summary(billed, useful, sum(sim.lost.values()), load_prices()[0])
    stats = sim.sched.stats
    return {
        "cluster": sim.cluster_name, "gpus": installed, "policy": sim.config.policy, "trace": sim.trace.source,
        "notes": sim.trace.notes + ([f"arrivals compressed {sim.config.speedup:g}x"] if sim.config.speedup != 1
                                    else []),
        "jobs": len(sim.trace.jobs), "completed": len(done), "unfinished": len(sim.runs) - len(done),
        "rejected": sim.counts["rejected"], "generated_tail_jobs": len(tail),
        "makespan_h": round(span / 3600, 2),
        "utilization": round(sim.busy_integral / (installed * span), 4),
        "utilization_while_arriving": round((sim.arrival_integral or 0.0)
                                            / (installed * max(sim.last_submit - sim.t0, 1e-9)), 4),
        "goodput": round(useful / (installed * span), 4),
        "useful_gpu_h": round(useful / 3600, 1),
        "lost_gpu_h": {k: round(v / 3600, 1) for k, v in sim.lost.items()},
        "preemptions": stats["preemptions"], "kills_after_grace": stats["kills"], "requeues": stats["requeues"],
        "replacements": stats["replacements"], "shrinks": stats["shrinks"], "grows": stats["grows"],
        "node_failures": sim.counts["node_failures"], "spot_reclaims": sim.counts["spot_reclaims"],
        "jct_s": percentiles([r.end - r.submit for r in done]),
        "wait_s": percentiles([r.first_start - r.submit for r in done]),
        "by_priority": table("priority"), "by_team": table("team"),
        "fairness_jain": round(jain(list(slowdown.values())), 4),
        "fairness_definition": "Jain's index over teams of mean(duration / JCT) of their jobs",
        "decision_latency_ms": {"n": len(lat), **{k: round(v, 3) for k, v in percentiles(lat).items() if k != "n"},
                                "max": round(max(lat), 3) if lat else 0.0},
        "cost": cost,
        "wall_s": round(wall_s, 2),
    }


def _by_team(runs: list[Any]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = defaultdict(list)
    for r in runs:
        out[r.tj.team].append(r)
    return out


def render(reports: list[dict[str, Any]], console: Any, *, max_teams: int = 12) -> None:
    """Side-by-side summary (one column per policy), then per-priority and per-team tables for each report."""
    from rich.table import Table

    first = reports[0]
    console.print(f"[bold]{first['trace']}[/] on [bold]{first['cluster']}[/] ({first['gpus']:,} GPUs)")
    for note in first["notes"]:
        console.print(f"  [dim]- {note}[/]")
    t = Table(title="summary")
    t.add_column("metric")
    for r in reports:
        t.add_column(r["policy"], justify="right")
    rows = [
        ("jobs completed / unfinished", lambda r: f"{r['completed']:,} / {r['unfinished']:,}"),
        ("utilization", lambda r: f"{100 * r['utilization']:.1f}%"),
        ("utilization while jobs arrive", lambda r: f"{100 * r['utilization_while_arriving']:.1f}%"),
        ("goodput", lambda r: f"{100 * r['goodput']:.1f}%"),
        ("makespan (h)", lambda r: f"{r['makespan_h']:,.1f}"),
        ("JCT p50 / p95 / p99 (h)", lambda r: _pct_h(r["jct_s"])),
        ("wait p50 / p95 / p99 (h)", lambda r: _pct_h(r["wait_s"])),
        ("Jain fairness (teams)", lambda r: f"{r['fairness_jain']:.3f}"),
        ("preemptions (killed after grace)", lambda r: f"{r['preemptions']} ({r['kills_after_grace']})"),
        ("GPU-h lost: failures / preemption", lambda r: f"{r['lost_gpu_h']['failure']:,.0f} / "
                                                        f"{r['lost_gpu_h']['preemption']:,.0f}"),
        ("node failures / spot reclaims", lambda r: f"{r['node_failures']} / {r['spot_reclaims']}"),
        ("requeues / replacements", lambda r: f"{r['requeues']} / {r['replacements']}"),
        ("elastic shrinks / grows", lambda r: f"{r['shrinks']} / {r['grows']}"),
        ("cost $ (per useful GPU-h)", lambda r: f"{r['cost']['usd']:,.0f} ({_usd(r['cost']['usd_per_useful_gpu_h'])})"),
        ("cost $ of lost work", lambda r: f"{r['cost']['lost_usd']:,.0f}"),
        ("decision latency p50 / p99 / max (ms)", lambda r: "{p50:.2f} / {p99:.2f} / {max:.1f}".format(
            **{"p50": 0, "p99": 0, **r["decision_latency_ms"]})),
        ("simulation wall time (s)", lambda r: f"{r['wall_s']:.1f}"),
    ]
    for name, fmt in rows:
        t.add_row(name, *(fmt(r) for r in reports))
    console.print(t)
    unpriced = sorted({g for r in reports for g in r["cost"]["unpriced_gpu_h"]})
    if unpriced:
        console.print(f"  [yellow]no price for GPU type(s) {', '.join(unpriced)}: their GPU-hours are not in the cost "
                      "(set $TRAINFORGE_PRICES)[/]")
    console.print("  [dim]cost: allocated GPU-hours x list price per GPU type (infra/cost.py, or $TRAINFORGE_PRICES);"
                  " spot nodes at the spot price[/]")
    for key, title in (("by_priority", "priority class"), ("by_team", "team")):
        t = Table(title=f"JCT / queue wait p50 / p95 / p99 (h) per {title}")
        t.add_column(title)
        for r in reports:
            t.add_column(f"{r['policy']} JCT", justify="right")
            t.add_column(f"{r['policy']} wait", justify="right")
        names = list(first[key])[:max_teams]
        for n in names:
            cells = []
            for r in reports:
                g = r[key].get(n)
                cells += [_pct_h(g["jct_s"]), _pct_h(g["wait_s"])] if g else ["-", "-"]
            t.add_row(f"{n} ({first[key][n]['jct_s']['n']})", *cells)
        if len(first[key]) > max_teams:
            t.caption = f"{len(first[key]) - max_teams} more in --json"
        console.print(t)


def _usd(v: float | None) -> str:
    return "-" if v is None else f"${v:.2f}"


def _pct_h(p: dict[str, Any]) -> str:
    if not p.get("n"):
        return "-"
    return f"{p['p50'] / 3600:.2f} / {p['p95'] / 3600:.2f} / {p['p99'] / 3600:.2f}"
