"""Optional dependencies: the import of a heavy part names the extra that installs it.

The wheel's base install is the control plane (validate, plan, simulate, render, submit to a deployment); the
parts that need more are extras (pyproject.toml). Composer's `MissingConditionalImportError` is the pattern: the
import of an optional module goes through `require`, and its absence is a one-line error that says which extra to
install, never a bare `ModuleNotFoundError` from deep inside a command.

    deepspeed = require("deepspeed", extra="trainer", purpose="parallelism.engine: deepspeed")
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

# The extra that provides each optional top-level module (pyproject.toml [project.optional-dependencies]).
EXTRAS: dict[str, str] = {
    "torch": "trainer",
    "deepspeed": "trainer",
    "safetensors": "trainer",
    "prometheus_client": "trainer",
    "pynvml": "trainer",
    "psycopg2": "stack",
    "kubernetes": "k8s",
    "kubernetes_validate": "k8s",
    "jsonschema": "k8s",
    "referencing": "k8s",
    "great_expectations": "quality",
    "pandas": "quality",
}


class MissingConditionalImportError(ImportError):
    """An optional module is not installed; the message names the extra that installs it."""

    def __init__(self, module: str, extra: str, purpose: str | None = None):
        self.module, self.extra = module, extra
        what = f"{purpose} needs" if purpose else "this needs"
        super().__init__(f"{what} `{module}`, which is not installed: pip install 'trainforge[{extra}]'",
                         name=module)


def _extra_of(module: str, extra: str | None) -> str:
    top = module.partition(".")[0]
    if extra is None and top not in EXTRAS:
        raise KeyError(f"{module!r} has no extra in trainforge._optional.EXTRAS: add it there and to pyproject.toml")
    return extra or EXTRAS[top]


def require(module: str, *, extra: str | None = None, purpose: str | None = None) -> ModuleType:
    """Import `module`; when it (not something it imports) is missing, raise MissingConditionalImportError."""
    extra = _extra_of(module, extra)
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        # A module the optional package itself imports being absent is that package's broken install: re-raise.
        if exc.name and module.partition(".")[0] != exc.name.partition(".")[0]:
            raise
        raise MissingConditionalImportError(module, extra, purpose) from exc


def ensure_installed(module: str, *, extra: str | None = None, purpose: str | None = None) -> None:
    """Check that `module` can be imported without importing it (the control plane never imports torch; it
    checks that the trainer's torch is there before it launches torchrun with this interpreter)."""
    extra = _extra_of(module, extra)
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise MissingConditionalImportError(module, extra, purpose)
