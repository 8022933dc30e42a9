"""`trainforge` command line. Each command lives in trainforge/commands/<name>.py and registers itself on `app`;
heavy libraries (torch, prefect, mlflow) are imported inside commands, never at start-up."""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="trainforge",
    help="Parallel ML training platform: validate, plan, submit and track training jobs from one YAML spec.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Help text is plain text: with rich markup, `[rank N]` or `[@BRANCH]` in a help string would be eaten.
    rich_markup_mode=None,
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
COMMAND_MODULES = ["validate", "jobs", "scheduler", "plan", "datasets", "registry", "observe", "production", "chaos"]

for _name in COMMAND_MODULES:
    importlib.import_module(f"trainforge.commands.{_name}")


def main() -> None:
    app()


if __name__ == "__main__":
    # Run as `python -m trainforge.cli`: the command modules registered on the importable module's app.
    from trainforge.cli import main as _main

    _main()
