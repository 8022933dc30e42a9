"""`trainforge submit | status | logs | cancel | checkpoints | demo`: run and inspect training jobs, through the SDK
(trainforge/sdk.py): the commands parse arguments and print; the SDK does the work."""

from __future__ import annotations

import json
import sys
import threading
import time
from enum import StrEnum
from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from trainforge.cli import app
from trainforge.commands.choices import Backend
from trainforge.commands.common import (
    EXIT_CANCELLED,
    EXIT_JOB_FAILED,
    JOB_HELP,
    console,
    err_console,
    fail,
    job_lookup_failed,
    print_json,
    print_spec_error,
    resolve_job,
)
from trainforge.resources import example_path
from trainforge.spec import SpecError


def _progress_thread(job_folder_getter, total_steps: int, stop: threading.Event) -> threading.Thread:
    """Rich progress (step, loss, tokens/s) from the job's events file while the flow runs."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from trainforge.contract.events import Metrics
    from trainforge.events import read_typed_events

    def run() -> None:
        offset, step, loss, tps = 0, 0, float("nan"), 0.0
        with Progress(TextColumn("[bold]training[/]"), BarColumn(), TextColumn("step {task.completed}/{task.total}"),
                      TextColumn("loss {task.fields[loss]:.3f}"), TextColumn("{task.fields[tps]:,.0f} tok/s"),
                      TimeElapsedColumn(), console=err_console, transient=False) as progress:
            task = progress.add_task("train", total=total_steps, loss=loss, tps=tps)
            while not stop.is_set():
                folder = job_folder_getter()
                if folder is not None:
                    events, offset, _ = read_typed_events(folder / "events.jsonl", offset, only=(Metrics,))
                    for ev in events:
                        if isinstance(ev, Metrics):  # a script's metrics may lack the loss or the throughput
                            step = ev.step
                            loss = ev.loss if ev.loss is not None else loss
                            tps = ev.tokens_per_s if ev.tokens_per_s is not None else tps
                    progress.update(task, completed=step, loss=loss, tps=tps)
                stop.wait(0.5)

    thread = threading.Thread(target=run, name="progress", daemon=True)
    thread.start()
    return thread


def run_job(spec_file: Path | None, *, job_id: str | None = None, resume: bool = False, show_progress: bool = True,
            overrides: list[str] | None = None) -> dict[str, Any]:
    """Run the train-job flow in this process through the SDK (Prefect's ephemeral API when no server is
    configured); a bad spec stops the command with its problems; what the flow raised is raised."""
    sub = _prepare(spec_file, overrides=overrides, resume=job_id if resume else None, job_id=job_id)
    return run_job_from(sub, show_progress=show_progress)


def _prepare(spec_file: Path | None, *, overrides: list[str] | None = None, resume: str | None = None,
             job_id: str | None = None, as_json: bool | None = None) -> Any:
    """sdk.prepare, its errors as the CLI says them: a spec's problems (exit 1, or 2 unreadable), an unknown job."""
    from trainforge.sdk import prepare

    try:
        return prepare(spec_file, overrides=overrides, resume=resume, job_id=job_id)
    except SpecError as exc:
        print_spec_error(exc, as_json)
    except (LookupError, ValueError) as exc:
        fail(str(exc), as_json=as_json)


def _print_log_lines(job: Any, rank: int | None, until: Any = None) -> None:
    for line in job.follow_logs(rank, until=until):
        console.out(line, end="", highlight=False)


def _print_result(result: dict[str, Any]) -> None:
    from trainforge.home import home
    from trainforge.registry.tracking import tracking_uri

    model = result.get("model") or {}
    console.print(f"[green]✓[/] job [bold]{result['job_id']}[/] {result['state']}")
    console.print(f"  Prefect flow run : {result.get('flow_run_id')}  (UI: `prefect server start`, then Runs)")
    console.print(f"  MLflow run       : {result.get('mlflow_run_id')}  (tracking URI {tracking_uri()}; "
                  f"`mlflow ui --backend-store-uri {tracking_uri()}`)")
    console.print(f"  checkpoints      : {result.get('checkpoints')}  (`trainforge checkpoints {result['job_id']}`)")
    if model:
        console.print(f"  model version    : {model['model_name']} v{model['version']} from step {model['step']} "
                      f"({model['path']})")
    console.print(f"  job folder       : {home() / 'jobs' / result['job_id']}")


