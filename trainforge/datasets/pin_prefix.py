"""Pin an s3:// prefix: list its objects (with their ETags, and version ids where the bucket keeps versions) into a
`PrefixManifest` and record it in the embedded catalog. Lists; never reads the data."""

from __future__ import annotations

import logging
import os
from typing import Any

from trainforge.datasets.catalog import CatalogError, EmbeddedCatalog, ResolvedDataset
from trainforge.datasets.prefix_manifest import (
    FORMATS,
    SUFFIXES,
    PrefixManifest,
    SourceObject,
    derived_name,
    matches,
    split_ref,
)
from trainforge.infra.storage import PermissionDeniedError, StorageError

logger = logging.getLogger(__name__)


def _store(bucket: str) -> Any:
    from trainforge.infra.storage.s3 import S3ObjectStore

    return S3ObjectStore.from_url(f"s3://{bucket}")


PLATFORM_STORES = ("TRAINFORGE_STORAGE_URL", "TRAINFORGE_DATASETS_URL")


def refuse_platform_prefix(bucket: str, prefix: str) -> None:
    """The platform's own stores (every team's checkpoints, channels and inputs; the dataset catalog) are never a
    dataset: the job's identity would be granted read on what it names, and the pin and the gate read it with the
    platform's credentials."""
    for var in PLATFORM_STORES:
        url = os.environ.get(var, "")
        if not url.startswith("s3://"):
            continue
        own_bucket, _, root = url.removeprefix("s3://").partition("/")
        root = root.strip("/")
        inside = not root or prefix == root or prefix.startswith(root + "/") or root.startswith(prefix + "/") \
            or not prefix
        if own_bucket == bucket and inside:
            raise CatalogError(f"s3://{bucket}/{prefix} overlaps the platform's own store ({var}={url}), where "
                               "every team's checkpoints and job data live: it cannot be a dataset. Put the data in "
                               "a bucket or prefix of its own")


def list_prefix(ref: str, *, format: str, text_field: str, license: str, chunk_mb: float = 4.0,
                store: Any = None) -> PrefixManifest:
    """The manifest of what `ref` (`s3://bucket/prefix[/glob]`) names now. Raises CatalogError, saying what to
    fix, for a bad format, a missing bucket, refused credentials or a prefix with no matching object."""
    if format not in FORMATS:
        raise CatalogError(f"an s3:// prefix is read in place: dataset.format must be one of {', '.join(FORMATS)}, "
                           f"not {format!r}")
    bucket, prefix, pattern = split_ref(ref)
    refuse_platform_prefix(bucket, prefix)
    store = store if store is not None else _store(bucket)
    try:
        try:
            versioned = store.versioning_enabled()
        except PermissionDeniedError:
            versioned = False  # may not read the bucket's configuration: pin by ETag, which needs no more
        listed = store.list_objects(f"{prefix}/" if prefix else "", versions=versioned)
    except PermissionDeniedError as exc:
        raise CatalogError(f"cannot list {ref}: {exc}; the submitting identity needs List and Read on the "
                           "prefix") from None
    except StorageError as exc:
        raise CatalogError(f"cannot list {ref}: {exc}") from None
    start = len(prefix) + 1 if prefix else 0
    objects = tuple(SourceObject(o.key, o.size, o.etag, o.version_id) for o in listed
                    if matches(o.key[start:], pattern, format))
    if not objects:
        what = f"matching {pattern!r}" if pattern else f"ending in {' or '.join(SUFFIXES[format])}"
        raise CatalogError(f"{ref} holds no objects {what} ({len(listed)} objects under the prefix); check the "
                           "prefix and dataset.format, or add a glob to the reference (s3://bucket/prefix/*.jsonl.gz)")
    return PrefixManifest(name=derived_name(bucket, prefix), source=f"s3://{bucket}/{prefix}".rstrip("/"),
                          pattern=pattern, format=format, text_field=text_field, license=license,
                          chunk_bytes=max(1, int(chunk_mb * (1 << 20))), versioned=versioned, objects=objects)


def pin_prefix(ref: str, dataset: Any, *, catalog: EmbeddedCatalog | None = None,
               store: Any = None) -> ResolvedDataset:
    """List `ref` as the spec's `dataset` section says to read it and commit it as a catalog version (branch
    `main` of the derived name moves to it)."""
    manifest = list_prefix(ref, format=dataset.format, text_field=dataset.text_field, license=dataset.license or "",
                           chunk_mb=dataset.chunk_mb, store=store)
    catalog = catalog or EmbeddedCatalog()
    ds = catalog.commit_prefix(manifest)
    logger.info("pinned %s as %s@%s: %d objects, %d bytes%s", ref, manifest.name, manifest.version_id[:12],
                len(manifest.objects), manifest.total_bytes, " (by version id)" if manifest.versioned else " (by ETag)")
    return ResolvedDataset(ref=ref, name=ds.name, version=ds.version, license=ds.license, path=ds.path,
                           manifest=ds.manifest)
