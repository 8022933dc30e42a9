"""The data team's release hook: build (or import) a dataset version, run its quality gate, tag it, record it.

    from trainforge.flows.dataset_release import dataset_release
    dataset_release(name="web", source="/data/crawl-2026-11", license="CC-BY-4.0", tag="2026-11")
    dataset_release(name="web", import_ref="file:///data/prebuilt/v7", tag="v7")   # an already built version

A version that fails its gate is published (content-addressed, with its report) but no branch or tag moves to it
and the flow fails with the report, so jobs cannot pick it up. The tasks are thin wrappers over
trainforge.datasets (kept next to the flow because they have no other user).

A released version is announced as the Prefect event `trainforge.dataset.released` on the resource
`trainforge.dataset.<name>` (labels branch, tag, version; payload with the version): the automations that
`trainforge automations install` creates from prefect.yaml's `dataset_triggers` run the subscribed training jobs
on it (trainforge/infra/automations.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE


class QualityGateFailed(RuntimeError):
    pass


# Each task is idempotent (versions are content-addressed; refs and tags are set, not appended), so a transient
# storage or network error is retried; a user's mistake (a missing source, a bad argument) is not.
RETRIES = 2
RETRY_DELAY_S = 2
_NOT_TRANSIENT = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


def _transient(task: Any, task_run: Any, state: Any) -> bool:
    """retry_condition_fn: retry an OSError or a timeout, never a user error."""
    try:
        state.result(raise_on_failure=True)
    except _NOT_TRANSIENT:
        return False
    except (OSError, TimeoutError):
        return True
    except BaseException:  # noqa: BLE001 - anything else is the data's or the caller's problem
        return False
    return False


def _release_task(name: str) -> Any:
    return task(name=name, cache_policy=NO_CACHE, retries=RETRIES, retry_delay_seconds=RETRY_DELAY_S,
                retry_condition_fn=_transient)


@_release_task("build-dataset-version")
def build_version(name: str, source: str, license: str, seq_len: int, text_field: str, num_workers: int) -> str:
    from trainforge.datasets.build import BuildConfig, build_dataset

    cfg = BuildConfig(license=license, seq_len=seq_len, text_field=text_field, num_workers=num_workers)
    return build_dataset(Path(source), name, cfg, ref=None).version


@_release_task("import-dataset-version")
def import_version(name: str, import_ref: str) -> str:
    """Copy an already built version (any resolvable reference) into the catalog, unchanged."""
    from trainforge.datasets.catalog import EmbeddedCatalog
    from trainforge.datasets.refs import resolve_reference
    from trainforge.datasets.shards import ShardInfo

    src = resolve_reference(import_ref, gated=False)  # the copy is gated next (run-quality-gate)
    if src.in_place:
        raise ValueError(f"{import_ref} is an s3:// prefix read in place: it has no shards to import. Train on it "
                         "directly (dataset.ref: the prefix), or build shards from it with `trainforge datasets "
                         "build`")
    m = src.manifest

    def copy(folder: Path) -> list[ShardInfo]:
        for s in m.shards:
            shutil.copyfile(src.path / s.file, folder / s.file)
        return list(m.shards)

    return EmbeddedCatalog().commit(name, copy, sample_len=m.sample_len, token_dtype=m.token_dtype,
                                    vocab_size=m.vocab_size, tokenizer=m.tokenizer, license=m.license,
                                    provenance={**m.provenance, "imported_from": import_ref}, ref=None,
                                    features=m.features).version


@_release_task("run-quality-gate")
def run_quality_gate(name: str, version: str) -> dict[str, Any]:
    from trainforge.datasets.catalog import EmbeddedCatalog
    from trainforge.datasets.quality import run_gate

    catalog = EmbeddedCatalog()
    report = run_gate(catalog.resolve(name, version))
    catalog.put_quality(name, version, report)
    return report


@_release_task("tag-dataset-version")
def publish_version(name: str, version: str, branch: str, tag: str | None) -> None:
    from trainforge.datasets.catalog import EmbeddedCatalog

    catalog = EmbeddedCatalog()
    catalog.set_ref(name, branch, version)
    if tag:
        catalog.tag(name, tag, version)


def announce_release(name: str, version: str, branch: str, tag: str | None) -> None:
    """Emit the release event (dependent training jobs subscribe to it). The version is already published when
    this runs, so a failure to emit is logged, not raised: the release itself stands."""
    from prefect.events import emit_event

    from trainforge.infra.automations import release_event

    try:
        emitted = emit_event(**release_event(name, version, branch, tag))
    except Exception as exc:  # noqa: BLE001 - see the docstring
        get_run_logger().warning("released %s, but the release event was not emitted: %s", name, exc)
        return
    if emitted is not None:
        get_run_logger().info("emitted %s for %s (event %s)", emitted.event, emitted.resource.id, emitted.id)


@flow(name="dataset-release", log_prints=False)
def dataset_release(name: str, source: str | None = None, import_ref: str | None = None, license: str = "",
                    tag: str | None = None, branch: str = "main", seq_len: int = 1024, text_field: str = "text",
                    num_workers: int = 0) -> dict[str, Any]:
    """Build `source` (or import `import_ref`) as a version of `name`, gate it, then move `branch` and tag it."""
    logger = get_run_logger()
    if (source is None) == (import_ref is None):
        raise ValueError("give exactly one of source (to build) or import_ref (an already built version)")
    if source is not None:
        if not license:
            raise ValueError("building from source needs license= (the data's SPDX license id)")
        version = build_version(name, source, license, seq_len, text_field, num_workers)
    else:
        version = import_version(name, import_ref)
    report = run_quality_gate(name, version)
    if not report["passed"]:
        raise QualityGateFailed(f"dataset {name} version {version[:12]} failed its quality gate:\n"
                                + "\n".join(report["failures"]))
    publish_version(name, version, branch, tag)
    logger.info("released %s@%s = %s", name, tag or branch, version)
    announce_release(name, version, branch, tag)
    result = {"name": name, "version": version, "branch": branch, "tag": tag,
              "ref": f"catalog://{name}@{tag or branch}", "quality": {"passed": True}}
    logger.info(json.dumps(result))
    return result
