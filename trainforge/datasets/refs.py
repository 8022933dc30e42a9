"""Dataset references (`catalog://`, `file://`, `s3://`, `gs://`, `lakefs://`) -> an immutable version."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from trainforge.datasets.catalog import (
    CatalogError,
    DatasetWithdrawn,
    EmbeddedCatalog,
    ResolvedDataset,
    load_version_dir,
)
from trainforge.spec import Problem


def resolve_reference(ref: str, base_dir: Path | None = None, dataset: Any = None, *,
                      gated: bool = True) -> ResolvedDataset:
    """Resolve a reference to a committed version. Raises CatalogError with a readable reason, DatasetWithdrawn
    (a CatalogError) if that version was withdrawn, whichever way it was named (branch, tag, version, file).
    An `s3://` prefix is pinned as it is now (its objects listed into a catalog version, read in place later):
    `dataset` (the spec's dataset section) says how to read it. `gated=False` skips the catalog's quality-report
    check: for a caller that gates the version itself (the dataset-release flow's import)."""
    if ref.startswith("s3://"):
        if dataset is None:
            raise CatalogError("an s3:// prefix is pinned from a job spec's dataset section (format, license)")
        from trainforge.datasets.pin_prefix import pin_prefix

        ds = pin_prefix(ref, dataset)
        refuse_withdrawn(ds, ref)
        return ds
    ds = _resolve(ref, base_dir, gated)
    refuse_withdrawn(ds, ref)
    return ds


def refuse_withdrawn(ds: ResolvedDataset, ref: str) -> None:
    """Raise DatasetWithdrawn if lineage records `ds`'s version as withdrawn. Fails closed: a lineage store that
    cannot be read is an error, not a pass (a withdrawal must bite even while its database is down)."""
    from sqlalchemy.exc import SQLAlchemyError

    from trainforge.registry.lineage import LineageStore, lineage_url

    url = lineage_url()
    if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).exists():
        # No lineage database yet: nothing was ever recorded, so nothing withdrawn; opening it would create it, and
        # a spec that is rejected must leave nothing behind.
        return
    try:
        found = LineageStore().withdrawal(ds.name, ds.version)
    except SQLAlchemyError as exc:
        raise CatalogError(f"cannot check whether dataset version {ds.name}@{ds.version[:12]} was withdrawn: the "
                           f"lineage store ({lineage_url().split('@')[-1]}) is unreachable ({type(exc).__name__}); "
                           "retry when it is up, or fix TRAINFORGE_LINEAGE_URL") from None
    if found is not None:
        raise DatasetWithdrawn(ref, ds.name, ds.version, found.who, found.why, found.when())


def _resolve(ref: str, base_dir: Path | None, gated: bool = True) -> ResolvedDataset:
    scheme, _, rest = ref.partition("://")
    if scheme == "catalog":
        name, _, version = rest.partition("@")
        catalog = EmbeddedCatalog()
        ds = catalog.resolve(name, version or "main")
        if not gated:
            return ds
        from trainforge.datasets.gate import GateFailed, missing_report

        report = catalog.get_quality(ds.name, ds.version)
        if report is None:  # a version nothing has checked is not trained on (datasets/gate.py)
            raise missing_report(ds)
        if not report.get("passed", False):
            raise GateFailed(ds, report)
        return ds
    if scheme == "lakefs":
        from trainforge.datasets.lakefs_catalog import LakeFSCatalog

        return LakeFSCatalog.from_env().resolve(ref)
    if scheme == "file":
        path = Path(rest)
        if not path.is_absolute():
            path = (base_dir or Path.cwd()) / path
        return load_version_dir(path.resolve(), ref)
    raise CatalogError(f"{scheme}:// datasets are not resolvable on the embedded backend yet")


def check_reference(ref: str, base_dir: Path, dataset: Any = None) -> Problem | None:
    """None if the reference resolves; otherwise an error, or "not-checked" for systems out of reach."""
    return check_and_resolve(ref, base_dir, dataset)[0]


def check_and_resolve(ref: str, base_dir: Path, dataset: Any = None) -> tuple[Problem | None, ResolvedDataset | None]:
    """`check_reference`'s problem, and the version when it resolved (so a caller that checks more of it, as
    validate does its tokenizer, does not resolve it again: a lakeFS ref is a round trip)."""
    scheme = ref.partition("://")[0]
    if scheme in ("catalog", "file"):
        return _resolved(ref, base_dir, "check the name; `trainforge demo` builds the demo dataset (catalog://demo-text)"
                         if scheme == "catalog" else "point file:// at a dataset version folder holding manifest.json")
    if scheme in ("s3", "gs"):
        if not (os.environ.get("AWS_ACCESS_KEY_ID") or os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")):
            return Problem("dataset.ref", f"{scheme}:// reference not checked: no object-storage credentials in "
                           "this environment", ref, "run where the credentials are set, or drop --strict",
                           "not-checked"), None
        if scheme == "s3" and dataset is not None:
            return _listed(ref, dataset), None
        return Problem("dataset.ref", f"{scheme}:// existence is checked at submit time", ref, "", "not-checked"), None
    if scheme == "lakefs":
        from trainforge.datasets import lakefs_catalog as lk

        if not lk.lakectl_configured():  # the lakectl config file and LAKECTL_* env; the server is not contacted
            server = [k for k in lk.SERVER_ENV if os.environ.get(k)]
            why = (f" (trainforge no longer reads {', '.join(server)}: LAKEFS_ is the lakeFS server's own "
                   "configuration prefix)" if server else "")
            return Problem("dataset.ref", f"lakefs:// reference not checked: no lakeFS client is configured{why}",
                           ref, f"configure lakeFS the lakectl way (`lakectl config`, ~/.lakectl.yaml or the file "
                           f"named by {lk.CONFIG_FILE_ENV}; or {lk.ENDPOINT_ENV}, {lk.ACCESS_KEY_ENV} and "
                           f"{lk.SECRET_KEY_ENV}) or drop --strict", "not-checked"), None
        return _resolved(ref, base_dir, "check the repository, ref and path in lakeFS")
    return Problem("dataset.ref", "unknown dataset scheme", ref,
                   "use catalog://, file://, s3://, gs:// or lakefs://"), None


def _resolved(ref: str, base_dir: Path, fix: str) -> tuple[Problem | None, ResolvedDataset | None]:
    try:
        return None, resolve_reference(ref, base_dir)
    except DatasetWithdrawn as exc:
        return Problem("dataset.ref", exc.reason, ref, exc.fix), None
    except CatalogError as exc:
        return Problem("dataset.ref", str(exc), ref, getattr(exc, "fix", fix)), None


def _listed(ref: str, dataset: Any) -> Problem | None:
    """An s3:// prefix lists (with these credentials) to at least one object of the dataset's format. Nothing is
    recorded: validate leaves nothing behind."""
    from trainforge.datasets.pin_prefix import list_prefix

    try:
        list_prefix(ref, format=dataset.format, text_field=dataset.text_field, license=dataset.license or "",
                    chunk_mb=dataset.chunk_mb)
    except CatalogError as exc:
        return Problem("dataset.ref", str(exc), ref, "point dataset.ref at a prefix holding the data, readable with "
                       "these credentials")
    return None
