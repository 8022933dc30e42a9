"""Object storage behind one small interface: a local folder (embedded default) or S3."""

from trainforge.infra.storage.base import ObjectExistsError, ObjectNotFoundError, ObjectStore, PermissionDeniedError
from trainforge.infra.storage.local import LocalObjectStore

__all__ = [
    "LocalObjectStore",
    "ObjectExistsError",
    "ObjectNotFoundError",
    "ObjectStore",
    "PermissionDeniedError",
    "open_store",
]


def open_store(url: str) -> ObjectStore:
    """`file:///path` or a plain path -> LocalObjectStore; `s3://bucket/prefix` -> S3ObjectStore."""
    if url.startswith("s3://"):
        from trainforge.infra.storage.s3 import S3ObjectStore

        return S3ObjectStore.from_url(url)
    return LocalObjectStore(url.removeprefix("file://"))
