"""The whole command surface, walked from the root group, so a command added later is checked too: every command
takes --json, and under --json a usage error or a user error is one JSON object on stdout with the exit status;
fixed choices are enums listed in --help and a bad value names the option and the valid values; help text keeps
its brackets (no rich markup), follows the terminal's width and never re-wraps an example; shell completion
works in a real bash.

Run: .venv/bin/python -m pytest tests/unit/test_cli_surface.py -q
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from enum import Enum
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from trainforge.cli import app
from trainforge.commands import choices
from trainforge.commands.common import EXIT_INVALID, EXIT_UNREADABLE

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def _walk(command, path):
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _walk(sub, [*path, name])


ALL = list(_walk(typer.main.get_command(app), []))
LEAVES = [(p, c) for p, c in ALL if not hasattr(c, "commands")]
IDS = [" ".join(p) for p, _ in LEAVES]


def run(*args: str, env: dict[str, str] | None = None):
    result = runner.invoke(app, [str(a) for a in args], env={"NO_COLOR": "1", **(env or {})})
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result


def test_the_walk_finds_every_command():
    names = {" ".join(p) for p, _ in LEAVES}
    assert {"submit", "status", "logs", "cancel", "completion", "datasets build", "model stage", "servers up",
            "automations remove", "lineage withdraw"} <= names
    assert len(LEAVES) >= 40


# ---- --json everywhere ------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("path", "command"), LEAVES, ids=IDS)
def test_every_command_takes_json(path, command):
    options = {o for p in command.params for o in getattr(p, "opts", [])}
    assert "--json" in options, f"`trainforge {' '.join(path)}` has no --json"
    assert any(p.name == "as_json" for p in command.params), "name it as_json: commands/common.py fail() reads it"


@pytest.mark.parametrize(("path", "command"), LEAVES, ids=IDS)
def test_a_usage_error_under_json_is_json_on_stdout(path, command):
    result = run(*path, "--json", "--no-such-option")
    assert result.exit_code == 2
    error = json.loads(result.stdout)
    assert error == {"error": "No such option: --no-such-option", "exit_code": 2}


def test_usage_errors_without_json_stay_text():
    result = run("status", "--no-such-option")
    assert result.exit_code == 2 and result.stdout == "" and "No such option: --no-such-option" in result.stderr


# Commands given a user mistake with --json: each must answer one JSON error object on stdout, no rich text.
USER_ERRORS = [
    (["status", "NOPE"], EXIT_INVALID), (["logs", "NOPE"], EXIT_INVALID), (["cancel", "NOPE"], EXIT_INVALID),
    (["checkpoints", "NOPE"], EXIT_INVALID), (["watch", "NOPE"], EXIT_INVALID),
    (["report", "NOPE"], EXIT_INVALID), (["profile", "NOPE", "--steps", "1:2"], EXIT_INVALID),
    (["promote", "NOPE", "--best"], EXIT_INVALID), (["datasets", "show", "nope"], EXIT_INVALID),
    (["datasets", "tag", "nope", "t1"], EXIT_INVALID), (["lineage", "datasets-of", "nope"], EXIT_INVALID),
    (["lineage", "withdraw", "nope@v1", "--why", "test"], EXIT_INVALID), (["plan"], EXIT_UNREADABLE),
    (["cost", "--since", "yesterday"], EXIT_INVALID), (["validate", "missing.yaml"], EXIT_UNREADABLE),
    (["render", "missing.yaml"], EXIT_UNREADABLE), (["chaos", "missing.yaml", "-s", "kill"], EXIT_UNREADABLE),
    (["submit", "missing.yaml"], EXIT_UNREADABLE), (["queue", "--cluster", "missing.yaml"], EXIT_UNREADABLE),
    (["simulate", "--trace", "missing.csv"], EXIT_UNREADABLE),
    (["datasets", "build", "missing-dir", "--out", "catalog://x", "--license", "MIT"], EXIT_UNREADABLE),
    (["automations", "install", "--config", "missing.yaml"], EXIT_INVALID),
    (["automations", "list"], EXIT_INVALID),
]


@pytest.mark.parametrize(("args", "code"), USER_ERRORS, ids=[" ".join(a) for a, _ in USER_ERRORS])
def test_a_user_error_under_json_is_one_json_object_with_the_exit_status(args, code, monkeypatch):
    monkeypatch.chdir(ROOT)  # simulate's default cluster is a path under examples/
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    result = run(*args, "--json")
    assert result.exit_code == code, result.output
    error = json.loads(result.stdout)  # one object, nothing else on stdout
    assert isinstance(error, dict) and error["exit_code"] == code and error["error"], error
    assert "[bold" not in result.stdout and "[red" not in result.stdout and "\x1b[" not in result.stdout


def test_an_unexpected_exception_under_json_is_json_too(monkeypatch):
    import trainforge.registry.jobs as jobs

    def broken(self, job):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(jobs.JobStore, "get", broken)
    result = run("status", "some-job", "--json")
    assert result.exit_code == 1
    assert json.loads(result.stdout) == {"error": "internal error: RuntimeError: disk on fire", "exit_code": 1}


# ---- fixed choices ------------------------------------------------------------------------------------------------

# Every str option or argument that takes free text (ids, names, paths, URLs, expressions). A new str option is
# either added here, or it is a fixed choice and must be an enum (commands/choices.py).
FREE_TEXT = {
    "job", "jobs", "resume", "namespace", "image", "kube_api", "team", "db", "failures", "spot_waves", "model",
    "layout", "out", "license", "text_field", "job_id", "queue", "api", "why", "who", "file", "since", "steps",
    "name", "version", "target", "dataset", "ref", "tag_name", "overrides",
    "tokenizer",  # datasets build: byte, bpe, or the path of a tokenizer.json (a path cannot be an enum)
}


def _choice_params():
    for path, command in LEAVES:
        for param in command.params:
            if param.type_descriptor.is_choice:
                yield path, command, param


def test_string_options_are_free_text_or_enums():
    loose = []
    for path, command in LEAVES:
        for param in command.params:
            desc = param.type_descriptor
            if desc.is_choice or param.name in FREE_TEXT:
                continue
            annotation = str(desc.annotation)
            if "str" in annotation:
                loose.append(f"trainforge {' '.join(path)}: {param.name} ({annotation})")
    assert not loose, "plain-string options that are not declared free text (make them enums):\n" + "\n".join(loose)


def test_the_known_fixed_choices_are_enums():
    found = {(" ".join(p), param.name) for p, _, param in _choice_params()}
    assert {("submit", "backend"), ("simulate", "policy"), ("plan", "gpu_type"), ("plan", "precision"),
            ("promote", "alias"), ("promote", "stage"), ("metric", "mode"), ("cost", "market"),
            ("render", "backend"), ("chaos", "scenario"), ("status", "state"),
            ("model alias", "alias"), ("model stage", "stage"), ("completion", "shell")} <= found


def test_enums_match_the_lists_their_modules_own():
    from trainforge.registry.promotion import ALIASES, STAGES
    from trainforge.registry.tracking import METRIC_MODES

    assert {a.value for a in choices.ModelAlias} == set(ALIASES)
    assert {a.value for a in choices.Alias} == {*ALIASES, "none"}
    assert tuple(s.value for s in choices.Stage) == STAGES
    assert tuple(m.value for m in choices.MetricMode) == METRIC_MODES
    from trainforge.infra.simulator.engine import POLICIES

    assert tuple(p.value for p in choices.Policy) == POLICIES
    from trainforge.datasets.prefix_manifest import FORMATS

    assert tuple(f.value for f in choices.InPlaceFormat) == FORMATS


@pytest.mark.parametrize(("path", "param"), [(p, prm) for p, _, prm in _choice_params()],
                         ids=[f"{' '.join(p)} {prm.name}" for p, _, prm in _choice_params()])
def test_help_lists_every_choice(path, param):
    out = run(*path, "--help").stdout
    values = [c.value if isinstance(c, Enum) else str(c) for c in param.type_descriptor.choices]
    if not param.type_descriptor.case_sensitive:
        values = [v.lower() for v in values]
    assert "|".join(values) in out, f"{' '.join(path)} --help does not list {values}:\n{out}"


# One invocation per choice parameter with a bad value; the other required arguments are given, so the error is
# the choice's. A new choice parameter needs a line here (test_every_choice_param_has_a_bad_value_case).
BAD_CHOICES = {
    ("submit", "backend"): ["submit", "examples/tiny-cpu.yaml", "--backend", "slurm"],
    ("simulate", "policy"): ["simulate", "--trace", "x.csv", "--policy", "slurm"],
    ("plan", "gpu_type"): ["plan", "--model", "llama-7b", "--gpus", "8", "--gpu-type", "tpu-v5"],
    ("plan", "precision"): ["plan", "--model", "llama-7b", "--gpus", "8", "--precision", "fp8"],
    ("plan", "engine"): ["plan", "--model", "llama-7b", "--gpus", "8", "--engine", "megatron"],
    ("promote", "alias"): ["promote", "JOB", "--alias", "king"],
    ("promote", "stage"): ["promote", "JOB", "--stage", "Prod"],
    ("metric", "mode"): ["metric", "JOB", "--mode", "mean"],
    ("cost", "market"): ["cost", "--market", "reserved"],
    ("render", "backend"): ["render", "examples/tiny-cpu.yaml", "--backend", "local"],
    ("chaos", "scenario"): ["chaos", "examples/tiny-cpu.yaml", "--scenario", "meteor"],
    ("status", "state"): ["status", "--state", "done"],
    ("model alias", "alias"): ["model", "alias", "m", "1", "king"],
    ("model stage", "stage"): ["model", "stage", "m", "1", "Prod"],
    ("completion", "shell"): ["completion", "tcsh"],
    ("datasets check", "format"): ["datasets", "check", "s3://b/p", "--license", "MIT", "--format", "csv"],
}


def test_every_choice_param_has_a_bad_value_case():
    assert {(" ".join(p), prm.name) for p, _, prm in _choice_params()} == set(BAD_CHOICES)


@pytest.mark.parametrize("key", sorted(BAD_CHOICES), ids=[f"{c} {p}" for c, p in sorted(BAD_CHOICES)])
def test_a_bad_choice_names_the_option_and_the_valid_values(key, monkeypatch):
    monkeypatch.chdir(ROOT)
    args = BAD_CHOICES[key]
    param = next(prm for p, _, prm in _choice_params() if (" ".join(p), prm.name) == key)
    values = [c.value for c in param.type_descriptor.choices]
    if not param.type_descriptor.case_sensitive:
        values = [v.lower() for v in values]
    name = param.opts[0] if param.param_type_name == "option" else param.name
    for as_json in (False, True):
        result = run(*args, *(["--json"] if as_json else []))
        assert result.exit_code == 2, result.output
        message = json.loads(result.stdout)["error"] if as_json else " ".join(result.stderr.split())
        assert f"Invalid value for '{name}" in message and f"'{args[-1]}' is not one of" in message, message
        assert all(f"'{v}'" in message for v in values), message
        assert "Value error" not in message


def test_a_bad_tokenizer_names_the_option_and_what_it_takes(monkeypatch):
    # --tokenizer is byte, bpe or a path (free text, checked by a callback): as clear as a fixed choice's error
    monkeypatch.chdir(ROOT)
    args = ["datasets", "build", "src", "--out", "x", "--license", "MIT", "--tokenizer", "sentencepiece"]
    for as_json in (False, True):
        result = run(*args, *(["--json"] if as_json else []))
        assert result.exit_code == 2, result.output
        message = json.loads(result.stdout)["error"] if as_json else " ".join(result.stderr.split())
        assert "Invalid value for '--tokenizer'" in message and "'sentencepiece' is not byte, bpe or" in message
        assert "tokenizer.json" in message and "Traceback" not in result.output


# ---- help text ------------------------------------------------------------------------------------------------

def _texts(command) -> list[str]:
    return [command.help or ""] + [getattr(p, "help", None) or "" for p in command.params]


@pytest.mark.parametrize(("path", "command"), ALL, ids=[" ".join(p) or "trainforge" for p, _ in ALL])
def test_help_keeps_bracketed_text(path, command):
    """Rich markup reads `[@BRANCH]` or `[rank N]` as a tag and drops it; plain help keeps every bracket."""
    out = " ".join(run(*path, "--help").stdout.split())
    for text in _texts(command):
        for bracketed in re.findall(r"\[[^\]\n]*\]", text):
            assert " ".join(bracketed.split()) in out, f"{' '.join(path)} --help lost {bracketed!r}"


def _paragraphs(doc: str) -> tuple[list[str], list[str]]:
    """(re-wrapped paragraphs, lines of `\\b` blocks), as click formats a docstring."""
    import inspect

    paragraphs, verbatim = [], []
    for block in re.split(r"\n\s*\n", inspect.cleandoc(doc)):
        lines = block.splitlines()
        if lines and lines[0].strip() == "\b":
            verbatim += [ln.strip() for ln in lines[1:] if ln.strip()]
        else:
            paragraphs.append(" ".join(block.split()))
    return paragraphs, verbatim


def _help_at(path: list[str], columns: int, capsys, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", str(columns))  # the real program (not CliRunner, which forces 80 columns)
    capsys.readouterr()
    assert app([*path, "--help"], prog_name="trainforge", standalone_mode=False) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize(("path", "command"), ALL, ids=[" ".join(p) or "trainforge" for p, _ in ALL])
def test_help_follows_the_terminal_width_and_never_rewraps_examples(path, command, capsys, monkeypatch):
    wide = [ln.strip() for ln in _help_at(path, 600, capsys, monkeypatch).splitlines()]
    paragraphs, verbatim = _paragraphs(command.help or "")
    for para in (p for p in paragraphs if len(p) < 590):  # at 600 columns a paragraph that fits is one line
        assert para in wide, f"{' '.join(path)} --help at 600 columns wrapped {para!r}"
    narrow = [ln.strip() for ln in _help_at(path, 60, capsys, monkeypatch).splitlines()]
    for line in verbatim:  # an example is one line even at 60 columns: pasted, it is one command
        assert line in narrow, f"{' '.join(path)} --help at 60 columns broke the example {line!r}"


def test_examples_are_marked_verbatim():
    """Every `trainforge ...` example in a docstring sits in a \\b block (else click re-wraps it)."""
    loose = []
    for path, command in ALL:
        paragraphs, _ = _paragraphs(command.help or "")
        loose += [f"{' '.join(path)}: {p}" for p in paragraphs if re.match(r"(Examples?: )?trainforge ", p)]
    assert not loose, "examples that click would re-wrap:\n" + "\n".join(loose)


# ---- shell completion -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_script_names_the_program_and_its_commands(shell):
    result = run("completion", shell)
    assert result.exit_code == 0
    script = result.stdout
    assert f"_TRAINFORGE_COMPLETE=complete_{shell}" in script and "trainforge" in script
    for name in ("submit", "status", "logs", "cancel", "datasets", "completion"):
        assert name in script
    as_json = json.loads(run("completion", shell, "--json").stdout)
    assert as_json["script"] == script and as_json["shell"] == shell


@pytest.fixture(scope="module")
def trainforge_on_path(tmp_path_factory) -> dict[str, str]:
    """A `trainforge` on PATH that runs this checkout (the completion script calls the program by name)."""
    bin_dir = tmp_path_factory.mktemp("bin")
    exe = bin_dir / "trainforge"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m trainforge "$@"\n')
    exe.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}


def _bash_complete(words: list[str], env: dict[str, str]) -> list[str]:
    """Source `trainforge completion bash` in a real bash and run its completion function on `words`."""
    quoted = " ".join(f"'{w}'" for w in words)
    script = (f'source <(trainforge completion bash) && COMP_WORDS=({quoted}) && COMP_CWORD={len(words) - 1} && '
              '_trainforge_completion trainforge && printf "%s\\n" "${COMPREPLY[@]}"')
    proc = subprocess.run(["bash", "--norc", "--noprofile", "-c", script], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash on this machine")
def test_bash_completes_commands_subcommands_and_choices(trainforge_on_path):
    assert "submit" in _bash_complete(["trainforge", "su"], trainforge_on_path)
    assert set(_bash_complete(["trainforge", "datasets", ""], trainforge_on_path)) == {"build", "list", "show",
                                                                                      "tag", "check"}
    assert set(_bash_complete(["trainforge", "submit", "--backend", ""], trainforge_on_path)) == {"local",
                                                                                                 "kubernetes"}
