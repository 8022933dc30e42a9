"""The embedded default object store: a local folder. Writes are atomic (temp file + rename)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from trainforge.infra.storage.base import (
    ObjectChangedError,
    ObjectExistsError,
    ObjectNotFoundError,
    ObjectStore,
    PermissionDeniedError,
    check_key,
    in_scope,
    scoped_list_prefix,
)

_check_key = check_key  # kept for callers of the old private name


class LocalObjectStore:
    def __init__(self, root: str | Path, prefix: str = ""):
        self.root = Path(root).expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.prefix = prefix.strip("/")
        self.url = f"file://{self.root}" + (f"/{self.prefix}" if self.prefix else "")

    def _path(self, key: str) -> Path:
        check_key(key)
        if not in_scope(key, self.prefix):
            raise PermissionDeniedError(f"this handle may only access {self.prefix}/; refused {key!r}")
        return self.root / key

    def put_bytes(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if if_match is not None:
                # compare-and-swap: the folder's lock serializes conditional writers (any process on this host)
                with _folder_lock(path.parent):
                    try:
                        current = _etag(path.read_bytes())
                    except FileNotFoundError:
                        raise ObjectChangedError(key, if_match, status=412) from None
                    if current != if_match:
                        raise ObjectChangedError(key, if_match, status=412)
                    os.replace(tmp, path)
            elif if_none_match:
                try:
                    os.link(tmp, path)  # atomic create-if-absent
                except FileExistsError:
                    raise ObjectExistsError(key) from None
                os.unlink(tmp)
            else:
                os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def put_file(self, key: str, path: Path, *, if_none_match: bool = False) -> None:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".tmp-")
        os.close(fd)
        try:
            shutil.copyfile(path, tmp)
            if if_none_match:
                try:
                    os.link(tmp, dest)
                except FileExistsError:
                    raise ObjectExistsError(key) from None
                os.unlink(tmp)
            else:
                os.replace(tmp, dest)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def get_bytes(self, key: str, byte_range: tuple[int, int] | None = None) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                if byte_range is None:
                    return f.read()
                start, end = byte_range
                f.seek(start)
                return f.read(max(0, end - start))
        except FileNotFoundError:
            raise ObjectNotFoundError(key) from None

    def get_with_etag(self, key: str) -> tuple[bytes, str]:
        try:  # writes replace the file atomically: these bytes and their ETag belong together
            data = self._path(key).read_bytes()
        except FileNotFoundError:
            raise ObjectNotFoundError(key) from None
        return data, _etag(data)

    def get_file(self, key: str, path: Path) -> None:
        src = self._path(key)
        if not src.is_file():
            raise ObjectNotFoundError(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, path)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str = "", *, start_after: str = "") -> list[str]:
        prefix = scoped_list_prefix(prefix, self.prefix)
        # Walk only the deepest folder the prefix names, not the whole store.
        base = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
        out = []
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                if name.startswith(".tmp-"):
                    continue
                key = os.path.relpath(os.path.join(dirpath, name), self.root).replace(os.sep, "/")
                if key.startswith(prefix) and key > start_after and in_scope(key, self.prefix):
                    out.append(key)
        return sorted(out)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink()
        except FileNotFoundError:
            return

    def scoped(self, prefix: str) -> ObjectStore:
        prefix = prefix.strip("/")
        if self.prefix and not (prefix + "/").startswith(self.prefix + "/"):
            raise PermissionDeniedError(f"cannot widen a handle scoped to {self.prefix}/ to {prefix}/")
        return LocalObjectStore(self.root, prefix)

    def local_path(self, key: str) -> Path:
        """The file behind a key (local store only): lets DCP read and write in place."""
        return self._path(key)


def _etag(data: bytes) -> str:
    """S3's ETag of a single-part object: the md5 of its bytes, quoted."""
    return f'"{hashlib.md5(data, usedforsecurity=False).hexdigest()}"'


@contextlib.contextmanager
def _folder_lock(folder: Path) -> Iterator[None]:
    """An exclusive flock on a folder (no lock file: nothing appears among the keys)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock
