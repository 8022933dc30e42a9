"""The quality gate at submit time: a version may be trained on only with a stored report that passed.

- A catalog version's report is made when it is built (`trainforge datasets build` gates by default) or by
  `trainforge datasets check NAME@VERSION`; submit refuses a version without one, naming that command.
- An s3:// prefix is pinned at submit, so its gate runs then, on a bounded sample (quality.run_in_place_gate),
  unless the pinned version already has a report (versions are content-addressed: a resubmit reuses it).
- A team's own suite (`dataset.expectations`) runs with the built-in expectations; its report is stored under the
  suite's digest, so changing the suite runs the gate again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainforge.datasets.catalog import CatalogError, EmbeddedCatalog, ResolvedDataset


class GateFailed(CatalogError):
    """The version's quality gate failed: `failures` are the report's."""

    def __init__(self, ds: ResolvedDataset, report: dict[str, Any], team: str = ""):
        self.failures = list(report.get("failures", [])) or ["see the stored report"]
        suite = f" (with the team suite {team})" if team else ""
        super().__init__(f"dataset version {ds.name}@{ds.version[:12]} failed its quality gate{suite}: "
                         + "; ".join(self.failures))


def check_command(ds: ResolvedDataset) -> str:
    return f"trainforge datasets check {ds.name}@{ds.version[:12]}"


class MissingReport(CatalogError):
    """A catalog version with no stored quality report: `fix` is the command that makes one."""

    def __init__(self, ds: ResolvedDataset):
        self.fix = (f"run `{check_command(ds)}` (it runs the quality gate and stores its report), or build versions "
                    "with `trainforge datasets build`, which gates them")
        super().__init__(f"dataset version {ds.name}@{ds.version[:12]} has no quality report, so nothing says it "
                         f"is fit to train on: {self.fix}")


def missing_report(ds: ResolvedDataset) -> MissingReport:
    return MissingReport(ds)


def load_suite(path: str | None, base_dir: Path) -> Any:
    """The spec's `dataset.expectations` (relative to the spec's folder) as a quality.TeamSuite, or None."""
    if not path:
        return None
    from trainforge.datasets.quality import load_team_suite

    p = Path(path).expanduser()
    return load_team_suite(p if p.is_absolute() else base_dir / p)


def run_and_store(ds: ResolvedDataset, team: Any = None, catalog: EmbeddedCatalog | None = None) -> dict[str, Any]:
    """Run the gate (with the team suite, if any) and store its report with the version."""
    from trainforge.datasets.quality import run_gate

    catalog = catalog or EmbeddedCatalog()
    report = run_gate(ds, team=team)
    catalog.put_quality(ds.name, ds.version, report, team.digest if team else "")
    return report


def gate_for_submit(ds: ResolvedDataset, team: Any = None, catalog: EmbeddedCatalog | None = None) -> dict[str, Any]:
    """The report a job may train with: the stored one, or (an in-place prefix, or a team suite not run on this
    version yet) one made now. Raises GateFailed when it failed, CatalogError when a built version has none."""
    catalog = catalog or EmbeddedCatalog()
    builtin = catalog.get_quality(ds.name, ds.version)
    if builtin is None and not ds.in_place:
        raise missing_report(ds)
    if builtin is None and team is None:
        builtin = run_and_store(ds, None, catalog)
    if builtin is not None and not builtin.get("passed", False):
        raise GateFailed(ds, builtin)
    if team is None:
        assert builtin is not None
        return builtin
    report = catalog.get_quality(ds.name, ds.version, team.digest)
    if report is None:
        report = run_and_store(ds, team, catalog)
        if builtin is None:  # the team's run made the built-in checks too: that part is the version's own report
            catalog.put_quality(ds.name, ds.version, builtin_part(report))
    if not report.get("passed", False):  # the team's run repeats the built-in checks: either may have failed
        raise GateFailed(ds, report, team.path)
    return report


def builtin_part(report: dict[str, Any]) -> dict[str, Any]:
    """A report with its team-suite checks left out (the version's own verdict)."""
    checks = [c for c in report.get("checks", []) if not str(c.get("batch", "")).startswith("team:")]
    failures = [f for f in report.get("failures", []) if not f.startswith("team:")]
    out = {k: v for k, v in report.items() if k != "team_suite"}
    return out | {"checks": checks, "failures": failures, "passed": all(c["success"] for c in checks)}
