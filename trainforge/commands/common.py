"""Helpers shared by CLI commands: one console, and turning user errors into messages with exit codes.

User text (paths, values, messages that quote them) goes through `escape` before rich prints it: a value such as
`[/x]` would otherwise be read as markup and crash the command with a traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape

from trainforge.spec import Problem, SpecError

if TYPE_CHECKING:
    from trainforge.plan.cluster import ClusterSpec
    from trainforge.registry.jobs import JobRecord

console = Console(highlight=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)

# The exit statuses of every command, in one place (docs/cli.md lists them): 1 an invalid spec or another user
# error, 2 an unreadable file (or a usage error, click's own), 3 the job ran and failed, 130 the job was cancelled
# (128 + SIGINT, what a shell reports for Ctrl-C).
EXIT_OK, EXIT_INVALID, EXIT_UNREADABLE, EXIT_JOB_FAILED, EXIT_CANCELLED = 0, 1, 2, 3, 130

# The help of every JOB argument: what resolve_job accepts.
JOB_HELP = "Job id, or job name (its newest job)."

ICONS = {"error": "[red]✗[/]", "not-checked": "[yellow]?[/]", "warning": "[yellow]![/]"}


def json_mode() -> bool:
    """Whether the running command was given --json (every command names that option `as_json`)."""
    try:  # typer >= 0.29 vendors click (trainforge/cli.py)
        from typer._click.globals import get_current_context
    except ImportError:  # pragma: no cover
        from click import get_current_context

    ctx = get_current_context(silent=True)
    return bool(ctx is not None and ctx.params.get("as_json"))


def fail(message: str, code: int = EXIT_INVALID, as_json: bool | None = None,
         extra: dict[str, Any] | None = None) -> NoReturn:
    """Stop the command with `message`: rich text on stderr, or under --json `{"error": ..., "exit_code": ...}`
    (plus `extra`, what the command did get done) on stdout: a script parses stdout; the exit status says it
    failed. `as_json` defaults to the running command's --json."""
    if as_json is None:
        as_json = json_mode()
    if as_json:
        print_json({**(extra or {}), "error": message, "exit_code": code})
    else:
        err_console.print(f"[bold red]error:[/] {escape(message)}")
    raise typer.Exit(code)


def resolve_job(job: str, as_json: bool | None = None) -> JobRecord:
    """The job record a JOB argument names (registry/jobs.py `JobStore.get`: an exact id, else the newest job
    of that name); anything else stops the command with the resolver's message (exit 1), under --json with the
    candidates of an ambiguous argument."""
    from trainforge.registry.jobs import JobStore

    try:
        return JobStore().get(job)
    except LookupError as exc:
        job_lookup_failed(exc, as_json)


def job_lookup_failed(exc: LookupError, as_json: bool | None = None) -> NoReturn:
    """Stop the command for a JOB argument that names no job, or several (`fail`, exit 1)."""
    from trainforge.registry.jobs import AmbiguousJobError

    extra = None
    if isinstance(exc, AmbiguousJobError):
        extra = {"candidates": [{"job_id": r.job_id, "name": r.name, "created_at": r.created_at, "state": r.state}
                                for r in exc.candidates]}
    fail(str(exc), as_json=as_json, extra=extra)


def render_problem(problem: Problem, strict: bool = False) -> str:
    """One problem as a rich-markup line; not-checked items are marked (as errors under --strict)."""
    tag = ""
    if problem.severity == "not-checked":
        tag = " [red](not checked: an error under --strict)[/]" if strict else " [dim](not checked)[/]"
    icon = ICONS["error"] if strict and problem.severity == "not-checked" else ICONS[problem.severity]
    return f"  {icon} {escape(problem.render())}{tag}"


def print_spec_error(exc: SpecError, as_json: bool | None = None) -> NoReturn:
    code = EXIT_UNREADABLE if exc.unreadable else EXIT_INVALID
    if as_json is None:
        as_json = json_mode()
    if as_json:
        print_json({"error": f"{exc.source}: {len(exc.problems)} problem(s)", "exit_code": code,
                    "problems": [p.to_dict() for p in exc.problems]})
        raise typer.Exit(code)
    err_console.print(f"[bold red]{escape(exc.source)}[/]: {len(exc.problems)} problem(s)")
    for p in exc.problems:
        err_console.print(render_problem(p))
    raise typer.Exit(code)


def load_cluster_option(path: Path | None) -> ClusterSpec:
    """The --cluster file, else the configured cluster, else this machine. A cluster file that cannot be used
    stops the command with exit status 2: the job spec itself was not judged."""
    try:
        return resolve_cluster(path)
    except SpecError as exc:
        if json_mode():
            print_json({"error": f"cluster description {exc.source}: {len(exc.problems)} problem(s)",
                        "exit_code": EXIT_UNREADABLE, "problems": [p.to_dict() for p in exc.problems]})
            raise typer.Exit(EXIT_UNREADABLE) from None
        err_console.print(f"[bold red]cluster description {escape(exc.source)}[/]: {len(exc.problems)} problem(s)")
        for p in exc.problems:
            err_console.print(render_problem(p))
        raise typer.Exit(EXIT_UNREADABLE) from None


def resolve_cluster(path: Path | None) -> ClusterSpec:
    from trainforge.plan.cluster import default_cluster, load_cluster

    return load_cluster(path) if path else default_cluster()


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
