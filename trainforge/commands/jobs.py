"""`trainforge submit | status | checkpoints | demo`: run and inspect training jobs."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import typer

from trainforge.cli import app
from trainforge.commands.common import EXIT_INVALID, console, err_console, fail, print_json, print_spec_error
from trainforge.spec import SpecError, read_document


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


def run_job(spec_file: Path, *, job_id: str | None = None, resume: bool = False, show_progress: bool = True
            ) -> dict[str, Any]:
    """Run the train-job flow in this process (Prefect's ephemeral API when no server is configured)."""
    from trainforge.flows.train_job import train_job
    from trainforge.registry.jobs import JobStore, new_job_id
    from trainforge.validate import ValidationReport, validate_document

    # Read and validated once, here (the precise errors before anything is allocated); the flow reuses the report.
    try:
        doc = read_document(spec_file)
    except SpecError as exc:
        doc, report = None, ValidationReport(str(spec_file), problems=exc.problems, unreadable=True)
    else:
        report = validate_document(doc, str(spec_file), spec_file.resolve().parent)
    if not report.ok():
        print_spec_error(SpecError(report.errors(), str(spec_file), report.unreadable))
    assert report.spec is not None
    job_id = job_id or new_job_id(report.spec.name)
    store = JobStore()
    stop = threading.Event()
    thread = None
    if show_progress:
        def folder() -> Path | None:
            path = store.root / job_id
            return path if path.is_dir() else None

        thread = _progress_thread(folder, report.spec.training.total_steps, stop)
    try:
        return train_job(doc, str(spec_file), str(spec_file.resolve().parent), job_id, resume, validated=report)
    finally:
        stop.set()
        if thread is not None:
            thread.join(timeout=2)


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


@app.command()
def submit(
    spec_file: Path = typer.Argument(None, help="Job spec (YAML or JSON)."),
    resume: str | None = typer.Option(None, help="Continue this job id from its last committed checkpoint."),
    deployment: bool = typer.Option(False, help="Trigger the `train-job` deployment (needs a Prefect server and "
                                    "a worker on the `trainforge` pool) instead of running the flow here."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    backend: str = typer.Option("local", help="`local` (torchrun on this host) or `kubernetes` (apply the rendered "
                                "JobSet with the cluster's kubeconfig and follow its pods; see `trainforge render`)."),
    cluster: Path | None = typer.Option(None, help="Cluster description (--backend kubernetes)."),
    namespace: str = typer.Option("trainforge", help="Namespace (--backend kubernetes)."),
    image: str | None = typer.Option(None, help="Worker image (--backend kubernetes)."),
    kube_api: str | None = typer.Option(None, help="API server URL (--backend kubernetes; default: kubeconfig)."),
    timeout: float = typer.Option(86_400.0, help="Seconds to wait for the job (--backend kubernetes)."),
) -> None:
    """Submit a job: validate, resolve the dataset, plan, provision, train, evaluate and register the model.

    Example: trainforge submit examples/tiny-cpu.yaml
    """
    from trainforge.registry.jobs import JobStore

    if resume:
        try:
            record = JobStore().get(resume)
        except LookupError as exc:
            fail(str(exc))
        if spec_file is None:
            source = Path(record.data.get("source", ""))
            if not source.is_file():
                fail(f"the spec file of job {record.job_id} ({source}) is gone; pass it: trainforge submit SPEC "
                     f"--resume {record.job_id}")
            spec_file = source
    if spec_file is None:
        fail("give a job spec file, e.g. trainforge submit examples/tiny-cpu.yaml")
    if backend == "kubernetes":
        from trainforge.commands.production import submit_kubernetes

        return submit_kubernetes(spec_file, cluster=cluster, namespace=namespace, image=image, kube_api=kube_api,
                                 timeout_s=timeout, as_json=as_json)
    if backend != "local":
        fail(f"unknown backend {backend!r}: use local or kubernetes")
    if deployment:
        from prefect.deployments import run_deployment

        doc = read_document(spec_file)
        run = run_deployment("train-job/train-job", parameters={
            "spec": doc, "source": str(spec_file), "base_dir": str(spec_file.resolve().parent),
            "job_id": resume, "resume": bool(resume)}, timeout=0)
        console.print(f"triggered flow run {run.id} of deployment train-job/train-job")
        return
    try:
        result = run_job(spec_file, job_id=resume, resume=bool(resume), show_progress=not as_json)
    except KeyboardInterrupt:
        err_console.print("[yellow]cancelled[/]: every worker was stopped; the last committed checkpoint is kept. "
                          "Continue with `trainforge submit --resume JOB`.")
        raise typer.Exit(130) from None
    except Exception as exc:
        err_console.print(f"[bold red]job failed:[/] {exc}")
        raise typer.Exit(EXIT_INVALID) from None
    if as_json:
        print_json(result)
    else:
        _print_result(result)


@app.command()
def status(
    job: str | None = typer.Argument(None, help="Job id or name (default: list recent jobs)."),
    as_json: bool = typer.Option(False, "--json", help="Print as JSON."),
) -> None:
    """Show jobs (state, step, loss) or one job in detail."""
    from rich.table import Table

    from trainforge.events import last_event
    from trainforge.registry.jobs import JobStore

    store = JobStore()
    if job is None:
        records = store.list()[-20:]
        if as_json:
            print_json([{k: r.data.get(k) for k in ("job_id", "team", "state", "created_at")} for r in records])
            return
        table = Table("job", "team", "state", "step", "loss", "model")
        for r in records:
            m = last_event(r.events_path, "metrics") or {}
            model = r.data.get("model") or {}
            table.add_row(r.job_id, r.data.get("team", ""), r.data.get("state", ""), str(m.get("step", "-")),
                          f"{m['loss']:.3f}" if "loss" in m else "-",
                          f"{model['model_name']} v{model['version']}" if model else "-")
        console.print(table)
        return
    try:
        record = store.get(job)
    except LookupError as exc:
        fail(str(exc))
    data = {k: v for k, v in record.data.items() if k != "spec"}
    data["last_metrics"] = last_event(record.events_path, "metrics")
    if as_json:
        print_json(data)
        return
    console.print(f"[bold]{record.job_id}[/] — {data.get('state')}")
    for key in ("team", "flow_run_id", "mlflow_run_id", "code_commit", "config_hash", "error"):
        if data.get(key):
            console.print(f"  {key:14}: {data[key]}")
    if data.get("dataset"):
        d = data["dataset"]
        console.print(f"  {'dataset':14}: {d['ref']} version {d['version'][:16]} license {d['license']}")
    if data["last_metrics"]:
        m = data["last_metrics"]
        console.print(f"  {'last step':14}: {m['step']} loss {m['loss']:.4f} ({m['tokens_per_s']:,.0f} tok/s)")
    for seg in data.get("segments", []):
        console.print(f"  segment {seg['attempt']}: {seg['state']}")


@app.command()
def checkpoints(
    job: str = typer.Argument(..., help="Job id or name."),
    as_json: bool = typer.Option(False, "--json", help="Print as JSON."),
    verify: bool = typer.Option(False, "--verify", help="Read back and hash every byte; quarantine corrupt ones."),
) -> None:
    """List a job's checkpoints: status (committed / in flight / quarantined), step, size, bytes written after
    deduplication, metrics. Exits 1 when --verify finds a corrupt checkpoint."""
    from rich.table import Table

    from trainforge.registry.jobs import JobStore
    from trainforge.tasks.checkpoints import checkpoint_status, job_store

    try:
        record = JobStore().get(job)
    except LookupError as exc:
        fail(str(exc))
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
    spec_file: Path = typer.Option(Path(__file__).resolve().parents[2] / "examples" / "tiny-cpu.yaml",
                                   help="The demo job spec."),
) -> None:
    """Build the demo dataset if missing, then submit the tiny CPU job and print where to look."""
    from trainforge.datasets.demo import ensure_demo_dataset

    t0 = time.monotonic()
    with console.status("building the demo dataset (Python stdlib sources, byte-level tokens)"):
        ds = ensure_demo_dataset()
    console.print(f"dataset catalog://{ds.name}@main = version {ds.version[:16]} "
                  f"({ds.manifest.num_samples:,} samples, license {ds.license})")
    try:
        result = run_job(spec_file)
    except Exception as exc:
        err_console.print(f"[bold red]demo failed:[/] {exc}")
        raise typer.Exit(EXIT_INVALID) from None
    _print_result(result)
    console.print(f"demo finished in {time.monotonic() - t0:.0f} s")
