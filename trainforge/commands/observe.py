"""`trainforge watch | compare | report | metric | cost | profile`: live metrics, run comparisons, the per-job HTML
report, the metrics API of HPO drivers, chargeback, on-demand profiling."""

from __future__ import annotations

import csv
import json
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import typer

from trainforge.cli import app
from trainforge.commands.choices import Market, MetricMode
from trainforge.commands.common import JOB_HELP, console, fail, job_lookup_failed, print_json, resolve_job

FINAL_STATES = ("completed", "failed", "cancelled")


def _record(job: str) -> Any:
    return resolve_job(job)


# ---- watch ------------------------------------------------------------------------------------------------------

class LiveState:
    """The latest of each event kind, folded from the job's events file (incrementally)."""

    def __init__(self, events_path: Path):
        self.path, self.offset = events_path, 0
        self.metrics: dict[str, Any] = {}
        self.ranks: dict[str, Any] = {}
        self.system: dict[str, Any] = {}
        self.meta: dict[str, Any] = {}
        self.stall_s = 0.0

    def update(self) -> None:
        from trainforge.contract.events import CheckpointStaged, Metrics, MetricsMeta, RankMetrics, System
        from trainforge.events import read_typed_events

        events, self.offset, _ = read_typed_events(self.path, self.offset)  # a line it cannot read: not shown
        for ev in events:
            match ev:
                case Metrics():
                    self.metrics = {"step": ev.step, **ev.values()}
                case RankMetrics():
                    self.ranks = {"step": ev.step, **ev.values()}
                case System():
                    self.system = {"step": ev.step, "source": ev.source, **ev.values()}
                case MetricsMeta():
                    self.meta = ev.model_dump()
                case CheckpointStaged():
                    self.stall_s += ev.blocked_s


def snapshot(record_data: dict[str, Any], live: LiveState) -> dict[str, Any]:
    """What `watch` shows, as data (`watch --json`)."""
    return {"job_id": record_data.get("job_id"), "state": record_data.get("state"), "metrics": live.metrics,
            "ranks": live.ranks, "system": live.system, "checkpoint_stall_s": live.stall_s,
            "alerts": (record_data.get("alerts") or [])[-3:]}


