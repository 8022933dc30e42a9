"""`trainforge queue` (the live scheduler's running and pending jobs) and `trainforge simulate` (trace replay)."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from trainforge.cli import app
from trainforge.commands.choices import Policy
from trainforge.commands.common import EXIT_UNREADABLE, console, fail, load_cluster_option, print_json
from trainforge.resources import example_path


@app.command()
def queue(
    cluster: Path | None = typer.Option(None, help="Cluster description (default: $TRAINFORGE_CLUSTER, else this "
                                        "machine)."),
    db: str | None = typer.Option(None, help="Scheduler database URL (default: sqlite in $TRAINFORGE_HOME)."),
    as_json: bool = typer.Option(False, "--json", help="Print the rows as JSON."),
) -> None:
    """Show running and pending jobs per team, and why each pending job waits."""
    from rich.table import Table

    from trainforge.infra.scheduler.live import LiveScheduler
    from trainforge.infra.scheduler.state import teams_from_spec

    spec = load_cluster_option(cluster)
    teams = teams_from_spec(spec)
    rows = LiveScheduler(spec, db or os.environ.get("TRAINFORGE_SCHEDULER_URL"), teams=teams or None).queue()
    if as_json:
        print_json(rows)
        return
    if not rows:
        console.print("no jobs running or pending")
        return
    t = Table(title="scheduler queue")
    for col in ("team", "job", "priority", "state", "pos", "GPUs", "type", "nodes", "for", "why waiting"):
        t.add_column(col, justify="right" if col in ("pos", "GPUs", "nodes", "for") else "left")
    for r in rows:
        style = {"running": "green", "preempting": "yellow"}.get(r["state"], "")
        priority = r["priority"] if r["scheduled_as"] == r["priority"] else f"{r['priority']} (as {r['scheduled_as']})"
        t.add_row(r["team"], r["job_id"], priority, f"[{style}]{r['state']}[/]" if style else r["state"],
                  str(r["position"] or "-"), str(r["gpus"]), r["gpu_type"], str(r["nodes"] or "-"),
                  _ago(r["since_s"]), r["reason"])
    console.print(t)


def _ago(s: float) -> str:
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.1f}h"


@app.command()
def simulate(
    cluster: Path = typer.Option(example_path("clusters/fleet-10k.yaml"), help="Cluster YAML, or a node-list CSV "
                                 "(sn,cpu_milli,memory_mib,gpu,model) such as Alibaba's."),
    trace: Path = typer.Option(..., help="Trace CSV in the uniform schema (job_id, submit_time_s, duration_s, "
                               "num_gpus, team, ...; trainforge/infra/simulator/traces.py), e.g. "
                               "examples/traces/synthetic-2k.csv."),
    policy: list[Policy] = typer.Option([Policy.ours], help="Scheduler policy; repeat to compare side by side."),
    failures: str | None = typer.Option(None, help="Random node failures, e.g. `mtbf=5000` (hours per node) "
                                        "`,repair=4` (hours)."),
    spot_waves: str | None = typer.Option(None, "--spot-waves", help="Spot reclamation waves, e.g. "
                                          "`every=6,fraction=0.5,duration=1` (hours)."),
    tail: int = typer.Option(-1, help="Generated large-job tail (256+ GPU gangs) to mix in: -1 = auto "
                             "(1 per 1,000 trace jobs, min 20, on clusters of 2,048+ GPUs), 0 = none."),
    speedup: float = typer.Option(1.0, help="Compress trace arrivals by this factor to raise the load."),
    max_jobs: int | None = typer.Option(None, help="Replay only the first N trace jobs."),
    grace: float = typer.Option(120.0, help="Checkpoint-then-stop grace period for preemption victims (s)."),
    seed: int = typer.Option(0, help="Seed of the generated tail and the random failures."),
    as_json: bool = typer.Option(False, "--json", help="Print the report(s) as JSON."),
) -> None:
    """Replay a job trace through the scheduler policy in a discrete-event simulation.

    \b
    Example:
      trainforge simulate --trace examples/traces/synthetic-2k.csv --policy ours --policy fifo
    """
    from trainforge.infra.scheduler.model import TeamPolicy
    from trainforge.infra.simulator import (
        SimConfig,
        Simulation,
        generate_tail,
        load_node_list,
        load_trace,
        mix,
    )
    from trainforge.infra.simulator.report import render

    teams: dict[str, TeamPolicy] = {}
    if str(cluster).endswith(".csv"):
        nodes, name = load_node_list(cluster), cluster.stem
    else:
        from trainforge.infra.scheduler.state import nodes_from_spec, teams_from_spec

        spec = load_cluster_option(cluster)
        nodes, name = nodes_from_spec(spec), spec.name
        teams = teams_from_spec(spec)
    try:
        tr = load_trace(trace, max_jobs=max_jobs)
        fail_opts = _kv(failures, "failures")
        spot_opts = _kv(spot_waves, "spot-waves")
    except (OSError, ValueError) as exc:
        fail(str(exc), EXIT_UNREADABLE)
    total = sum(n.num_gpus for n in nodes)
    if tail < 0:
        tail = max(20, len(tr.jobs) // 1000) if total >= 2048 else 0
    if tail:
        per_type: dict[str, int] = {}
        for n in nodes:
            per_type[n.gpu_type] = per_type.get(n.gpu_type, 0) + n.num_gpus
        types = [t for t, g in per_type.items() if g >= 256 and t != "cpu"]
        span = max((j.submit_s for j in tr.jobs), default=86400.0) or 86400.0
        gang = max(per_type[t] for t in types) if types else 0
        if types:
            tr = mix(tr, generate_tail(num_jobs=tail, span_s=span, gpu_types=types, max_gang=min(4096, gang // 2),
                                       seed=seed))
    reports = []
    for pol in policy:
        cfg = SimConfig(policy=pol.value, grace_s=grace, speedup=speedup, seed=seed, teams=teams,
                        node_mtbf_hours=fail_opts.get("mtbf"), repair_s=3600 * fail_opts.get("repair", 4.0),
                        spot_every_s=3600 * spot_opts["every"] if "every" in spot_opts else None,
                        spot_fraction=spot_opts.get("fraction", 0.5),
                        spot_duration_s=3600 * spot_opts.get("duration", 1.0))
        reports.append(Simulation(nodes, tr, cfg, name).run())
    if as_json:
        print_json(reports[0] if len(reports) == 1 else reports)
        return
    render(reports, console)


def _kv(text: str | None, option: str) -> dict[str, float]:
    if not text:
        return {}
    out = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--{option}: expected key=number pairs separated by commas, got {part!r}") from None
    return out
