"""The project files a wheel needs (prefect.yaml, examples/) are package data found through importlib.resources.

Pure (also run by `make test-pure` under 3.12 and 3.13). The wheel itself is built and installed by
tests/integration/test_wheel_install.py. Run: pytest tests/unit/test_resources.py
"""

from __future__ import annotations

from pathlib import Path

import yaml

import trainforge
from trainforge.resources import example_path, project_root, shipped_project

REPO = Path(__file__).resolve().parents[2]
PACKAGE = Path(trainforge.__file__).resolve().parent


def test_the_package_ships_prefect_yaml_and_the_examples_of_the_repository():
    shipped = shipped_project()
    assert (shipped / "prefect.yaml").samefile(PACKAGE / "project" / "prefect.yaml")
    assert (shipped / "examples" / "tiny-cpu.yaml").samefile(PACKAGE / "project" / "examples" / "tiny-cpu.yaml")
    assert (shipped / "prefect.yaml").read_bytes() == (REPO / "prefect.yaml").read_bytes()
    repo_examples = sorted(p.relative_to(REPO / "examples") for p in (REPO / "examples").rglob("*") if p.is_file()
                           and "__pycache__" not in p.parts)
    assert repo_examples, "examples/ is empty"
    for rel in repo_examples:
        assert (shipped / "examples" / rel).read_bytes() == (REPO / "examples" / rel).read_bytes(), rel


def test_example_path_names_shipped_files():
    assert example_path("tiny-cpu.yaml").is_file()
    assert example_path("clusters/fleet-10k.yaml").is_file()
    assert example_path("tiny-cpu.yaml").samefile(shipped_project() / "examples" / "tiny-cpu.yaml")


def test_trainforge_repo_wins_over_the_shipped_copy(monkeypatch, tmp_path):
    monkeypatch.setenv("TRAINFORGE_REPO", str(tmp_path))
    assert project_root() == tmp_path
    monkeypatch.delenv("TRAINFORGE_REPO")
    assert project_root() == shipped_project()


def test_deployment_entrypoints_are_module_paths_inside_the_package():
    """`prefect deploy` from the shipped prefect.yaml (outside a checkout) needs entrypoints that resolve by import,
    not files relative to the working directory."""
    doc = yaml.safe_load((shipped_project() / "prefect.yaml").read_text())
    assert doc["deployments"]
    for dep in doc["deployments"]:
        entry = dep["entrypoint"]
        assert ":" not in entry, f"{dep['name']}: {entry!r} is a file path; use module.function"
        module, _, func = entry.rpartition(".")
        assert module.startswith("trainforge."), entry
        source = PACKAGE.joinpath(*module.split(".")[1:]).with_suffix(".py")
        assert source.is_file(), f"{dep['name']}: {source} does not exist"
        assert f"def {func}(" in source.read_text(), f"{dep['name']}: no `def {func}(` in {source}"


def test_dataset_trigger_specs_resolve_next_to_the_shipped_prefect_yaml():
    doc = yaml.safe_load((shipped_project() / "prefect.yaml").read_text())
    for entry in doc.get("dataset_triggers") or []:
        assert (shipped_project() / entry["spec"]).is_file(), entry
