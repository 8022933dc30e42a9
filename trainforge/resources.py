"""The project files the commands need outside a checkout: prefect.yaml and examples/, found as package data.

They live once, at the repository root (users copy `examples/`, `prefect deploy` reads `prefect.yaml` there);
`trainforge/project/` links to them, so a checkout, an editable install and a wheel all find them through
`importlib.resources` (the wheel holds real copies: setuptools follows the links when it builds). Nothing here
computes a path relative to the repository.

`$TRAINFORGE_REPO` (a checkout, or a folder made with your own prefect.yaml) wins over the shipped copy.
"""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path

PROJECT = "project"  # the folder inside the trainforge package


class ProjectFileMissing(FileNotFoundError):
    """A file the package should ship is absent: a broken install, not a user mistake in a spec."""


def shipped_project() -> Path:
    """The folder that holds the shipped prefect.yaml and examples/: inside an installed wheel, the package's
    project/ folder; in a checkout (editable install), where its links point, the repository root, so paths
    relative to it (a trigger's spec, the flow's base_dir) read as they always did: `examples/tiny-cpu.yaml`."""
    # trainforge is never imported from a zip (torchrun and Prefect workers import it from files), so the
    # Traversable is a real folder; say so plainly if someone packs it otherwise.
    path = Path(str(files("trainforge").joinpath(PROJECT)))
    if not (path / "prefect.yaml").is_file():
        raise ProjectFileMissing(f"{path}/prefect.yaml is missing: this trainforge install does not ship its "
                                 "project files; reinstall it (pip install --force-reinstall trainforge) or set "
                                 "TRAINFORGE_REPO to a folder holding prefect.yaml and examples/")
    return (path / "prefect.yaml").resolve().parent


def project_root() -> Path:
    """The folder holding prefect.yaml and examples/: $TRAINFORGE_REPO when set, else the shipped copy."""
    env = os.environ.get("TRAINFORGE_REPO")
    return Path(env) if env else shipped_project()


def example_path(relative: str) -> Path:
    """A file of the shipped examples/, e.g. example_path("tiny-cpu.yaml") or "clusters/fleet-10k.yaml".

    Not checked here: command-line defaults call it at import time, and the command that opens it reports a
    missing file with its path."""
    return Path(str(files("trainforge").joinpath(PROJECT, "examples", relative)))
