"""`trainforge validate` and `trainforge schema`."""

from __future__ import annotations

from pathlib import Path

import typer

from trainforge.cli import app
from trainforge.commands.common import (
    EXIT_INVALID,
    EXIT_OK,
    EXIT_UNREADABLE,
    console,
    err_console,
    load_cluster_option,
    print_json,
)

ICONS = {"error": "[red]✗[/]", "not-checked": "[yellow]?[/]", "warning": "[yellow]![/]"}


@app.command()
def validate(
    spec_file: Path = typer.Argument(..., help="Job spec (YAML or JSON)."),
    cluster: Path | None = typer.Option(None, help="Target cluster description (default: $TRAINFORGE_CLUSTER, "
                                        "else this machine)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    strict: bool = typer.Option(False, help="Treat checks that could not be run ('not checked') as errors."),
) -> None:
    """Dry-run a job spec: no process started, no GPU taken. Reports every problem at once.

    Exit status: 0 valid, 1 invalid, 2 unreadable file.

    Example: trainforge validate examples/llama-70b-pretrain.yaml --cluster examples/clusters/fleet-10k.yaml
    """
    from trainforge.validate import validate_file

    report = validate_file(spec_file, load_cluster_option(cluster))
    code = EXIT_UNREADABLE if report.unreadable else (EXIT_OK if report.ok(strict) else EXIT_INVALID)
    if as_json:
        print_json(report.to_dict(strict))
        raise typer.Exit(code)
    out = console if code == EXIT_OK else err_console
    for p in report.problems:
        out.print(f"  {ICONS[p.severity]} {p.render()}" + (" [dim](not checked)[/]" if p.severity == "not-checked"
                                                            else ""))
    if code == EXIT_OK:
        extra = ""
        if report.layout is not None:
            extra = f" layout {report.layout.describe()}"
        if report.memory_per_gpu_bytes is not None:
            extra += f", ~{report.memory_per_gpu_bytes / 2**30:.2f} GiB per GPU"
        console.print(f"[green]✓[/] {spec_file} is valid.{extra}")
    else:
        n = len(report.errors(strict))
        err_console.print(f"[bold red]✗ {spec_file}: {n} problem(s)[/]")
    raise typer.Exit(code)


@app.command()
def schema() -> None:
    """Print the JSON Schema of the job spec (every field with its description)."""
    from trainforge.spec import json_schema

    print_json(json_schema())
