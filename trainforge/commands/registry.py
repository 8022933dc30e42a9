"""`trainforge promote | model alias | model stage | lineage ...`: the model registry and the lineage queries.

  trainforge promote JOB --step N | --best [--alias candidate|champion|none] [--stage Staging]
  trainforge model alias NAME VERSION champion          trainforge model stage NAME VERSION Production
  trainforge lineage datasets-of MODEL                  (models:/team.name/3, team.name/3, JOB@STEP, JOB)
  trainforge lineage trained-on DATASET[@VERSION] [--file PATH|PREFIX/|GLOB]
  trainforge lineage license CLASS|SPDX|GLOB            (non-commercial, copyleft, CC-BY-NC*, MIT, ...)
  trainforge lineage withdraw DATASET@VERSION --why TEXT [--quarantine] [--who NAME]
Every query prints a table, or JSON with --json.
"""

from __future__ import annotations

from typing import Any

import typer

from trainforge.cli import app, new_typer
from trainforge.commands.choices import Alias, ModelAlias, Stage
from trainforge.commands.common import JOB_HELP, console, fail, job_lookup_failed, print_json, resolve_job

model_app = new_typer("Model registry: aliases and stages of registered model versions.")
lineage_app = new_typer("Lineage for legal: what was trained on what, licenses, withdrawals.")
app.add_typer(model_app, name="model")
app.add_typer(lineage_app, name="lineage")


@app.command()
def promote(
    job: str = typer.Argument(..., help=JOB_HELP),
    step: int | None = typer.Option(None, help="Promote this committed checkpoint step."),
    best: bool = typer.Option(False, "--best", help="Promote the best checkpoint (keep_best metric, else newest)."),
    alias: Alias = typer.Option(Alias.candidate, help="Alias for the new version (none: no alias)."),
    stage: Stage | None = typer.Option(None, case_sensitive=False, help="MLflow stage of the new version."),
    as_json: bool = typer.Option(False, "--json", help="Print as JSON."),
) -> None:
    """Register a committed checkpoint of a job as a model version (safetensors + config + lineage metadata);
    the checkpoint is protected from retention afterwards."""
    from trainforge.registry.lineage import QuarantinedError
    from trainforge.registry.promotion import promote as do_promote

    job = resolve_job(job, as_json).job_id
    try:
        result = do_promote(job, step=step, best=best, alias=None if alias == Alias.none else alias.value,
                            stage=stage.value if stage else None)
    except (LookupError, ValueError, QuarantinedError) as exc:
        fail(str(exc))
    if as_json:
        print_json(result)
        return
    console.print(f"[green]✓[/] {result['model_name']} v{result['version']} from step {result['step']} "
                  f"(alias {result['alias'] or '-'}, stage {result['stage'] or '-'})")
    console.print(f"  safetensors : {result['path']}")
    console.print(f"  protected   : steps {result['protected_steps']}")


@model_app.command("alias")
def model_alias(name: str = typer.Argument(..., help="Registered model name, e.g. demo.tiny-cpu."),
                version: str = typer.Argument(..., help="Model version number."),
                alias: ModelAlias = typer.Argument(..., help="The alias to point at the version."),
                as_json: bool = typer.Option(False, "--json", help="Print {name, version, alias} as JSON.")) -> None:
    """Point an alias (champion, candidate) at a model version."""
    from trainforge.registry.lineage import QuarantinedError
    from trainforge.registry.promotion import set_alias

    try:
        set_alias(name, version, alias.value)
    except (ValueError, QuarantinedError) as exc:
        fail(str(exc))
    if as_json:
        print_json({"name": name, "version": version, "alias": alias.value})
        return
    console.print(f"[green]✓[/] {name}@{alias} -> v{version}")


@model_app.command("stage")
def model_stage(name: str = typer.Argument(..., help="Registered model name, e.g. demo.tiny-cpu."),
                version: str = typer.Argument(..., help="Model version number."),
                stage: Stage = typer.Argument(..., case_sensitive=False, help="The stage to move it to."),
                as_json: bool = typer.Option(False, "--json", help="Print {name, version, stage} as JSON.")) -> None:
    """Move a model version to an MLflow stage (None, Staging, Production, Archived)."""
    from trainforge.registry.lineage import QuarantinedError
    from trainforge.registry.promotion import transition_stage

    try:
        new = transition_stage(name, version, stage.value)
    except (ValueError, QuarantinedError) as exc:
        fail(str(exc))
    if as_json:
        print_json({"name": name, "version": version, "stage": new})
        return
    console.print(f"[green]✓[/] {name} v{version} -> {new}")


def _table(title: str, rows: list[dict[str, Any]], columns: tuple[str, ...]) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(*columns, title=title)
    for row in rows:
        table.add_row(*(escape(str(row.get(c, ""))) for c in columns))
    console.print(table)


def _split(dataset: str) -> tuple[str | None, str | None]:
    name, _, version = dataset.partition("@")
    return name or None, version or None


def _emit(result: dict[str, Any], as_json: bool, sections: dict[str, tuple[str, ...]]) -> None:
    from trainforge.registry.lineage import node_table

    data = {k: node_table(v) for k, v in result.items()}
    if as_json:
        print_json(data)
        return
    for key, columns in sections.items():
        _table(key, data[key], columns)