def render(record_data: dict[str, Any], live: LiveState) -> Any:
    from rich.table import Table

    m, r, s = live.metrics, live.ranks, live.system
    total = (record_data.get("spec") or {}).get("training", {}).get("max_steps", "?")
    predicted = (record_data.get("plan") or {}).get("predicted") or {}
    table = Table(title=f"{record_data.get('job_id')} — {record_data.get('state')}", show_header=False,
                  expand=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    if not m:
        table.add_row("step", "waiting for the first step…")
        return table
    table.add_row("step", f"{m['step']} / {total}")
    table.add_row("loss / grad norm / lr", f"{m['loss']:.4f} / {m.get('grad_norm', float('nan')):.3f} / "
                                           f"{m.get('lr', 0):.2e}")
    table.add_row("throughput", f"{m['tokens_per_s']:,.0f} tok/s  {m.get('samples_per_s', 0):,.1f} samples/s  "
                                f"step {m['step_time_s'] * 1000:.0f} ms")
    if "mfu" in m:
        plan = f"{predicted['mfu']:.1%}" if predicted.get("mfu") is not None else "-"
        note = " (CPU: calibrated peak)" if live.meta.get("peak_source") == "calibrated-cpu" else ""
        table.add_row("MFU (plan)", f"{m['mfu']:.1%} ({plan}){note}")
    parts = [(k, m.get(f"{k}_s", 0.0)) for k in ("compute", "exposed_comm", "bubble", "data_wait", "optimizer")]
    if any(v for _, v in parts):
        step_t = max(m["step_time_s"], 1e-9)
        table.add_row("step split", "  ".join(f"{k} {v / step_t:.0%}" for k, v in parts))
    table.add_row("checkpoint stall (total)", f"{live.stall_s:.2f} s")
    if "peak_mem_bytes" in m:
        table.add_row("peak memory (rank 0)", f"{m['peak_mem_bytes'] / 2**20:,.0f} MiB")
    if r:
        table.add_row(f"ranks @ step {r['step']}", f"step time min/med/max {r['step_time_s_min'] * 1000:.0f} / "
                      f"{r['step_time_s_median'] * 1000:.0f} / {r['step_time_s_max'] * 1000:.0f} ms; "
                      f"slowest rank {int(r.get('straggler_rank', 0))} ({r.get('straggler_ratio', 1):.2f}x)")
        table.add_row("peak memory min/max", f"{r['peak_mem_bytes_min'] / 2**20:,.0f} / "
                                             f"{r['peak_mem_bytes_max'] / 2**20:,.0f} MiB")
    if s:
        if s.get("source") == "cpu":
            table.add_row("system (CPU host)", f"CPU {s.get('cpu_percent', 0):.0f}%  workers RSS "
                                               f"{s.get('workers_rss_bytes', 0) / 2**20:,.0f} MiB")
        else:
            table.add_row("GPU", f"util {s.get('gpu_util_percent_mean', 0):.0f}%  ECC uncorrected "
                                 f"{s.get('gpu_ecc_uncorrected', 0):.0f}")
    for alert in (record_data.get("alerts") or [])[-3:]:
        table.add_row("[red]alert[/]", f"{alert['rule']} @ step {alert['step']}: {alert['message']}")
    return table


@app.command()
def watch(
    job: str = typer.Argument(..., help=JOB_HELP),
    interval: float = typer.Option(1.0, help="Refresh every N seconds."),
    once: bool = typer.Option(False, help="Print one snapshot and exit."),
    timeout: float = typer.Option(0.0, help="Stop after N seconds (0 = until the job ends or Ctrl-C)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per refresh, on its own line (with --once: "
                                 "one)."),
) -> None:
    """Live view of a job's step metrics (MFU beside the plan, step-time split, ranks, telemetry, alerts).

    \b
    Example:
      trainforge watch tiny-cpu
    """
    record = _record(job)
    live = LiveState(record.events_path)
    live.update()
    if as_json:
        return _watch_json(record, live, interval, None if once else timeout)
    if once:
        console.print(render(record.data, live))
        return
    from rich.live import Live

    deadline = time.monotonic() + timeout if timeout else None
    try:
        with Live(render(record.data, live), console=console, refresh_per_second=4) as view:
            while True:
                time.sleep(interval)
                record.reload()
                live.update()
                view.update(render(record.data, live))
                if record.data.get("state") in FINAL_STATES or (deadline and time.monotonic() > deadline):
                    break
    except KeyboardInterrupt:
        pass


def _watch_json(record: Any, live: LiveState, interval: float, timeout: float | None) -> None:
    """A line per refresh that changed something, until the job ends, `timeout` passes, or at once (None)."""
    import sys

    deadline = time.monotonic() + timeout if timeout else None
    last = None
    try:
        while True:
            line = json.dumps(snapshot(record.data, live), default=str)
            if line != last:
                sys.stdout.write(line + "\n")
                sys.stdout.flush()
                last = line
            if timeout is None or record.data.get("state") in FINAL_STATES or (deadline and time.monotonic() > deadline):
                return
            time.sleep(interval)
            record.reload()
            live.update()
    except KeyboardInterrupt:
        pass


# ---- compare ----------------------------------------------------------------------------------------------------

def summarize_history(values: list[tuple[int, float]]) -> dict[str, float]:
    vals = [v for _, v in sorted(values)]
    if not vals:
        return {}
    return {"final": vals[-1], "best": min(vals), "median": statistics.median(vals)}


def config_diff(params: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """{param: {job: value}} for the params that differ between jobs (missing counts as a difference)."""
    keys = sorted({k for p in params.values() for k in p})
    out = {}
    for k in keys:
        values = {job: p.get(k, "—") for job, p in params.items()}
        if len(set(values.values())) > 1:
            out[k] = values
    return out


COMPARE_METRICS = (("loss", "final"), ("loss", "best"), ("eval_loss", "best"), ("tokens_per_s", "median"),
                   ("step_time_s", "median"), ("mfu", "median"), ("mfu_predicted", "final"),
                   ("data_wait_s", "median"), ("exposed_comm_s", "median"), ("peak_mem_bytes", "final"))


@app.command()
def compare(
    jobs: list[str] = typer.Argument(..., help="Two or more jobs: ids, or job names (each its newest job)."),
    as_json: bool = typer.Option(False, "--json", help="Print as JSON."),
    plot: Path | None = typer.Option(None, help="Write a PNG of loss and throughput curves here."),
) -> None:
    """Compare runs side by side: config differences and final/best/median metrics (from MLflow).

    \b
    Example:
      trainforge compare JOB_A JOB_B --plot curves.png
    """
    from rich.table import Table

    from trainforge.registry.tracking import Tracker

    tracker = Tracker()
    params: dict[str, dict[str, str]] = {}
    summary: dict[str, dict[str, float]] = {}
    curves: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for job in jobs:
        record = _record(job)
        run_id = record.data.get("mlflow_run_id")
        if not run_id:
            fail(f"job {record.job_id} has no MLflow run (it never started)")
        run = tracker.client.get_run(run_id)
        params[record.job_id] = dict(run.data.params)
        summary[record.job_id], curves[record.job_id] = {}, {}
        for name, stat in COMPARE_METRICS:
            if name not in run.data.metrics:
                continue
            history = [(m.step, m.value) for m in tracker.client.get_metric_history(run_id, name)]
            curves[record.job_id][name] = history
            value = summarize_history(history).get(stat)
            if value is not None:
                summary[record.job_id][f"{name}.{stat}"] = value
    diff = config_diff(params)
    if plot is not None:
        write_plot(curves, plot)
    if as_json:
        print_json({"config_diff": diff, "metrics": summary, "plot": str(plot) if plot else None})
        return
    ids = list(summary)
    table = Table("config difference", *ids, title="config")
    for k, values in diff.items():
        table.add_row(k, *(values[j] for j in ids))
    console.print(table if diff else "[dim]configs are identical[/]")
    table = Table("metric", *ids, title="metrics")
    for key in sorted({k for s in summary.values() for k in s}):
        table.add_row(key, *(f"{summary[j][key]:.4g}" if key in summary[j] else "-" for j in ids))
    console.print(table)
    if plot is not None:
        console.print(f"curves: {plot}")


def write_plot(curves: dict[str, dict[str, list[tuple[int, float]]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for job, series in curves.items():
        for ax, name in zip(axes, ("loss", "tokens_per_s"), strict=True):
            points = sorted(series.get(name, []))
            if points:
                ax.plot([s for s, _ in points], [v for _, v in points], label=job)
    for ax, name in zip(axes, ("loss", "tokens/s"), strict=True):
        ax.set_xlabel("step")
        ax.set_ylabel(name)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- report -----------------------------------------------------------------------------------------------------

@app.command()
def report(
    job: str = typer.Argument(..., help=JOB_HELP),
    out: Path | None = typer.Option(None, help="Also write the report here (default: JOB_FOLDER/report.html)."),
    mlflow: bool = typer.Option(True, "--mlflow/--no-mlflow", help="Log it as the report.html artifact of the "
                                "job's MLflow run (replacing the one written at the end of the job)."),
    as_json: bool = typer.Option(False, "--json", help="Print {job_id, state, path} as JSON."),
) -> None:
    """Write a job's HTML report: loss, throughput, MFU and step-split charts, a timeline of segments, failures
    and recoveries, checkpoint stalls, alerts and cost. Written automatically when a job ends; this rebuilds it
    (also for a running job).

    \b
    Example:
      trainforge report tiny-cpu --out tiny-cpu.html
    """
    from trainforge.registry.report import write_report

    record = _record(job)
    try:
        path = write_report(record, out, log_to_mlflow=mlflow and bool(record.data.get("mlflow_run_id")))
    except OSError as exc:
        fail(f"could not write the report of {record.job_id}: {exc}")
    if as_json:
        print_json({"job_id": record.job_id, "state": record.data.get("state"), "path": str(path)})
        return
    console.print(f"report of {record.job_id} ({record.data.get('state')}): {path}")


# ---- metric (the API of HPO drivers, from the shell) -------------------------------------------------------------

@app.command()
def metric(
    job: str = typer.Argument(..., help=JOB_HELP + " A job this host has no record of: its full id, looked up "
                              "in MLflow."),
    name: str = typer.Argument("loss", help="Metric, e.g. loss, eval_loss, tokens_per_s, mfu."),
    mode: MetricMode = typer.Option(MetricMode.latest, help="latest: at the highest step; min or max: over the "
                                    "run's history."),
    as_json: bool = typer.Option(False, "--json", help="Print as JSON (value, step, run id, run status)."),
) -> None:
    """A job's latest or best value of a metric, read from MLflow: what an HPO driver (Optuna, Ray Tune) asks
    after each trial. Python: trainforge.registry.tracking.job_metric. See examples/hpo/optuna_trials.py.

    \b
    Example:
      trainforge metric tiny-cpu eval_loss --mode min
    """
    from trainforge.registry.jobs import JobNotFoundError, JobStore
    from trainforge.registry.tracking import job_metric

    try:
        job = JobStore().get(job).job_id
    except JobNotFoundError:
        pass  # not on this host: its run is found in MLflow by the id (job_metric)
    except LookupError as exc:
        job_lookup_failed(exc)
    try:
        value = job_metric(job, name, mode.value)
    except LookupError as exc:
        fail(str(exc))
    if as_json:
        print_json(value.to_dict())
        return
    console.print(f"{value.metric} ({mode.value}) of {value.job_id}: {value.value:.6g} at step {value.step} "
                  f"(MLflow run {value.run_id}, {value.run_status})")


# ---- cost -------------------------------------------------------------------------------------------------------

def _since(text: str | None) -> float:
    if not text:
        return 0.0
    try:
        return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()
    except ValueError:
        fail(f"--since {text!r}: use a date like 2026-11-01")
    return 0.0


@app.command()
def cost(
    team: str | None = typer.Option(None, help="Only this team's jobs."),
    since: str | None = typer.Option(None, help="Only jobs submitted on or after this date (YYYY-MM-DD)."),
    market: Market = typer.Option(Market.on_demand, help="Price market."),
    by_team: bool = typer.Option(False, "--by-team", help="Roll up per team (chargeback)."),
    as_json: bool = typer.Option(False, "--json", help="Print as JSON."),
    csv_path: Path | None = typer.Option(None, "--csv", help="Also write the rows as CSV here."),
) -> None:
    """GPU-hours and dollars per job (productive / idle / lost / failed) or per team, for chargeback.

    \b
    Example:
      trainforge cost --team research --since 2026-11-01 --by-team
    """
    from trainforge.events import read_typed_events
    from trainforge.infra.cost import COST_EVENTS, job_cost, load_prices, team_rollup
    from trainforge.registry.jobs import JobStore

    prices, storage = load_prices()
    start = _since(since)
    costs = []
    for record in JobStore().list():
        if (team and record.data.get("team") != team) or record.data.get("created_at", 0) < start:
            continue
        if not record.data.get("segments"):
            continue
        events, _, _ = read_typed_events(record.events_path, only=COST_EVENTS)
        costs.append(job_cost(record.data, events, prices=prices, storage_gb_month=storage, market=market.value))
    rows = ([t.to_dict() for t in team_rollup(costs).values()] if by_team else [c.to_dict() for c in costs])
    if csv_path is not None:
        _write_csv(rows, csv_path)
    if as_json:
        print_json(rows)
        return
    _print_cost(rows, by_team)
    if csv_path is not None:
        console.print(f"CSV: {csv_path}")


def _write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = [k for k in (rows[0] if rows else {}) if not isinstance(rows[0][k], dict)]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def _print_cost(rows: list[dict[str, Any]], by_team: bool) -> None:
    from rich.table import Table

    first = ("team", "jobs") if by_team else ("job", "team", "state", "gpu")
    table = Table(*first, "GPU-h", "productive", "idle", "lost", "failed", "compute $", "storage $", "total $")
    for r in rows:
        head = (r["team"], str(r["jobs"])) if by_team else (r["job_id"], r["team"], r["state"],
                                                            f"{r['workers']}x {r['gpu_type']}")
        table.add_row(*head, *(f"{r[k]:.3f}" for k in ("gpu_hours", "productive_hours", "idle_hours", "lost_hours",
                                                       "failed_hours")),
                      *(f"{r[k]:.2f}" for k in ("compute_cost", "storage_cost", "total_cost")))
    console.print(table)


# ---- profile ----------------------------------------------------------------------------------------------------

def running_channel(record: Any) -> tuple[Any, str, int]:
    """The channel of the job's running segment attempt: (its store, the channel's root, the attempt), as
    run_segment built it (`{job prefix}/channel/segment-{attempt}` in the job's store, tasks/segment.py). Raises
    LookupError naming the job and what to do when no segment runs or the job never started."""
    from trainforge.contract.channel import channel_root
    from trainforge.infra.storage import open_store

    state = record.data.get("state")
    running = [s for s in record.data.get("segments", []) if s.get("state") == "running"]
    if state != "running" or not running:
        raise LookupError(f"job {record.job_id} has no segment running now (state {state!r}): wait until it "
                          "trains (trainforge watch) and ask again")
    config_path = record.folder / "worker-config.json"
    try:
        config = json.loads(config_path.read_text())
        url, prefix = config["storage_url"], config["storage_prefix"]
    except (OSError, ValueError, KeyError) as exc:
        raise LookupError(f"job {record.job_id}: cannot read its store location from {config_path} ({exc}); "
                          "the job was not started by this control plane, or its folder is damaged") from None
    attempt = int(running[-1]["attempt"])
    return open_store(url), f"{channel_root(prefix)}/segment-{attempt}", attempt


@app.command()
def profile(
    job: str = typer.Argument(..., help=JOB_HELP),
    steps: str = typer.Option(..., help="Window of steps START:END (1-based, inclusive), e.g. 20:22."),
    as_json: bool = typer.Option(False, "--json", help="Print the request (or the finished profile's summary) as "
                                 "JSON."),
) -> None:
    """Ask a running job to run torch.profiler on every rank for a window of steps (traces become run artifacts
    under profiles/ with a merged summary: comm/compute overlap, slowest rank per step, FLOP/s vs peak).
    The request is the channel's `profile_window` command to every node of the running segment; a rank already
    past START skips it. For a job not yet started, set TRAINFORGE_PROFILE_STEPS=START:END when submitting."""
    from trainforge.contract.channel import CommandWriter
    from trainforge.trainer.profiling import parse_window

    try:
        window = parse_window(steps)
    except ValueError as exc:
        fail(str(exc))
    assert window is not None
    record = _record(job)
    summary = record.folder / "profiles" / "summary.json"
    if summary.is_file():
        if as_json:
            print_json({"job_id": record.job_id, "summary": json.loads(summary.read_text())})
        else:
            console.print_json(summary.read_text())
        return
    if record.data.get("state") in FINAL_STATES:
        fail(f"job {record.job_id} is {record.data['state']}; profile a running job, or resubmit with "
             f"TRAINFORGE_PROFILE_STEPS={steps}")
    try:
        store, root, attempt = running_channel(record)
        seq = CommandWriter(store, root).send("profile_window", start_step=window[0], end_step=window[1])
    except LookupError as exc:
        fail(str(exc))
    except Exception as exc:  # the store's own errors (a local folder's OSError, S3's client errors)
        fail(f"job {record.job_id}: could not write the profile request into its channel ({exc}); "
             "check the object store is reachable and try again")
    if as_json:
        print_json({"job_id": record.job_id, "steps": [window[0], window[1]], "segment": attempt, "command": seq,
                    "profiles": str(record.folder / "profiles")})
        return
    console.print(f"profile of steps {steps} requested for {record.job_id} (segment {attempt}, command {seq}); "
                  f"ranks start it at step {window[0]}. Results: {record.folder / 'profiles'} and the MLflow "
                  "run's profiles/ artifacts.")


