"""DCP reading straight from bytes in memory: a restore from in-memory replicas hands the shard files' bytes (mapped
from /dev/shm or received from a peer) to DCP without writing them to a folder first.

`SafeMemoryReader` is `SafeFileSystemReader` (allow-list unpickler for `.metadata`, `weights_only` for values) on a
read-only file system whose files are uint8 tensors; a stream reads with one copy into what DCP asks for.
"""

from __future__ import annotations

import io
import os
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import FileSystem

from trainforge.trainer.checkpointing.safe_dcp import SafeFileSystemReader

ROOT = Path("/in-memory-checkpoint")


class _MemoryStream(io.RawIOBase):
    """A seekable, read-only stream over a byte buffer."""

    def __init__(self, data: memoryview):
        super().__init__()
        self._data = data
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._data)}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        end = len(self._data) if size is None or size < 0 else min(len(self._data), self._pos + size)
        out = bytes(self._data[self._pos:end]) if end > self._pos else b""
        self._pos = max(self._pos, end)
        return out

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), len(self._data) - self._pos))
        view[:n] = self._data[self._pos:self._pos + n]
        self._pos += n
        return n


class MemoryFileSystem(FileSystem):
    """DCP's file-system interface over name -> bytes; only reading is supported."""

    def __init__(self, files: Mapping[str, torch.Tensor]):
        self.files = {name: memoryview(t.numpy()).cast("B") for name, t in files.items()}

    def _name(self, path: str | os.PathLike) -> str:
        return Path(path).relative_to(ROOT).as_posix()

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if mode != "rb":
            raise PermissionError(f"in-memory checkpoint is read-only (asked to open {path} with mode {mode!r})")
        name = self._name(path)
        if name not in self.files:
            raise FileNotFoundError(f"in-memory checkpoint has no file {name!r} (has {sorted(self.files)})")
        with _MemoryStream(self.files[name]) as stream:
            yield stream

    def exists(self, path: str | os.PathLike) -> bool:
        return self._name(path) in self.files

    def mkdir(self, path: str | os.PathLike) -> None:
        raise PermissionError("in-memory checkpoint is read-only")

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        raise PermissionError("in-memory checkpoint is read-only")

    def rm_file(self, path: str | os.PathLike) -> None:
        raise PermissionError("in-memory checkpoint is read-only")


class SafeMemoryReader(SafeFileSystemReader):
    def __init__(self, files: Mapping[str, torch.Tensor]):
        super().__init__(ROOT)
        self.fs = MemoryFileSystem(files)