def _end(job: Any, as_json: bool) -> None:
    """A job that ended: its result, and the exit status of its state (0 completed, 3 failed, 130 cancelled)."""
    state = job.status
    if state == "completed":
        print_json(job.result) if as_json else _print_result(job.result)
        return
    code = EXIT_CANCELLED if state == "cancelled" else EXIT_JOB_FAILED
    message = f"job {job.id} {state}: {job.error or 'no error recorded'}"
    if state == "cancelled":
        message += f" (the last committed checkpoint is kept; continue with `trainforge submit --resume {job.id}`)"
    fail(message, code, as_json)


@app.command()
def submit(
    spec_file: Path = typer.Argument(None, help="Job spec (YAML or JSON)."),
    resume: str | None = typer.Option(None, help="Continue this job (its id, or a job name: its newest job) from "
                                      "its last committed checkpoint."),
    deployment: bool = typer.Option(False, help="Trigger the `train-job` deployment (needs a Prefect server and "
                                    "a worker on the `trainforge` pool) instead of running the flow here; returns "
                                    "once the run is triggered."),
    overrides: list[str] = typer.Option(None, "--set", metavar="KEY=VALUE",
                                        help="Override one spec field by its dotted key, e.g. --set "
                                        "training.max_steps=100 (the value is read as YAML); validated like the "
                                        "file. Repeatable."),
    detach: bool = typer.Option(False, "--detach", "-d", help="Run the job in a background process of this host "
                                "and return its id at once (`trainforge logs JOB -f` follows it, `trainforge "
                                "cancel JOB` stops it)."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Print the workers' log lines as they are written "
                                "until the job ends (instead of the progress bar). With --detach, Ctrl-C stops "
                                "following and the job goes on."),
    rank: int | None = typer.Option(None, "--rank", help="With --follow: only this rank's lines."),
    as_json: bool = typer.Option(False, "--json", help="Print the result (or the error) as JSON."),
    backend: Backend = typer.Option(Backend.local, help="local: torchrun on this host; kubernetes: apply the "
                                    "rendered JobSet with the cluster's kubeconfig and follow its pods (see "
                                    "`trainforge render`)."),
    cluster: Path | None = typer.Option(None, help="Cluster description (--backend kubernetes)."),
    namespace: str = typer.Option("trainforge", help="Namespace (--backend kubernetes)."),
    image: str | None = typer.Option(None, help="Worker image (--backend kubernetes)."),
    kube_api: str | None = typer.Option(None, help="API server URL (--backend kubernetes; default: kubeconfig)."),
    timeout: float = typer.Option(86_400.0, help="Seconds to wait for the job (--backend kubernetes)."),
) -> None:
    """Submit a job: validate, resolve the dataset, plan, provision, train, evaluate and register the model.

    Exit status: 0 completed (or started, with --detach / --deployment), 1 invalid spec, 2 unreadable spec,
    3 the job failed, 130 cancelled.

    \b
    Examples:
      trainforge submit examples/tiny-cpu.yaml --set training.max_steps=20
      trainforge submit examples/tiny-cpu.yaml --detach
      trainforge submit --resume JOB
    """
    from trainforge.sdk import launch

    if spec_file is None and not resume:
        fail("give a job spec file, e.g. trainforge submit examples/tiny-cpu.yaml", as_json=as_json)
    if resume is not None:
        resume = resolve_job(resume, as_json).job_id
    if backend == "kubernetes":
        if overrides or detach or follow:
            fail("--set, --detach and --follow are for the local backend and --deployment; with --backend "
                 "kubernetes, edit the spec file", as_json=as_json)
        from trainforge.commands.production import submit_kubernetes

        if spec_file is None:
            fail("--backend kubernetes needs the spec file", as_json=as_json)
        return submit_kubernetes(spec_file, cluster=cluster, namespace=namespace, image=image, kube_api=kube_api,
                                 timeout_s=timeout, as_json=as_json)
    if deployment:
        sub = _prepare(spec_file, overrides=overrides, resume=resume, as_json=as_json)
        job = launch(sub, backend="deployment", detach=True)
        if as_json:
            print_json({"job_id": job.id, "flow_run_id": job.flow_run_id, "deployment": "train-job/train-job"})
        else:
            console.print(f"triggered flow run {job.flow_run_id} of deployment train-job/train-job: job {job.id}")
        return
    if detach:
        sub = _prepare(spec_file, overrides=overrides, resume=resume, as_json=as_json)
        job = launch(sub, detach=True)
        if not follow:
            if as_json:
                print_json({"job_id": job.id, "state": job.status, "detached": True})
            else:
                console.print(f"job [bold]{job.id}[/] started in the background: `trainforge logs {job.id} -f`, "
                              f"`trainforge status {job.id}`, `trainforge cancel {job.id}`")
            return
        err_console.print(f"job {job.id} started in the background; following its logs (Ctrl-C stops following, "
                          f"`trainforge cancel {job.id}` stops the job)")
        try:
            _print_log_lines(job, rank)
        except KeyboardInterrupt:
            err_console.print(f"stopped following; job {job.id} goes on")
            return
        return _end(job, as_json)
    from trainforge.sdk import Job

    job_id = None
    try:
        sub = _prepare(spec_file, overrides=overrides, resume=resume, as_json=as_json)
        job_id = sub.job_id
        run_job_from(sub, show_progress=not as_json, follow=follow, rank=rank)
    except KeyboardInterrupt:
        fail("cancelled: every worker was stopped; the last committed checkpoint is kept. Continue with "
             f"`trainforge submit --resume {job_id or 'JOB'}`.", EXIT_CANCELLED, as_json)
    except typer.Exit:
        raise
    except Exception as exc:
        job = Job(job_id or "")
        job._outcome = ("failed", str(exc))
        if job.record() is None:  # it failed before the job existed (e.g. the dataset): the error is all
            fail(f"job failed: {exc}", EXIT_JOB_FAILED, as_json)
        return _end(job, as_json)
    _end(Job(sub.job_id), as_json)


