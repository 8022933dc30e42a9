"""`trainforge completion bash|zsh|fish`: the shell completion script.

The script is click's dynamic completion (typer's variant): on Tab the shell runs `trainforge` with
`_TRAINFORGE_COMPLETE=complete_<shell>` and the words typed so far, and trainforge answers from its own command
tree: commands, sub-commands, options and the choices of fixed-choice options, always those of the installed
version. trainforge/cli.py registers the completion classes when that variable is set.
"""

from __future__ import annotations

import typer

from trainforge.cli import COMPLETE_VAR, app
from trainforge.commands.choices import Shell
from trainforge.commands.common import print_json

PROG_NAME = "trainforge"

INSTALL_HINT = {
    Shell.bash: "trainforge completion bash > ~/.local/share/bash-completion/completions/trainforge",
    Shell.zsh: "trainforge completion zsh > ~/.zfunc/_trainforge  (with fpath+=~/.zfunc; autoload -Uz compinit; "
               "compinit in ~/.zshrc)",
    Shell.fish: "trainforge completion fish > ~/.config/fish/completions/trainforge.fish",
}


def completion_script(shell: Shell) -> str:
    """The script for `shell`, headed by a comment that says what it completes and how to load it."""
    from typer._completion_shared import get_completion_script

    commands = ", ".join(typer.main.get_command(app).commands)  # type: ignore[attr-defined]
    body = get_completion_script(prog_name=PROG_NAME, complete_var=COMPLETE_VAR, shell=shell.value)
    header = (f"# {PROG_NAME} {shell.value} completion: the commands ({commands}), their options and the choices "
              f"of fixed-choice options,\n# answered by {PROG_NAME} itself on Tab. Install: {INSTALL_HINT[shell]}\n")
    return header + body + "\n"


@app.command()
def completion(
    shell: Shell = typer.Argument(..., help="The shell to complete in."),
    as_json: bool = typer.Option(False, "--json", help="Print {shell, script, install} as JSON."),
) -> None:
    """Print the shell completion script for trainforge's commands, options and choices.

    \b
    Examples:
      eval "$(trainforge completion bash)"
      trainforge completion bash > ~/.local/share/bash-completion/completions/trainforge
      trainforge completion zsh > ~/.zfunc/_trainforge
      trainforge completion fish > ~/.config/fish/completions/trainforge.fish
    """
    script = completion_script(shell)
    if as_json:
        print_json({"shell": shell.value, "script": script, "install": INSTALL_HINT[shell]})
        return
    typer.echo(script, nl=False)
