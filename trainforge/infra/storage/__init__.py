"""Object storage behind one small interface: a local folder (embedded default) or S3."""

from trainforge.infra.storage.base import (
    ObjectChangedError,
    ObjectExistsError,
    ObjectInfo,
    ObjectNotFoundError,
    ObjectStore,
    PermissionDeniedError,
    StorageError,
)
from trainforge.infra.storage.iam import render_job_iam_policy
from trainforge.infra.storage.layout import checkpoint_prefix, job_prefix
from trainforge.infra.storage.local import LocalObjectStore

__all__ = [
    "LocalObjectStore",
    "ObjectChangedError",
    "ObjectExistsError",
    "ObjectInfo",
    "ObjectNotFoundError",
    "ObjectStore",
    "PermissionDeniedError",
    "StorageError",
    "checkpoint_prefix",
    "job_prefix",
    "open_store",
    "render_job_iam_policy",
]


def open_store(url: str) -> ObjectStore:
    """`file:///path` or a plain path -> LocalObjectStore; `s3://bucket/prefix` -> S3ObjectStore
    (endpoint and credentials from the environment, see S3ObjectStore.from_url). boto3 loads only here."""
    if url.startswith("s3://"):
        from trainforge.infra.storage.s3 import S3ObjectStore

        return S3ObjectStore.from_url(url)
    return LocalObjectStore(url.removeprefix("file://"))