def run_job_from(sub: Any, *, show_progress: bool, follow: bool = False, rank: int | None = None) -> dict[str, Any]:
    """A prepared submission's flow in this process, with the progress bar or the followed logs."""
    from trainforge.sdk import Job, run_flow

    stop = threading.Event()
    thread = None
    if follow:
        thread = threading.Thread(target=_print_log_lines, args=(Job(sub.job_id), rank, stop.is_set),
                                  name="follow", daemon=True)
        thread.start()
    elif show_progress:
        from trainforge.registry.jobs import JobStore

        store = JobStore()

        def folder() -> Path | None:
            path = store.root / sub.job_id
            return path if path.is_dir() else None

        thread = _progress_thread(folder, sub.spec.training.total_steps, stop)
    try:
        return run_flow(sub)
    finally:
        stop.set()
        if thread is not None:
            thread.join(timeout=5)


class JobState(StrEnum):
    pending = "pending"
    running = "running"
    completed = "completed"
    failed = "failed"
    cancelled = "cancelled"


def select_records(records: list[Any], *, team: str | None = None, state: str | None = None,
                   limit: int = 20) -> list[Any]:
    """The newest `limit` jobs (oldest first, as listed) of a team and/or in a state."""
    chosen = [r for r in records if (team is None or r.data.get("team") == team)
              and (state is None or r.data.get("state") == state)]
    return chosen[-limit:] if limit > 0 else chosen


