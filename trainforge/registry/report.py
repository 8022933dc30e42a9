"""The per-job HTML report: one self-contained file (inline SVG charts, no scripts, no network) written to the job
folder as `report.html` and logged as the `report.html` artifact of the job's MLflow run.

It shows what MLflow's charts do not put side by side: metrics (loss with eval loss, throughput, MFU beside the
plan's, the step-time split), a timeline of segments, failures and recoveries, checkpoint stalls, alerts and the
job's cost split (infra/cost.py). Inputs are the job record and its events.jsonl, the same sources the flow
streams to MLflow, so a report can be rebuilt at any time (`trainforge report JOB`), also for a running job.

The flow writes it in `_end_tracking`, before the run is closed; a report that fails is logged, never fatal.
"""

from __future__ import annotations

import html
import io
import shlex
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from trainforge.contract.events import (
    CheckpointCommitted,
    CheckpointCorrupt,
    CheckpointSkipped,
    CheckpointStaged,
    FaultDetected,
    Metrics,
    MetricsMeta,
    Recovered,
    Resize,
    SegmentEnd,
    SegmentEvent,
    SegmentStart,
)

REPORT_NAME = "report.html"
# A chart line holds at most this many points: a 100k-step job would otherwise make a report of tens of MB.
MAX_POINTS = 2000
SPLIT_PARTS = ("compute_s", "exposed_comm_s", "bubble_s", "data_wait_s", "optimizer_s")


@dataclass
class Segmented:
    """A metric by step, split where a segment started again: a replay after a failure is drawn as its own
    line over the steps it recomputes, so lost work is visible instead of averaged away."""

    runs: list[list[tuple[int, float]]] = field(default_factory=list)

    def last_by_step(self) -> list[tuple[int, float]]:
        latest: dict[int, float] = {}
        for run in self.runs:
            latest.update(dict(run))
        return sorted(latest.items())

    def values(self) -> list[float]:
        return [v for _, v in self.last_by_step()]


def metric_series(events: Iterable[SegmentEvent], name: str) -> Segmented:
    """The `metrics` events' `name` by step, one run per segment."""
    out = Segmented()
    current: list[tuple[int, float]] = []
    for ev in events:
        if isinstance(ev, SegmentStart):
            if current:
                out.runs.append(current)
            current = []
        elif isinstance(ev, Metrics) and (value := ev.values().get(name)) is not None:
            current.append((ev.step, value))
    if current:
        out.runs.append(current)
    return out


def thin(points: Sequence[tuple[int, float]], limit: int = MAX_POINTS) -> list[tuple[int, float]]:
    """Every k-th point plus the last one, so the curve keeps its shape and its end."""
    if len(points) <= limit:
        return list(points)
    k = -(-len(points) // limit)
    kept = list(points[::k])
    return kept if kept[-1] == points[-1] else [*kept, points[-1]]


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _ts(t: float | None) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S UTC") if t else "-"


def _fmt(v: Any, spec: str = ".4g") -> str:
    return "-" if v is None else format(v, spec) if isinstance(v, int | float) else str(v)


# ---- charts (matplotlib -> inline SVG) --------------------------------------------------------------------------

def _svg(fig: Any, name: str) -> str:
    import matplotlib.pyplot as plt

    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]  # drop the XML prolog and DOCTYPE: the SVG is inlined into HTML


