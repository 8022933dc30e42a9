"""The fixed choices of CLI options, as enums: `--help` lists them (`--backend <local|kubernetes>`), shell
completion offers them, and click refuses any other value naming the option and the valid ones (exit 2).

Where a library module owns the list (the spec's GPU types, the registry's stages, the metric modes), the enum is
built from it or checked against it by tests/unit/test_cli_surface.py, so the two cannot drift apart.
"""

from __future__ import annotations

from enum import StrEnum

from trainforge.registry.tracking import METRIC_MODES


class Backend(StrEnum):
    """Where `submit` runs the job."""

    local = "local"
    kubernetes = "kubernetes"


class RenderBackend(StrEnum):
    """Backends that have manifests to render."""

    kubernetes = "kubernetes"


class Policy(StrEnum):
    """Policies the simulator replays (infra/simulator/engine.py POLICIES). Written out, not imported: importing the
    scheduler package costs the CLI ~30 ms at every start (and every Tab); tests/unit/test_cli_surface.py checks
    that the two lists agree."""

    ours = "ours"
    fifo = "fifo"
    fifo_backfill = "fifo-backfill"
    kueue = "kueue"
    las = "las"


class Alias(StrEnum):
    """Aliases `promote` may set (registry/promotion.py ALIASES), or none."""

    candidate = "candidate"
    champion = "champion"
    none = "none"


class ModelAlias(StrEnum):
    """Aliases of `model alias` (registry/promotion.py ALIASES)."""

    champion = "champion"
    candidate = "candidate"


class Stage(StrEnum):
    """MLflow model stages (registry/promotion.py STAGES)."""

    none = "None"
    staging = "Staging"
    production = "Production"
    archived = "Archived"


# How `metric` reads a history: the tracker's own list.
MetricMode = StrEnum("MetricMode", {m: m for m in METRIC_MODES})


class Market(StrEnum):
    """Price markets of the cost model."""

    on_demand = "on_demand"
    spot = "spot"


class Shell(StrEnum):
    """Shells `completion` writes a script for."""

    bash = "bash"
    zsh = "zsh"
    fish = "fish"


class InPlaceFormat(StrEnum):
    """How an s3:// prefix's objects are read in place (datasets/prefix_manifest.py FORMATS; the test of the CLI
    surface checks the two agree)."""

    jsonl = "jsonl"
    text = "text"
    parquet = "parquet"
