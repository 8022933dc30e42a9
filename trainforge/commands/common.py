"""Helpers shared by CLI commands: one console, and turning user errors into messages with exit codes."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console

from trainforge.spec import SpecError

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)

EXIT_OK, EXIT_INVALID, EXIT_UNREADABLE = 0, 1, 2


def fail(message: str, code: int = EXIT_INVALID) -> NoReturn:
    err_console.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(code)


def print_spec_error(exc: SpecError) -> NoReturn:
    err_console.print(f"[bold red]{exc.source}[/]: {len(exc.problems)} problem(s)")
    for p in exc.problems:
        err_console.print(f"  [red]✗[/] {p.render()}")
    raise typer.Exit(EXIT_UNREADABLE if exc.unreadable else EXIT_INVALID)


def load_cluster_option(path: Path | None):  # -> ClusterSpec
    from trainforge.plan.cluster import default_cluster, load_cluster

    try:
        return load_cluster(path) if path else default_cluster()
    except SpecError as exc:
        print_spec_error(exc)


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