def _figure(name: str) -> tuple[Any, Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Text stays text (smaller, searchable); the salt makes element ids unique per chart and the output stable.
    ctx = matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": f"trainforge-{name}"})
    ctx.__enter__()
    fig, ax = plt.subplots(figsize=(7.2, 3.0))
    return ctx, fig, ax


def _finish(ctx: Any, fig: Any, ax: Any, name: str, ylabel: str) -> str:
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        return _svg(fig, name)
    finally:
        ctx.__exit__(None, None, None)


def _plot_runs(ax: Any, series: Segmented, gid: str, label: str, color: str) -> None:
    for i, run in enumerate(series.runs):
        pts = thin(run)
        ax.plot([s for s, _ in pts], [v for _, v in pts], color=color, lw=1.4, gid=f"{gid}-{i}",
                label=label if i == 0 else (f"{label} (replayed after a failure)" if i == 1 else None),
                ls="-" if i == 0 else "--")


def loss_chart(events: list[SegmentEvent], checkpoints: Mapping[str, Any]) -> str | None:
    loss = metric_series(events, "loss")
    if not loss.runs:
        return None
    ctx, fig, ax = _figure("loss")
    _plot_runs(ax, loss, "loss-train", "train loss", "tab:blue")
    evals = sorted((int(s), c["eval_loss"]) for s, c in checkpoints.items() if c.get("eval_loss") is not None)
    if evals:
        ax.plot([s for s, _ in evals], [v for _, v in evals], "o-", color="tab:orange", gid="loss-eval",
                label="eval loss (committed checkpoints)")
    return _finish(ctx, fig, ax, "loss", "loss")


def throughput_chart(events: list[SegmentEvent]) -> str | None:
    tps = metric_series(events, "tokens_per_s")
    if not tps.runs:
        return None
    ctx, fig, ax = _figure("throughput")
    _plot_runs(ax, tps, "throughput", "tokens/s", "tab:green")
    return _finish(ctx, fig, ax, "throughput", "tokens / s")


def mfu_chart(events: list[SegmentEvent], predicted: float | None, peak_source: str | None) -> str | None:
    mfu = metric_series(events, "mfu")
    if not mfu.runs:
        return None
    ctx, fig, ax = _figure("mfu")
    _plot_runs(ax, mfu, "mfu", f"measured MFU (peak: {peak_source or '?'})", "tab:purple")
    if predicted is not None:
        ax.axhline(predicted, color="gray", ls=":", gid="mfu-plan", label="plan's predicted MFU")
    return _finish(ctx, fig, ax, "mfu", "MFU")


def split_chart(events: list[SegmentEvent]) -> str | None:
    parts = {p: dict(metric_series(events, p).last_by_step()) for p in SPLIT_PARTS}
    steps = sorted(set().union(*(set(v) for v in parts.values())))
    if not steps:
        return None
    keep = [s for s, _ in thin([(s, 0.0) for s in steps])]
    ctx, fig, ax = _figure("split")
    ax.stackplot(keep, *[[parts[p].get(s, 0.0) for s in keep] for p in SPLIT_PARTS],
                 labels=[p.removesuffix("_s").replace("_", " ") for p in SPLIT_PARTS], alpha=0.8)
    return _finish(ctx, fig, ax, "split", "step time (s)")


def timeline_chart(record: Mapping[str, Any], events: list[SegmentEvent]) -> str | None:
    segments = record.get("segments") or []
    if not segments:
        return None
    import matplotlib.patches as mpatches

    t0 = float(record.get("created_at") or segments[0]["started_at"])
    end = max([float(s.get("ended_at") or time.time()) for s in segments] + [float(record.get("completed_at") or 0)])
    ctx, fig, ax = _figure("timeline")
    fig.set_size_inches(7.2, 2.2)
    colors = {"completed": "tab:green", "failed": "tab:red", "preempted": "tab:orange", "running": "tab:blue"}
    for seg in segments:
        start, stop = float(seg["started_at"]) - t0, float(seg.get("ended_at") or time.time()) - t0
        ax.broken_barh([(start, max(stop - start, 1e-3))], (0.6, 0.8), color=colors.get(seg.get("state"), "gray"),
                       gid=f"segment-{seg.get('attempt')}")
        ax.text(start, 1.5, f"#{seg.get('attempt')} {seg.get('state')}", fontsize=7, va="bottom")
    marks = [(CheckpointCommitted, "|", "black", "checkpoint committed"), (FaultDetected, "x", "tab:red", "fault"),
             (Recovered, "^", "tab:green", "recovered"), (CheckpointCorrupt, "s", "tab:red", "corrupt")]
    for cls, marker, color, label in marks:
        ts = [e.time - t0 for e in events if isinstance(e, cls)]
        if ts:
            kind = cls.model_fields["type"].default
            ax.scatter(ts, [0.3] * len(ts), marker=marker, color=color, label=label, gid=f"mark-{kind}", zorder=3)
    ax.set_ylim(0, 2.2)
    ax.set_yticks([])
    ax.set_xlim(0, max(end - t0, 1.0) * 1.02)
    handles, _ = ax.get_legend_handles_labels()
    handles += [mpatches.Patch(color=c, label=f"segment {s}") for s, c in colors.items()
                if any(seg.get("state") == s for seg in segments)]
    ax.legend(handles=handles, fontsize=7, loc="upper right", ncol=3)
    ax.set_xlabel("seconds since submission")
    fig.tight_layout()
    try:
        return _svg(fig, "timeline")
    finally:
        ctx.__exit__(None, None, None)


# ---- tables -----------------------------------------------------------------------------------------------------

def timeline_rows(record: Mapping[str, Any], events: list[SegmentEvent]) -> list[tuple[float, str, str]]:
    """(time, what, detail) in time order: submission, segments, checkpoints, faults, recoveries, alerts, end."""
    rows: list[tuple[float, str, str]] = []
    if record.get("created_at"):
        rows.append((float(record["created_at"]), "submitted", f"team {record.get('team', '?')}"))
    for seg in record.get("segments") or []:
        rows.append((float(seg["started_at"]), f"segment #{seg.get('attempt')} launched", ""))
        if seg.get("ended_at"):
            rows.append((float(seg["ended_at"]), f"segment #{seg.get('attempt')} {seg.get('state')}",
                         str(seg.get("error") or "")[:400]))
    for ev in events:
        t = ev.time
        match ev:
            case SegmentStart():
                rows.append((t, "training started", f"from step {ev.step}" + (
                    f" (resumed from committed checkpoint {ev.resumed_from})" if ev.resumed_from else "")
                    + f", world size {ev.world_size}"))
            case SegmentEnd():
                rows.append((t, "training stopped", f"at step {ev.step}: {ev.reason}"))
            case CheckpointCommitted():
                rows.append((t, "checkpoint committed", f"step {ev.step}"))
            case FaultDetected():
                rows.append((t, f"fault: {ev.fault}", f"rank {ev.rank}, step {ev.step}: {ev.message} -> {ev.action}"))
            case Recovered():
                rows.append((t, f"recovered ({ev.tier})", f"MTTR {_fmt(ev.mttr_s, '.1f')} s, resumed from step "
                                                          f"{ev.resumed_from}, {ev.lost_steps} step(s) recomputed"))
            case CheckpointCorrupt():
                rows.append((t, "corrupt checkpoint skipped", f"step {ev.step}: {ev.problems}"))
            case Resize():  # elastic: the scheduler grew or shrank the gang between segments
                rows.append((t, "resized", f"{ev.from_workers} -> {ev.to_workers} workers after step "
                                           f"{ev.after_step}: {ev.reason}"))
            case CheckpointSkipped():
                rows.append((t, "checkpoint not committed", f"step {ev.step}: {ev.reason}"))
    for alert in record.get("alerts") or []:
        rows.append((float(alert.get("time") or 0), f"alert: {alert.get('rule')}",
                     f"step {alert.get('step')}: {alert.get('message')}"))
    end = record.get("completed_at") or (record.get("updated_at") if record.get("state") in ("failed", "cancelled")
                                         else None)
    if end:
        rows.append((float(end), f"job {record.get('state')}", str(record.get("error") or "")[:400]))
    return sorted(rows, key=lambda r: r[0])


def checkpoint_rows(record: Mapping[str, Any], events: list[SegmentEvent]) -> list[dict[str, Any]]:
    """One row per staged checkpoint: how long the step loop was blocked, and what was committed."""
    committed = record.get("checkpoints") or {}
    commit_time = {e.step: e.time for e in events if isinstance(e, CheckpointCommitted)}
    rows = []
    for ev in events:
        if not isinstance(ev, CheckpointStaged):
            continue
        step = ev.step
        entry = committed.get(str(step)) or {}
        rows.append({"step": step, "stall_s": ev.blocked_s,
                     "commit_after_s": commit_time[step] - ev.time if step in commit_time else None,
                     "bytes": entry.get("bytes"), "eval_loss": entry.get("eval_loss"),
                     "kept": str(step) in committed})
    return rows


def _table(headers: Sequence[str], rows: Iterable[Sequence[Any]], table_id: str) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


# ---- the page ---------------------------------------------------------------------------------------------------

CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;
font-size:13px;vertical-align:top}th{background:#f3f3f3}figure{margin:0 0 1.5em}figcaption{font-size:13px;color:#555}
.state-completed{color:#186a18}.state-failed{color:#b00}.state-cancelled{color:#a60}.note{color:#666;font-size:13px}"""


def render_html(record: Mapping[str, Any], events: list[SegmentEvent], *, now: float | None = None,
                tensorboard: str | None = None) -> str:
    """The report of one job as a self-contained HTML page (pure: record and events in, text out). `tensorboard`:
    the job's TensorBoard folder, when the flow wrote one (registry/tensorboard.py)."""
    from trainforge.infra.cost import job_cost, load_prices
    from trainforge.registry.secrets import redact

    now = time.time() if now is None else now
    esc = html.escape
    job_id, state = str(record.get("job_id", "?")), str(record.get("state", "?"))
    spec = record.get("spec") or {}
    plan = record.get("plan") or {}
    predicted = plan.get("predicted") or {}
    dataset = record.get("dataset") or {}
    meta = next((e.model_dump() for e in events if isinstance(e, MetricsMeta)), {})
    steps = [e for e in events if isinstance(e, Metrics)]
    loss = metric_series(events, "loss").last_by_step()
    tps = metric_series(events, "tokens_per_s").values()
    mfu = metric_series(events, "mfu").values()
    stalls = checkpoint_rows(record, events)
    evals = [c["eval_loss"] for c in (record.get("checkpoints") or {}).values() if c.get("eval_loss") is not None]
    total_steps = (spec.get("training") or {}).get("max_steps")
    step_time = sum(e.step_time_s or 0.0 for e in steps)
    stall_total = sum(r["stall_s"] for r in stalls)
    segments = record.get("segments") or []
    wall = sum(float(s.get("ended_at") or now) - float(s["started_at"]) for s in segments)

    parts: list[str] = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>trainforge job {esc(job_id)}</title>"
                        f"<style>{CSS}</style></head><body>",
                        f"<h1>Job <code>{esc(job_id)}</code>: <span class='state-{esc(state)}' id='job-state'>"
                        f"{esc(state)}</span></h1>",
                        f"<p class='note'>Report generated {_ts(now)} from the job record and its events "
                        f"(the same data the MLflow run holds).</p>"]
    summary = [
        ("team", record.get("team")), ("MLflow run", record.get("mlflow_run_id")),
        ("Prefect flow run", record.get("flow_run_id")),
        ("dataset", f"{dataset.get('ref', '-')} @ {str(dataset.get('version', '-'))[:16]} ({dataset.get('license', '-')})"),
        ("code commit", record.get("code_commit")), ("config hash", str(record.get("config_hash") or "-")[:16]),
        ("layout", ", ".join(f"{k}={v}" for k, v in plan["layout"].items())
         if isinstance(plan.get("layout"), dict) else plan.get("layout")), ("parameters", _fmt(plan.get("parameters"), ",")),
        ("submitted / finished", f"{_ts(record.get('created_at'))} / {_ts(record.get('completed_at'))}"),
        ("steps", f"{loss[-1][0] if loss else 0} / {total_steps or '?'}"),
        ("final train loss", _fmt(loss[-1][1] if loss else None)), ("best eval loss", _fmt(min(evals) if evals else None)),
        ("median tokens/s", _fmt(_median(tps), ",.0f")),
        ("median MFU (plan)", f"{_fmt(_median(mfu), '.2%')} ({_fmt(predicted.get('mfu'), '.2%')}); "
                              f"peak {_fmt(meta.get('peak_flops'), '.3g')} FLOP/s, {meta.get('peak_source', '-')}"),
        ("segments", f"{len(segments)} ({sum(s.get('state') == 'failed' for s in segments)} failed), "
                     f"wall time {wall:.1f} s, step time {step_time:.1f} s"),
        ("checkpoint stall", f"{stall_total:.3f} s over {len(stalls)} checkpoint(s)"
                             + (f" ({stall_total / step_time:.2%} of step time)" if step_time else "")),
    ]
    if record.get("model"):
        m = record["model"]
        summary.append(("model version", f"{m.get('model_name')} v{m.get('version')} from step {m.get('step')}"))
    if tensorboard:
        summary.append(("TensorBoard", f"tensorboard --logdir {shlex.quote(tensorboard)} (also the MLflow run's "
                                       "tensorboard/ artifacts)"))
    if record.get("error"):
        summary.append(("error", str(record["error"])[-1500:]))
    parts += ["<h2 id='summary'>Summary</h2>", _table(("", ""), ((k, "-" if v is None else v) for k, v in summary),
                                                     "summary-table")]

    parts.append("<h2 id='metrics'>Metrics</h2>")
    charts = [("loss", "Loss per step; eval loss at committed checkpoints", loss_chart(events, record.get("checkpoints") or {})),
              ("throughput", "Throughput (tokens/s, rank 0's view of the global batch)", throughput_chart(events)),
              ("mfu", "Model FLOPs utilisation, measured, beside the plan's prediction",
               mfu_chart(events, predicted.get("mfu"), meta.get("peak_source"))),
              ("split", "Where each step's time went", split_chart(events))]
    for name, caption, svg in charts:
        if svg is None:
            parts.append(f"<p class='note' id='chart-{name}-missing'>no {name} data yet</p>")
            continue
        parts.append(f"<figure id='chart-{name}'>{svg}<figcaption>{esc(caption)}</figcaption></figure>")
    if len(metric_series(events, "loss").runs) > 1:
        parts.append("<p class='note'>Dashed lines: steps recomputed after a failure (lost work).</p>")

    parts.append("<h2 id='timeline'>Timeline: segments, failures and recoveries</h2>")
    svg = timeline_chart(record, events)
    if svg:
        parts.append(f"<figure id='chart-timeline'>{svg}</figure>")
    t0 = float(record.get("created_at") or 0)
    parts.append(_table(("time", "+s", "event", "detail"),
                        ((_ts(t), f"{t - t0:.1f}" if t0 else "-", what, detail)
                         for t, what, detail in timeline_rows(record, events)), "timeline-table"))

    parts.append("<h2 id='checkpoints'>Checkpoints and stalls</h2>")
    parts.append(_table(("step", "loop blocked (s)", "committed after (s)", "size (MB)", "eval loss", "kept"),
                        ((r["step"], f"{r['stall_s']:.3f}", _fmt(r["commit_after_s"], ".2f"),
                          _fmt(r["bytes"] / 1e6 if r["bytes"] else None, ".1f"), _fmt(r["eval_loss"]),
                          "yes" if r["kept"] else "retired") for r in stalls), "checkpoint-table"))

    parts.append("<h2 id='cost'>Cost</h2>")
    try:
        prices, storage = load_prices()
        cost = job_cost(record, events, prices=prices, storage_gb_month=storage, now=now)
        rows = [("GPU-hours (allocated)", f"{cost.gpu_hours:.4f}", f"{cost.workers} x {cost.gpu_type} at "
                 f"${cost.price_per_gpu_hour:.2f}/GPU-h ({cost.market})"),
                ("productive", f"{cost.productive_hours:.4f}", "steps that count, minus data wait"),
                ("idle", f"{cost.idle_hours:.4f}", "start-up, data wait, checkpoint stalls, evaluation, recovery"),
                ("lost", f"{cost.lost_hours:.4f}", "steps recomputed after failures"),
                ("failed", f"{cost.failed_hours:.4f}", "all hours of a failed job"),
                ("queue (not billed)", f"{cost.queue_hours:.4f}", "submission to first segment"),
                ("compute $", f"{cost.compute_cost:.4f}", ""),
                ("checkpoint storage $", f"{cost.storage_cost:.6f}", f"{cost.storage_gb_days:.4f} GB-days so far"),
                ("total $", f"{cost.total_cost:.4f}", "")]
        parts.append(_table(("item", "value", "what"), rows, "cost-table"))
    except (ValueError, OSError) as exc:  # no price for this GPU type, or an unreadable price file
        parts.append(f"<p class='note' id='cost-missing'>cost not available: {esc(str(exc))}</p>")

    alerts = record.get("alerts") or []
    parts.append("<h2 id='alerts'>Alerts</h2>")
    parts.append(_table(("rule", "step", "message"), ((a.get("rule"), a.get("step"), a.get("message"))
                                                      for a in alerts), "alert-table")
                 if alerts else "<p class='note'>none fired</p>")
    profile = record.get("profile")
    if profile:
        parts.append("<h2 id='profile'>Profile</h2>")
        parts.append(_table(("field", "value"), ((k, v) for k, v in sorted(profile.items())
                                                 if not isinstance(v, dict | list)), "profile-table"))
    parts.append("</body></html>")
    # Defence in depth: a secret value registered in this process never reaches the artifact.
    return redact("\n".join(parts))


def write_report(record: Any, out: Path | None = None, *, log_to_mlflow: bool = True) -> Path:
    """Render `record`'s report into its folder (and `out`), and log it as an artifact of the job's MLflow run."""
    from trainforge.events import read_typed_events

    record.reload()
    events, _, _ = read_typed_events(record.events_path)  # a line it cannot read is left out of the report
    from trainforge.registry.tensorboard import FOLDER

    board = record.folder / FOLDER
    page = render_html(record.data, events, tensorboard=str(board) if board.is_dir() else None)
    path = record.folder / REPORT_NAME
    tmp = path.with_suffix(".html.tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(path)
    if out is not None and Path(out).resolve() != path.resolve():
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(page, encoding="utf-8")
    run_id = record.data.get("mlflow_run_id")
    if log_to_mlflow and run_id:
        from trainforge.registry.tracking import Tracker

        Tracker().log_artifact(run_id, path)
    return Path(out) if out is not None else path


def report_for_run(run_id: str) -> Path:
    """The report of the job an MLflow run belongs to (its `trainforge.job_id` tag), written and logged."""
    from trainforge.registry.jobs import JobStore
    from trainforge.registry.tracking import Tracker

    job_id = Tracker().client.get_run(run_id).data.tags.get("trainforge.job_id")
    if not job_id:
        raise LookupError(f"MLflow run {run_id} has no trainforge.job_id tag")
    return write_report(JobStore().get(job_id))