@app.command()
def status(
    job: str | None = typer.Argument(None, help=JOB_HELP + " Default: list recent jobs."),
    team: str | None = typer.Option(None, "--team", help="Only this team's jobs."),
    state: JobState | None = typer.Option(None, "--state", help="Only jobs in this state."),
    limit: int = typer.Option(20, "--limit", min=0, help="The newest N jobs (0: all)."),
    as_json: bool = typer.Option(False, "--json", help="Print as JSON."),
) -> None:
    """Show jobs (state, step, loss) or one job in detail. Job ids are printed whole."""
    from rich.table import Table

    from trainforge.contract.events import FATAL_INCIDENTS
    from trainforge.events import last_event
    from trainforge.registry.jobs import JobStore
    from trainforge.sdk import Job

    store = JobStore()
    if job is None:
        records = select_records(store.list(), team=team, state=state.value if state else None, limit=limit)
        if as_json:
            rows = []
            for r in records:
                m = last_event(r.events_path, "metrics") or {}
                rows.append({**{k: r.data.get(k) for k in ("job_id", "team", "state", "created_at")},
                             "step": m.get("step"), "loss": m.get("loss")})
            print_json(rows)
            return
        table = Table(title=None)
        # The id is what every other command takes: never cut (the other columns wrap first).
        table.add_column("job", no_wrap=True, min_width=max((len(r.job_id) for r in records), default=3))
        for name in ("team", "state", "step", "loss", "model"):
            table.add_column(name)
        for r in records:
            m = last_event(r.events_path, "metrics") or {}
            model = r.data.get("model") or {}
            table.add_row(r.job_id, r.data.get("team", ""), r.data.get("state", ""), str(m.get("step", "-")),
                          f"{m['loss']:.3f}" if "loss" in m else "-",
                          f"{model['model_name']} v{model['version']}" if model else "-")
        console.print(table)
        return
    record = resolve_job(job, as_json)
    data = {k: v for k, v in record.data.items() if k != "spec"}
    data["state"] = Job(record.job_id).status  # a detached job whose controller died is failed, not running
    data["last_metrics"] = last_event(record.events_path, "metrics")
    if as_json:
        print_json(data)
        return
    console.print(f"[bold]{record.job_id}[/] — {data.get('state')}")
    for key in ("team", "flow_run_id", "mlflow_run_id", "code_commit", "config_hash", "error"):
        if data.get(key):
            console.print(f"  {key:14}: {escape(str(data[key]))}")
    if data.get("dataset"):
        d = data["dataset"]
        console.print(f"  {'dataset':14}: {d['ref']} version {d['version'][:16]} license {d['license']}")
    if data["last_metrics"]:
        m = data["last_metrics"]
        console.print(f"  {'last step':14}: {m['step']} loss {m['loss']:.4f} ({m['tokens_per_s']:,.0f} tok/s)")
    incidents = data.get("incidents") or []
    for seg in data.get("segments", []):
        # what stopped a failed segment, as the supervisor named it (a lost host, a network cut and its sides)
        fatal = next((i for i in incidents if i.get("attempt") == seg["attempt"]
                      and i.get("kind") in FATAL_INCIDENTS), None)
        why = f" — {escape(fatal['message'])}" if fatal and seg["state"] == "failed" else ""
        console.print(f"  segment {seg['attempt']}: {seg['state']}{why}")
    if data.get("waiting"):
        w = data["waiting"]
        console.print(f"  {'waiting':14}: {escape(str(w.get('reason')))} (since "
                      f"{time.strftime('%H:%M:%S', time.localtime(w['since']))}, gives up at "
                      f"{time.strftime('%H:%M:%S', time.localtime(w['until']))})")


def _job(job: str, as_json: bool) -> Any:
    """The SDK's handle of the job a JOB argument names (commands/common.py `resolve_job`), or of a detached job
    not yet recorded, by its full id."""
    from trainforge.registry.jobs import JobNotFoundError, JobStore
    from trainforge.sdk import Job, detached_dir

    try:
        return Job(JobStore().get(job).job_id)
    except JobNotFoundError as exc:
        if job and "/" not in job and job not in (".", "..") and (detached_dir(job) / "process.json").is_file():
            return Job(job)
        job_lookup_failed(exc, as_json)
    except LookupError as exc:
        job_lookup_failed(exc, as_json)


