"""trainforge: parallel ML training from one declarative job spec.

The SDK (trainforge/sdk.py):

    from trainforge import JobSpec, submit, get_job, __version__
    job = submit("examples/tiny-cpu.yaml", overrides={"training.max_steps": 20})
    print(job.wait(), job.metrics()[-1].loss)

Every name is loaded on first use (PEP 562): `import trainforge` imports nothing else, so a worker (which imports
trainforge.trainer, hence this package) never loads the SDK, prefect or the control plane through it. The modules
are named as strings for the same reason: the package's own import graph stays empty.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module that defines it
_EXPORTS = {
    "JobSpec": "trainforge.spec",
    "SpecError": "trainforge.spec",
    "submit": "trainforge.sdk",
    "get_job": "trainforge.sdk",
    "Job": "trainforge.sdk",
    "JobNotFound": "trainforge.sdk",
}

__all__ = ["__version__", *_EXPORTS]


def _version() -> str:
    """The installed distribution's version; in a checkout that is not installed, pyproject.toml's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trainforge")
    except PackageNotFoundError:
        import tomllib
        from pathlib import Path

        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        try:
            return str(tomllib.loads(pyproject.read_text())["project"]["version"])
        except (OSError, KeyError, ValueError):
            return "0+unknown"


def __getattr__(name: str) -> Any:
    if name == "__version__":
        value: Any = _version()
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        raise AttributeError(f"module 'trainforge' has no attribute {name!r}")
    globals()[name] = value  # loaded once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
