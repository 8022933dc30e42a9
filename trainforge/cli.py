"""`trainforge` command line. Each command lives in trainforge/commands/<name>.py and registers itself on `app`;
heavy libraries (torch, prefect, mlflow) are imported inside commands, never at start-up."""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

import typer
from typer.core import TyperGroup

try:  # typer >= 0.29 vendors click as typer._click; older versions use click itself
    from typer import _click as click
except ImportError:  # pragma: no cover - depends on the installed typer
    import click  # type: ignore[no-redef]

# Help is laid out for the terminal it is printed in (click's default caps it at 80 columns, whatever the
# terminal); examples sit in `\b` paragraphs, which click never re-wraps, so a copied example is one command.
CONTEXT_SETTINGS = {"max_content_width": 10_000}
# The variable the completion script sets (click's convention: _{PROG}_COMPLETE).
COMPLETE_VAR = "_TRAINFORGE_COMPLETE"


def wants_json(args: Sequence[str]) -> bool:
    """`--json` among the options (not after `--`, where it would be an argument)."""
    args = list(args)
    return "--json" in (args[: args.index("--")] if "--" in args else args)


class TrainforgeGroup(TyperGroup):
    """The root group. It reports click's usage errors itself (an unknown option, a value outside an option's
    choices: exit 2), worded without pydantic's "Value error," prefix; under `--json`, whatever stops a command is
    one JSON object on stdout with the exit status it would have had: those usage errors and an unexpected
    exception (1, its traceback on stderr for the bug report), besides the commands' own errors
    (commands/common.py `fail`)."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True, **extra: Any) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        if os.environ.get(COMPLETE_VAR):  # a Tab press (commands/completion.py): typer's classes answer it
            from typer._completion_classes import completion_init

            completion_init()
            complete_var = complete_var or COMPLETE_VAR
        as_json = wants_json(argv)
        try:
            rv = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
            code = rv if isinstance(rv, int) else 0
        except click.exceptions.ClickException as exc:
            code = exc.exit_code
            if isinstance(getattr(exc, "message", None), str):
                exc.message = exc.message.removeprefix("Value error, ")
            if as_json:
                _json_error(exc.format_message(), code)
            else:
                exc.show()
        except typer.Abort:
            code = 1
            if as_json:
                _json_error("aborted", code)
            else:
                click.echo("Aborted!", err=True)
        except Exception as exc:  # a bug, not a user error: a script still gets JSON; the traceback goes to stderr
            if not as_json:
                raise
            traceback.print_exc()
            code = 1
            _json_error(f"internal error: {type(exc).__name__}: {exc}", code)
        if standalone_mode:
            sys.exit(code)
        return code


def _json_error(message: str, code: int) -> None:
    from trainforge.commands.common import print_json

    print_json({"error": message, "exit_code": code})


def new_typer(help: str) -> typer.Typer:
    """A command group with the root's conventions: plain-text help (rich markup would eat `[rank N]` or
    `[@BRANCH]`), help at the terminal's width, no tracebacks dressed up by rich."""
    return typer.Typer(help=help, no_args_is_help=True, rich_markup_mode=None, pretty_exceptions_enable=False,
                       context_settings=CONTEXT_SETTINGS)


app = typer.Typer(
    name="trainforge",
    cls=TrainforgeGroup,
    help="Parallel ML training platform: validate, plan, submit and track training jobs from one YAML spec.",
    no_args_is_help=True,
    # `trainforge completion bash|zsh|fish` prints the script (commands/completion.py); typer's
    # --install-completion would edit the user's shell start-up files.
    add_completion=False,
    pretty_exceptions_enable=False,
    # Help text is plain text: with rich markup, `[rank N]` or `[@BRANCH]` in a help string would be eaten.
    rich_markup_mode=None,
    context_settings=CONTEXT_SETTINGS,
)


def _print_version(value: bool) -> None:
    if value:
        import trainforge

        typer.echo(f"trainforge {trainforge.__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                       help="Print trainforge's version and exit.")) -> None:
    """Parallel ML training platform: validate, plan, submit and track training jobs from one YAML spec."""


# One module per command group; each calls `@app.command()` on import.
COMMAND_MODULES = ["validate", "jobs", "scheduler", "plan", "datasets", "registry", "observe", "production", "chaos",
                   "completion"]

for _name in COMMAND_MODULES:
    importlib.import_module(f"trainforge.commands.{_name}")


def main() -> None:
    """The `trainforge` command. It leaves through `exit_now` (trainer/process_exit.py): the atexit hooks run (the
    temporary Prefect server and the offline work's warm starter stop, the logs flush), but not the teardown of every
    module's objects, which after a job (Prefect, MLflow, pandas, great_expectations loaded) took 3.2 s of the demo
    after its last hook, for nothing: each command's files are closed as it writes them."""
    from trainforge.trainer.process_exit import exit_now

    try:
        app()
        code: int = 0
    except SystemExit as exc:  # typer's: the command's exit code, or a message (click's usage errors print theirs)
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            sys.stderr.write(f"{exc.code}\n")
            code = 1
    exit_now(code)


if __name__ == "__main__":
    # Run as `python -m trainforge.cli`: the command modules registered on the importable module's app.
    from trainforge.cli import main as _main

    _main()