@app.command()
def logs(
    job: str = typer.Argument(..., help=JOB_HELP),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines until the job ends."),
    rank: int | None = typer.Option(None, "--rank", help="Only this (global) rank; otherwise lines are prefixed "
                                    "[rank N]."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line: {job_id, rank, line}."),
) -> None:
    """The workers' output (torchrun's per-rank stdout and stderr) from the job folder, every segment in order."""
    from trainforge.sdk import rank_log_files

    handle = _job(job, as_json)
    if as_json:
        def emit(r: int, line: str) -> None:
            sys.stdout.write(json.dumps({"job_id": handle.id, "rank": r, "line": line.rstrip("\n")}) + "\n")

        if follow:
            import re

            pattern = re.compile(r"^\[rank (\d+)\] ")
            for line in handle.follow_logs(None):
                m = pattern.match(line)
                r = int(m.group(1)) if m else -1
                if rank is None or r == rank:
                    emit(r, line[m.end():] if m else line)
            return
        for r, path in rank_log_files(handle.folder / "logs", rank):
            for line in path.read_text(errors="replace").splitlines():
                emit(r, line)
        return
    try:
        if follow:
            _print_log_lines(handle, rank)
        else:
            console.out(handle.logs(rank), end="", highlight=False)
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


@app.command()
def cancel(
    job: str = typer.Argument(..., help=JOB_HELP),
    timeout: float = typer.Option(60.0, help="Seconds to wait for every worker to stop."),
    as_json: bool = typer.Option(False, "--json", help="Print the outcome as JSON."),
) -> None:
    """Cancel a job: every worker is stopped and the last committed checkpoint kept (`trainforge submit --resume
    JOB` continues it). A detached job's controller is interrupted; any other job is cancelled through its Prefect
    flow run (what the UI's Cancel button does). Exit status 0 once it is cancelled (or had already ended)."""
    handle = _job(job, as_json)
    before = handle.status
    try:
        after = handle.cancel(timeout)
    except RuntimeError as exc:
        fail(str(exc), as_json=as_json)
    if as_json:
        print_json({"job_id": handle.id, "was": before, "state": after})
    elif before in ("completed", "failed", "cancelled"):
        console.print(f"job {handle.id} had already ended: {before}")
    else:
        console.print(f"job {handle.id} {after}" + (" (every worker stopped)" if after == "cancelled" else ""))
    if after not in ("completed", "failed", "cancelled"):
        fail(f"job {handle.id} is still {after} after {timeout:.0f} s", EXIT_JOB_FAILED, as_json)


@app.command()
def checkpoints(
    job: str = typer.Argument(..., help=JOB_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print as JSON."),
    verify: bool = typer.Option(False, "--verify", help="Read back and hash every byte; quarantine corrupt ones."),
) -> None:
    """List a job's checkpoints: status (committed / in flight / quarantined), step, size, bytes written after
    deduplication, metrics. Exits 1 when --verify finds a corrupt checkpoint."""
    from rich.table import Table

    from trainforge.tasks.checkpoints import checkpoint_status, job_store

    record = resolve_job(job)
    config_path = record.folder / "worker-config.json"
    if not config_path.is_file():
        fail(f"job {record.job_id} never started training: it has no checkpoints")
    config = json.loads(config_path.read_text())
    rows = checkpoint_status(job_store(config), config["storage_prefix"], set(record.data.get("protected_steps", [])),
                             verify_files=verify)
    corrupt = [r for r in rows if r.get("problems")]
    if as_json:
        print_json(rows)
    else:
        table = Table("step", "status", "train loss", "eval loss", "size", "written", "protected", "prefix")
        for row in rows:
            size = f"{row['bytes'] / 1e6:.1f} MB" if "bytes" in row else "-"
            written = f"{row['bytes_written'] / 1e6:.1f} MB" if "bytes_written" in row else "-"
            status = row["status"] + (" ✓" if row.get("verified") else "")
            table.add_row(str(row["step"]), status,
                          f"{row['train_loss']:.4f}" if isinstance(row.get("train_loss"), float) else "-",
                          f"{row['eval_loss']:.4f}" if "eval_loss" in row else "-", size, written,
                          "yes" if row["protected"] else "", row["prefix"])
        console.print(table)
        for row in corrupt:
            err_console.print(f"step {row['step']} is corrupt (quarantined): {'; '.join(row['problems'])}")
    if corrupt:
        raise typer.Exit(1)


@app.command()
def demo(
    spec_file: Path = typer.Option(example_path("tiny-cpu.yaml"), help="The demo job spec."),
    as_json: bool = typer.Option(False, "--json", help="No progress bar; print the job's result (or the error) "
                                 "as JSON."),
) -> None:
    """Build the demo dataset if missing, then submit the tiny CPU job and print where to look."""
    from trainforge.datasets.demo import ensure_demo_dataset

    t0 = time.monotonic()
    if as_json:
        ds = ensure_demo_dataset()
    else:
        with console.status("building the demo dataset (Python stdlib sources, byte-level tokens)"):
            ds = ensure_demo_dataset()
        console.print(f"dataset catalog://{ds.name}@main = version {ds.version[:16]} "
                      f"({ds.manifest.num_samples:,} samples, license {ds.license})")
    try:
        result = run_job(spec_file, show_progress=not as_json)
    except typer.Exit:
        raise
    except Exception as exc:
        fail(f"demo failed: {exc}", EXIT_JOB_FAILED)
    if as_json:
        print_json({**result, "dataset": {"name": ds.name, "version": ds.version}})
        return
    _print_result(result)
    console.print(f"demo finished in {time.monotonic() - t0:.0f} s")
