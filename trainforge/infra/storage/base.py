"""The ObjectStore protocol: keys are '/'-separated strings relative to the store's root."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable


class StorageError(OSError):
    """A backend failure that is none of the specific errors below (after the backend's own retries)."""


class ObjectNotFoundError(KeyError):
    pass


class ObjectExistsError(FileExistsError):
    """A conditional write (if_none_match) found the key already present."""


class ObjectChangedError(OSError):
    """A pinned read or a conditional overwrite (if_match) found the object changed: its pinned ETag no longer
    matches, or its pinned version (or the key) is gone. `status` is the server's HTTP status where one answered
    (412 Precondition Failed for a refused conditional write)."""

    def __init__(self, key: str, etag: str = "", version_id: str | None = None, *, status: int | None = None):
        self.key, self.etag, self.version_id, self.status = key, etag, version_id, status
        pinned = f"version {version_id}" if version_id else f"ETag {etag}"
        super().__init__(f"{key}: the pinned {pinned} is no longer there (overwritten or deleted)")


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One listed object: its key (relative to the store's root), size, ETag and version id (versioned listing)."""

    key: str
    size: int
    etag: str
    version_id: str | None = None


class PermissionDeniedError(PermissionError):
    """The handle is scoped to a prefix and the key lies outside it, or the server refused the request
    (wrong credentials, or a per-job identity reaching outside its prefix)."""


def check_key(key: str) -> str:
    """Keys are relative '/'-separated paths: no leading '/', no empty, '.' or '..' segment."""
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"invalid object key {key!r}")
    return key


def in_scope(key: str, scope: str) -> bool:
    """Whether `key` lies inside the scope prefix `scope` (no scope: everything)."""
    return not scope or key == scope or key.startswith(scope + "/")


def scoped_list_prefix(prefix: str, scope: str) -> str:
    """The listing prefix a handle scoped to `scope` may use for `list(prefix)`.

    "" (everything visible) narrows to the scope itself; the scope without its trailing '/' also means the
    scope (so that a job 'j1' never sees 'j10'); anything outside the scope is refused."""
    if not scope:
        return prefix
    if prefix in ("", scope, scope + "/"):
        return scope + "/"
    if prefix.startswith(scope + "/"):
        return prefix
    raise PermissionDeniedError(f"this handle may only list under {scope}/; refused {prefix!r}")


def list_after(store: ObjectStore, prefix: str, start_after: str) -> list[str]:
    """`store.list(prefix, start_after=...)` for any store, also one whose `list` predates the keyword (the
    dataset catalog's adapters): those list everything and filter here."""
    try:
        native = "start_after" in inspect.signature(store.list).parameters
    except (TypeError, ValueError):
        native = False
    if native:
        return store.list(prefix, start_after=start_after)
    return [k for k in store.list(prefix) if k > start_after]


@runtime_checkable
class ObjectStore(Protocol):
    url: str

    def put_bytes(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> None:
        """Write an object atomically. if_none_match: fail with ObjectExistsError if the key exists. if_match: an
        ETag (from `get_with_etag`): overwrite only while the object still has it, else ObjectChangedError (the
        server's 412); the compare and the write are one step on the server."""

    def put_file(self, key: str, path: Path, *, if_none_match: bool = False) -> None:
        """Upload a local file (multipart where the backend supports it); if_none_match as for put_bytes."""

    def get_bytes(self, key: str, byte_range: tuple[int, int] | None = None) -> bytes:
        """Read an object, or the half-open byte range [start, end)."""

    def get_file(self, key: str, path: Path) -> None:
        """Download an object to a local file."""

    def exists(self, key: str) -> bool: ...

    def list(self, prefix: str = "", *, start_after: str = "") -> list[str]:
        """Keys under a prefix, sorted; with start_after, only the keys sorting after it (S3's StartAfter:
        a reader that remembers its last key lists only what is new, not the whole prefix again)."""

    def delete(self, key: str) -> None: ...

    def scoped(self, prefix: str) -> ObjectStore:
        """A handle that can only read and write under `prefix` (per-job credentials)."""


@runtime_checkable
class ConditionalObjectStore(ObjectStore, Protocol):
    """A store whose writes can be conditional on an object's current ETag (compare-and-swap on one key): the
    local folder and S3 (SeaweedFS, AWS) both are. The job's fence (registry/fence.py) needs it."""

    def get_with_etag(self, key: str) -> tuple[bytes, str]:
        """The object's bytes and the ETag they have (ObjectNotFoundError if absent), for `put_bytes(if_match=)`."""