def _job_target(target: str, as_json: bool) -> str:
    """A lineage target whose JOB (`JOB`, `JOB@STEP`) is resolved like every JOB argument (commands/common.py
    `resolve_job`) to the node id of that job or its checkpoint; a job this host has no record of stays as typed
    (its lineage may come from another host)."""
    from trainforge.registry.jobs import JobNotFoundError, JobStore
    from trainforge.registry.lineage import parse_target

    kind, _, rest = parse_target(target).partition(":")
    if kind not in ("job", "checkpoint"):
        return target
    job, at, step = rest.rpartition("@") if kind == "checkpoint" else (rest, "", "")
    try:
        job_id = JobStore().get(job).job_id
    except JobNotFoundError:
        return target
    except LookupError as exc:
        job_lookup_failed(exc, as_json)
    return f"{kind}:{job_id}{at}{step}"


@lineage_app.command("datasets-of")
def datasets_of(target: str = typer.Argument(..., help="models:/team.name/3, team.name/3, JOB@STEP or JOB (a "
                                            "job id, or a job name: its newest job)."),
                as_json: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """Datasets (version, license, provenance) a model version, checkpoint or job was trained on, directly or
    through resume and fine-tuning ancestry."""
    from trainforge.registry.lineage import LineageStore

    try:
        found = LineageStore().datasets_of(_job_target(target, as_json))
    except LookupError as exc:
        fail(str(exc))
    _emit({"datasets": found}, as_json, {"datasets": ("name", "version", "license", "license_class", "status")})


@lineage_app.command("trained-on")
def trained_on(dataset: str = typer.Argument("", help="NAME or NAME@VERSION (a version prefix is fine), or an "
                                             "s3:// prefix or object key (datasets read in place)."),
               file: str | None = typer.Option(None, help="Any version containing this file, PREFIX/ or glob."),
               as_json: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """Checkpoints and model versions trained on a dataset (by name, version or contained file), directly or
    through fine-tuning ancestry: each model with the checkpoint it was promoted from, marked when the dataset
    version is withdrawn."""
    from trainforge.registry.lineage import LineageStore

    if dataset.startswith("s3://"):  # a prefix or one object of datasets read in place: a query by file
        if file:
            fail("give an s3:// prefix or object either as the argument or as --file, not both")
        dataset, file = "", dataset
    name, version = _split(dataset)
    if not name and not file:
        fail("give a dataset (NAME[@VERSION]) or --file PATH")
    _emit_rows(LineageStore().trained_on_report(name, version, file), as_json)


_DATASET_COLUMNS = ("name", "version", "license", "status", "withdrawn_by", "withdrawn_at", "withdrawn_why")
_AFFECTED_COLUMNS = ("kind", "name", "version", "team", "status", "checkpoint", "prefix", "withdrawn")


def _emit_rows(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print_json(result)
        return
    _table("datasets", result["datasets"], _DATASET_COLUMNS)
    if "jobs" in result:
        _table("jobs", result["jobs"], ("name", "team", "license", "status"))
    _table("affected", result["affected"], _AFFECTED_COLUMNS)
    for line in result.get("tagged", []):
        console.print(f"  tagged {line} (trainforge.dataset_withdrawn)")
    for node in result.get("not_in_mlflow", []):
        console.print(f"  not in MLflow any more (nothing to tag): {node}")


@lineage_app.command("license")
def by_license(license: str = typer.Argument(..., help="A license class (non-commercial, copyleft, ...), an SPDX "
                                             "id (MIT) or a glob (CC-BY-NC*)."),
               as_json: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """Runs that used a dataset of a license class (non-commercial, copyleft, ...), SPDX id or glob."""
    from trainforge.registry.lineage import LineageStore

    result = LineageStore().runs_by_license(license)
    _emit(result, as_json, {"datasets": ("name", "version", "license", "license_class"),
                            "jobs": ("name", "team", "license", "status")})


@lineage_app.command("withdraw")
def withdraw(dataset: str = typer.Argument(..., help="NAME@VERSION"),
             why: str = typer.Option(..., help="Why (recorded for the audit)."),
             quarantine: bool = typer.Option(False, "--quarantine", help="Also mark every affected checkpoint and "
                                             "model version quarantined (they are refused for promotion either way)."),
             who: str | None = typer.Option(None, help="Who (default: $TRAINFORGE_USER or the login)."),
             as_json: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """Withdraw a dataset version: no job may resolve it from now on, what was trained on it is tagged
    trainforge.dataset_withdrawn in MLflow and refused for promotion; lists everything trained on it."""
    from trainforge.registry.lineage_withdrawal import withdraw as do_withdraw

    name, version = _split(dataset)
    if not name or not version:
        fail("give the dataset version as NAME@VERSION")
    try:
        result = do_withdraw(name, version, who=who, why=why, quarantine=quarantine)
    except (LookupError, ValueError) as exc:
        fail(str(exc))
    if result["tag_errors"]:
        if not as_json:
            _emit_rows(result, as_json)
        fail("the withdrawal is recorded (no job can resolve the version), but some MLflow tags could not be set: "
             + "; ".join(result["tag_errors"]) + ". Run the same `trainforge lineage withdraw` again to retry them",
             extra=result)
    _emit_rows(result, as_json)
