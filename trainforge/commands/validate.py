"""`trainforge validate` and `trainforge schema`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape

from trainforge.cli import app
from trainforge.commands.common import (
    EXIT_INVALID,
    EXIT_OK,
    EXIT_UNREADABLE,
    console,
    err_console,
    load_cluster_option,
    print_json,
    render_problem,
    resolve_cluster,
)
from trainforge.spec import SpecError

if TYPE_CHECKING:
    from trainforge.validate import ValidationReport


@app.command()
def validate(
    spec_file: Path = typer.Argument(..., help="Job spec (YAML or JSON)."),
    cluster: Path | None = typer.Option(None, help="Target cluster description (default: $TRAINFORGE_CLUSTER, "
                                        "else this machine)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON on stdout."),
    strict: bool = typer.Option(False, help="Treat checks that could not be run ('not checked') as errors."),
) -> None:
    """Dry-run a job spec: no process started, no GPU taken. Reports every problem at once, each with the field,
    the value, why it is wrong and how to fix it.

    Exit status: 0 valid, 1 invalid, 2 unreadable file (spec or cluster description).

    \b
    Examples:
      trainforge validate examples/tiny-cpu.yaml
      trainforge validate examples/llama-70b-pretrain.yaml --cluster examples/clusters/fleet-10k.yaml --json
    """
    from trainforge.validate import ValidationReport, validate_file

    if as_json:
        try:
            target = resolve_cluster(cluster)
        except SpecError as exc:
            # The same report shape as for a spec, so scripts parse one format; the source names the cluster file.
            report = ValidationReport(exc.source, problems=exc.problems, unreadable=True)
            print_json(_json_report(report, strict, EXIT_UNREADABLE, f"cluster description {exc.source}"))
            raise typer.Exit(EXIT_UNREADABLE) from None
    else:
        target = load_cluster_option(cluster)
    report = validate_file(spec_file, target)
    code = EXIT_UNREADABLE if report.unreadable else (EXIT_OK if report.ok(strict) else EXIT_INVALID)
    if as_json:
        print_json(_json_report(report, strict, code, str(spec_file)))
        raise typer.Exit(code)
    out = console if code == EXIT_OK else err_console
    for p in report.problems:
        out.print(render_problem(p, strict))
    name = escape(str(spec_file))
    if code == EXIT_OK:
        extra = ""
        if report.layout is not None:
            extra = f" layout {report.layout.describe()}"
        if report.memory_per_gpu_bytes is not None:
            extra += f", ~{report.memory_per_gpu_bytes / 2**30:.2f} GiB per GPU"
        console.print(f"[green]✓[/] {name} is valid.{extra}")
    elif code == EXIT_UNREADABLE:
        err_console.print(f"[bold red]✗ {name}: cannot be read[/]")
    else:
        n = len(report.errors(strict))
        err_console.print(f"[bold red]✗ {name}: {n} problem(s)[/]")
    raise typer.Exit(code)


def _json_report(report: ValidationReport, strict: bool, code: int, source: str) -> dict[str, Any]:
    """The report as JSON; a failing one also carries `error` and `exit_code`, as every command's JSON error does."""
    data = report.to_dict(strict)
    if code != EXIT_OK:
        what = "cannot be read" if code == EXIT_UNREADABLE else f"{len(report.errors(strict))} problem(s)"
        data.update(error=f"{source}: {what}", exit_code=code)
    return data


@app.command()
def schema(as_json: bool = typer.Option(False, "--json", help="Accepted for symmetry: the schema is always "
                                        "printed as JSON.")) -> None:
    """Print the JSON Schema of the job spec (every field with its description).

    \b
    Example:
      trainforge schema > jobspec.schema.json
    """
    from trainforge.spec import json_schema

    print_json(json_schema())
