"""The ObjectStore protocol: keys are '/'-separated strings relative to the store's root."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable


class ObjectNotFoundError(KeyError):
    pass


class ObjectExistsError(FileExistsError):
    """A conditional write (if_none_match) found the key already present."""


class PermissionDeniedError(PermissionError):
    """The handle is scoped to a prefix and the key lies outside it."""


@runtime_checkable
class ObjectStore(Protocol):
    url: str

    def put_bytes(self, key: str, data: bytes, *, if_none_match: bool = False) -> None:
        """Write an object atomically. if_none_match: fail with ObjectExistsError if the key exists."""

    def put_file(self, key: str, path: Path) -> None:
        """Upload a local file (multipart where the backend supports it)."""

    def get_bytes(self, key: str, byte_range: tuple[int, int] | None = None) -> bytes:
        """Read an object, or the half-open byte range [start, end)."""

    def get_file(self, key: str, path: Path) -> None:
        """Download an object to a local file."""

    def exists(self, key: str) -> bool: ...

    def list(self, prefix: str = "") -> list[str]:
        """Keys under a prefix, sorted."""

    def delete(self, key: str) -> None: ...

    def scoped(self, prefix: str) -> ObjectStore:
        """A handle that can only read and write under `prefix` (per-job credentials)."""
