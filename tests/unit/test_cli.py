"""`trainforge validate` and `trainforge schema` as a user runs them: exit codes 0 valid / 1 invalid /
2 unreadable, the --json report shape, the schema, and no traceback for any user mistake.

Most cases use typer's CliRunner (in-process, fast); one runs the installed `trainforge` script in a subprocess.
Run: .venv/bin/python -m pytest tests/unit/test_cli.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tests.specs.cases import CLUSTERS, EXAMPLES, broken_cases, build_demo_dataset
from trainforge.cli import app

FLEET = str(CLUSTERS / "fleet-10k.yaml")
runner = CliRunner()


def run(*args: str):
    result = runner.invoke(app, [str(a) for a in args])
    output = result.output + (result.stderr if result.stderr_bytes is not None else "")
    assert "Traceback" not in output, output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return result, output


@pytest.fixture
def demo_dataset() -> None:
    build_demo_dataset()


def test_valid_tiny_spec_exits_0(demo_dataset):
    result, out = run("validate", EXAMPLES / "tiny-cpu.yaml")
    assert result.exit_code == 0, out
    assert "is valid" in out and "dp=2" in out


@pytest.mark.parametrize("name", ["llama-7b-finetune", "llama-70b-pretrain", "llama-200b-pretrain"])
def test_large_examples_exit_0_on_the_fleet_and_1_under_strict(name):
    result, out = run("validate", EXAMPLES / f"{name}.yaml", "--cluster", FLEET)
    assert result.exit_code == 0, out
    assert "(not checked)" in out
    result, out = run("validate", EXAMPLES / f"{name}.yaml", "--cluster", FLEET, "--strict")
    assert result.exit_code == 1 and "an error under --strict" in out


@pytest.mark.parametrize("case", broken_cases()[::4], ids=lambda c: c.id)
def test_broken_specs_exit_1_and_name_the_field(case, demo_dataset):
    args = ["validate", case.file] + (["--cluster", case.cluster_file] if case.cluster_file else [])
    args += ["--strict"] if case.strict else []
    result, out = run(*args)
    assert result.exit_code == 1, out
    assert f"{case.path}: " in out and case.message in " ".join(out.split())


def test_json_report_shape(demo_dataset):
    case = next(c for c in broken_cases() if c.id == "world-size-not-product.yaml")
    result, _ = run("validate", case.file, "--json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["valid"] is False and report["unreadable"] is False and report["job"] == "tiny-cpu"
    assert report["counts"]["error"] >= 1
    problem = next(p for p in report["problems"] if p["path"] == "parallelism")
    assert set(problem) == {"path", "message", "value", "fix", "severity"} and problem["severity"] == "error"
    result, _ = run("validate", EXAMPLES / "llama-70b-pretrain.yaml", "--cluster", FLEET, "--json")
    report = json.loads(result.stdout)
    assert result.exit_code == 0 and report["valid"] and report["layout"].startswith("dp=16,tp=8,pp=4")
    assert report["memory_per_gpu_bytes"] > 0


def test_json_with_strict(demo_dataset):
    result, _ = run("validate", EXAMPLES / "llama-7b-finetune.yaml", "--cluster", FLEET, "--json", "--strict")
    report = json.loads(result.stdout)
    assert result.exit_code == 1 and report["valid"] is False and report["strict"] is True


def _write(tmp_path: Path, name: str, content: bytes | str) -> Path:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("bad.yaml", "name: tiny\n  team: [demo\n", "not valid YAML at line"),
        ("bad.json", '{"name": "tiny",}', "not valid JSON at line 1"),
        ("dup.yaml", "name: a\nname: b\n", "appears twice"),
        ("binary.yaml", b"\x7fELF\x02\x01\x01\x00\x00\x00", "binary file"),
        ("latin1.yaml", "name: caf\xe9\n".encode("latin-1"), "not UTF-8"),
    ],
)
def test_unreadable_files_exit_2(tmp_path, name, content, message):
    path = _write(tmp_path, name, content)
    result, out = run("validate", path)
    assert result.exit_code == 2, out
    assert message in out and "cannot be read" in out
    result, _ = run("validate", path, "--json")
    report = json.loads(result.stdout)
    assert result.exit_code == 2 and report["unreadable"] is True and message in report["problems"][0]["message"]


def test_missing_file_and_directory_exit_2(tmp_path):
    result, out = run("validate", tmp_path / "nope.yaml")
    assert result.exit_code == 2 and "file not found" in out
    result, out = run("validate", tmp_path)
    assert result.exit_code == 2 and "is a directory" in out


def test_empty_file_is_invalid_not_a_crash(tmp_path):
    result, out = run("validate", _write(tmp_path, "empty.yaml", ""))
    assert result.exit_code == 1 and "the document is empty" in out


def test_markup_like_values_are_printed_literally(tmp_path):
    path = _write(tmp_path, "markup.yaml", 'name: "[/bold]oops[red]"\n')
    result, out = run("validate", path)
    assert result.exit_code == 1 and "[/bold]oops[red]" in out


def test_bad_cluster_file_exits_2(tmp_path, demo_dataset):
    cluster = _write(tmp_path, "cluster.yaml", "name: x\nnode_groups: []\n")
    result, out = run("validate", EXAMPLES / "tiny-cpu.yaml", "--cluster", cluster)
    assert result.exit_code == 2 and "cluster description" in out and "node_groups" in out
    result, _ = run("validate", EXAMPLES / "tiny-cpu.yaml", "--cluster", tmp_path / "missing.yaml", "--json")
    report = json.loads(result.stdout)
    assert result.exit_code == 2 and report["source"].endswith("missing.yaml") and report["unreadable"]


def test_secret_values_are_not_printed(tmp_path):
    secret = "hf_" + "Q" * 34
    doc = yaml.safe_load((EXAMPLES / "tiny-cpu.yaml").read_text())
    doc["env"] = {"HF_TOKEN": secret}
    path = _write(tmp_path, "leak.yaml", yaml.safe_dump(doc))
    result, out = run("validate", path)
    assert result.exit_code == 1 and "env.HF_TOKEN" in out and secret not in out
    result, _ = run("validate", path, "--json")
    assert secret not in result.stdout


def _schema_properties(schema: dict):
    yield from schema.get("properties", {}).items()
    for sub in schema.get("$defs", {}).values():
        yield from sub.get("properties", {}).items()


def test_schema_is_valid_json_schema_with_every_field_described():
    result, _ = run("schema")
    assert result.exit_code == 0
    schema = json.loads(result.stdout)
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator.check_schema(schema)
    undocumented = [name for name, prop in _schema_properties(schema) if not prop.get("description")]
    assert undocumented == []
    # The examples conform to the published schema too (what an editor plugin would check).
    validator = jsonschema.Draft202012Validator(schema)
    for path in EXAMPLES.glob("*.yaml"):
        assert list(validator.iter_errors(yaml.safe_load(path.read_text()))) == [], path


def test_help_lists_examples():
    result, out = run("validate", "--help")
    assert result.exit_code == 0 and "--cluster" in out and "--strict" in out and "Exit status" in out


def test_installed_script_exit_codes(tmp_path):
    """The real entry point, in a subprocess: no traceback on stderr for a user mistake."""
    exe = Path(sys.executable).with_name("trainforge")
    env = {"TRAINFORGE_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    bad = _write(tmp_path, "bad.yaml", "name: [unclosed\n")
    for args, code in [([str(EXAMPLES / "llama-70b-pretrain.yaml"), "--cluster", FLEET], 0),
                       ([str(EXAMPLES / "tiny-cpu.yaml")], 1),  # no demo dataset in this TRAINFORGE_HOME
                       ([str(bad)], 2)]:
        proc = subprocess.run([str(exe), "validate", *args], capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == code, proc.stderr
        assert "Traceback" not in proc.stderr + proc.stdout
