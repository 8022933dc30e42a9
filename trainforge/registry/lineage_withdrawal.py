"""Withdrawing a dataset version so that it bites: lineage records it, MLflow shows it, nothing new trains on it.

`withdraw(name, version, why=...)` is what `trainforge lineage withdraw` and the `lineage-query` flow run:
  1. the version is recorded withdrawn in lineage, with who, when and why (first recorded there from the catalog
     if no job ever trained on it, so a version can be withdrawn before anyone uses it);
  2. every MLflow run of a job trained on it and every registered model version downstream of it (directly or
     through fine-tuning) is tagged `trainforge.dataset_withdrawn` (+ `_by`, `_at`, `_why`);
  3. from then on dataset resolution refuses it for every job (`datasets.refs.refuse_withdrawn`: validate and the
     flow's resolve-dataset task), by version, branch or tag; promotion, aliases, Staging/Production and
     `init_from` refuse what was trained on it (`LineageStore.check_usable`).
A model version registered after the withdrawal (a job that was already running) is tagged when it is registered
(`tag_if_withdrawn`, called by promotion.after_register).
"""

from __future__ import annotations

from typing import Any

from trainforge.registry.lineage import LineageStore, Node, Withdrawal, dataset_id, parse_target

WITHDRAWN_TAG = "trainforge.dataset_withdrawn"
MAX_WHY = 500  # MLflow tag values are capped (5000 on runs); the full reason is in lineage's audit


def withdrawn_tags(withdrawals: list[Withdrawal]) -> dict[str, str]:
    """The MLflow tags of something trained on these withdrawn versions: the versions (comma-separated) and the
    latest withdrawal's who, when and why."""
    if not withdrawals:
        return {}
    last = max(withdrawals, key=lambda w: w.at)
    return {WITHDRAWN_TAG: ",".join(sorted(f"{w.name}@{w.version}" for w in withdrawals)),
            f"{WITHDRAWN_TAG}_by": last.who, f"{WITHDRAWN_TAG}_at": last.when(),
            f"{WITHDRAWN_TAG}_why": last.why[:MAX_WHY]}


def withdrawals_upstream(store: LineageStore, node_id: str) -> list[Withdrawal]:
    """Every withdrawn dataset version `node_id` was trained on, directly or through its ancestry."""
    found = []
    for n in store.upstream(node_id):
        if n.kind == "dataset" and n.status == "withdrawn":
            w = store.withdrawal(n.name, n.version)
            if w is not None:
                found.append(w)
    return found


def _ensure_recorded(store: LineageStore, name: str, version: str) -> None:
    """Record a catalog version lineage has never seen (no job trained on it yet), so it can be withdrawn first."""
    if store.find_datasets(name, version):
        return
    from trainforge.datasets.catalog import CatalogError, EmbeddedCatalog

    catalog = EmbeddedCatalog()
    try:
        full = catalog.resolve_version(name, version)
    except CatalogError as exc:
        raise LookupError(f"no dataset version {name}@{version} in the lineage store or the catalog: {exc}") from None
    if not full.startswith(version):  # a branch or tag: withdrawal is of an immutable version, say which
        raise LookupError(f"{version!r} is a branch or tag of {name!r} (it points at {full[:12]}); withdraw the "
                          f"version itself: {name}@{full[:12]}")
    ds = catalog.resolve(name, full)
    from trainforge.registry.lineage import dataset_provenance

    store.record_dataset(name, full, license=ds.license, ref=f"catalog://{name}@{full}", path=str(ds.path),
                         provenance=dataset_provenance(ds.manifest.to_dict()))


def tag_tracking(store: LineageStore, nodes: list[Node], tracker: Any) -> dict[str, list[str]]:
    """Tag the MLflow run of every job and every registered model version in `nodes` with the withdrawn
    versions each was trained on. Returns {"tagged": [...], "errors": [...]}: one failure (a version deleted
    in MLflow) does not stop the others, and re-running the withdrawal retries it (tags are idempotent)."""
    tagged: list[str] = []
    errors: list[str] = []
    missing: list[str] = []
    for n in nodes:
        if n.kind not in ("job", "model"):
            continue
        tags = withdrawn_tags(withdrawals_upstream(store, n.id))
        if not tags:
            continue
        try:
            if n.kind == "model":
                tracker.set_version_tags(n.name, n.version, tags)
                tagged.append(f"models:/{n.name}/{n.version}")
            elif n.attrs.get("mlflow_run_id"):
                tracker.set_tags(n.attrs["mlflow_run_id"], tags)
                tagged.append(f"runs:/{n.attrs['mlflow_run_id']} (job {n.name})")
        except Exception as exc:  # MLflow's errors are many kinds; each is reported, none hides the rest
            if getattr(exc, "error_code", "") == "RESOURCE_DOES_NOT_EXIST":
                missing.append(n.id)  # deleted from MLflow (or never registered there): nothing left to tag
            else:
                errors.append(f"{n.id}: {type(exc).__name__}: {str(exc)[:200]}")
    return {"tagged": tagged, "errors": errors, "missing": missing}


def withdraw(name: str, version: str, *, why: str, who: str | None = None, quarantine: bool = False,
             store: LineageStore | None = None, tracker: Any = None) -> dict[str, Any]:
    """Withdraw dataset version `name@version` (a version id or a unique prefix of it): lineage, then the MLflow
    tags. Returns the trained-on report ({"datasets", "affected"}) plus "tagged", "tag_errors" and
    "not_in_mlflow" (lineage nodes MLflow no longer has)."""
    store = store or LineageStore()
    _ensure_recorded(store, name, version)
    result = store.withdraw_dataset(name, version, who=who, why=why, quarantine=quarantine)
    ds = result["datasets"][0]
    downstream = store.downstream([dataset_id(ds.name, ds.version)])
    if tracker is None and any(n.kind in ("job", "model") for n in downstream):
        from trainforge.registry.tracking import Tracker

        tracker = Tracker()
    marks = tag_tracking(store, downstream, tracker) if tracker is not None else {}
    report: dict[str, Any] = store.trained_on_report(ds.name, ds.version)
    return report | {"tagged": marks.get("tagged", []), "tag_errors": marks.get("errors", []),
                     "not_in_mlflow": marks.get("missing", [])}


def tag_if_withdrawn(store: LineageStore, target: str, tracker: Any) -> dict[str, str]:
    """Tag one model version just registered if it was trained on withdrawn data (an MLflow error propagates: the
    caller's registration step fails loudly rather than leave an untagged version). Returns the tags set."""
    node = store.node(parse_target(target))
    tags = withdrawn_tags(withdrawals_upstream(store, node.id))
    if tags and node.kind == "model":
        tracker.set_version_tags(node.name, node.version, tags)
    return tags
