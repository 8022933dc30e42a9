"""`trainforge chaos JOB.yaml --scenario NAME`: run the job with a named fault and report detection, MTTR and lost
work from the run's own records (trainforge/tasks/chaos.py)."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from trainforge.cli import app
from trainforge.commands.common import EXIT_INVALID, console, err_console, fail, print_json, print_spec_error
from trainforge.spec import SpecError, read_document

# The drill machinery imports the launcher and the scheduler: loaded when the command runs (CLI start-up stays
# light), so the scenario names are repeated here for --help; a test keeps both lists equal.
SCENARIO_NAMES = ("kill", "stop", "hang", "nan", "sigterm", "straggler", "storeout", "node", "wave")
Scenario = StrEnum("Scenario", {name: name for name in SCENARIO_NAMES})  # --help lists them, click checks them


@app.command()
def chaos(
    spec_file: Path = typer.Argument(..., help="Job spec (YAML or JSON) to drill."),
    scenario: list[Scenario] = typer.Option(..., "--scenario", "-s", help="Fault scenario; repeatable."),
    step: int | None = typer.Option(None, help="0-based step at which the fault fires (default: after the first "
                                    "checkpoint)."),
    as_json: bool = typer.Option(False, "--json", help="Print the measurements as JSON."),
) -> None:
    """Chaos drill: run the job on this machine (real torchrun workers, real checkpoints) with a fault injected,
    let the platform detect and recover it, and print per scenario the detection latency, the MTTR (detection ->
    first step completed after the restore), the steps of lost work and the recovery tier.

    A gang of more than one node runs as one torchrun agent per node, placed by the live scheduler on an emulated
    cluster with one spare node. Each scenario is a new job (its records stay under $TRAINFORGE_HOME/jobs).

    Exit status: 0 every drilled job completed, 1 a job did not recover (its failure report is printed) or the
    scenario / spec is invalid, 2 unreadable spec.

    \b
    Examples:
      trainforge chaos examples/tiny-cpu.yaml --scenario kill
      trainforge chaos examples/tiny-cpu.yaml -s nan -s sigterm --step 12
    """
    try:
        doc = read_document(spec_file)
    except SpecError as exc:
        print_spec_error(exc)
    from trainforge.registry.jobs import new_job_id
    from trainforge.tasks.chaos import ScenarioError, drill
    from trainforge.tasks.prepare import JobRejected

    base = spec_file.resolve().parent
    name = doc.get("name", "job") if isinstance(doc, dict) else "job"
    rows = []
    for sc in (s.value for s in scenario):
        job_id = new_job_id(f"chaos-{name}-{sc}")
        if not as_json:
            console.print(f"[bold]{escape(sc)}[/]: running {escape(str(spec_file))} as job {escape(job_id)} ...")
        try:
            rows.append(drill(doc, str(spec_file), base, sc, job_id=job_id, step=step))
        except (ScenarioError, JobRejected) as exc:
            fail(str(exc))
    if as_json:
        print_json(rows)
    else:
        console.print(_table(rows))
        for r in rows:
            if r["error"]:
                err_console.print(f"[bold red]{escape(r['scenario'])}[/]: the job did not recover:\n"
                                  f"{escape(r['error'])}")
    if any(r["state"] != "completed" for r in rows):
        raise typer.Exit(EXIT_INVALID)


def _table(rows: list[dict]) -> Table:
    table = Table(title="chaos drill (detection: fault -> detected; MTTR: detected -> first step after restore)")
    for col, just in (("scenario", "left"), ("fault", "left"), ("detected", "left"), ("detection s", "right"),
                      ("MTTR s", "right"), ("lost steps", "right"), ("tier", "left"), ("segments", "right"),
                      ("resizes", "right"), ("outcome", "left"), ("wall s", "right")):
        table.add_column(col, justify=just)  # type: ignore[arg-type]

    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    for r in rows:
        outcome = (f"[green]completed[/] step {r['final_step']}/{r['total_steps']}" if r["state"] == "completed"
                   else "[red]failed[/]")
        table.add_row(escape(r["scenario"].split(":")[0]), escape(r["fault"][:40]), escape(r["detected"] or "-"),
                      num(r["detection_s"]), num(r["mttr_s"]),
                      "-" if r["lost_steps"] is None else str(r["lost_steps"]), escape(r["tier"] or "-"),
                      str(r["segments"]), str(len(r["resizes"])), outcome, f"{r['wall_s']:.1f}")
    return table
