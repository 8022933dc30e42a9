"""DCP reading straight from bytes in memory: a restore from in-memory replicas hands the shard files' bytes (mapped
from /dev/shm or received from a peer) to DCP without writing them to a folder first.

`SafeMemoryReader` is `SafeFileSystemReader` (allow-list unpickler for `.metadata`, `weights_only` for values) on a
read-only file system whose files are uint8 tensors; a stream reads with one copy into what DCP asks for. The file
system holds files as pieces, so a restore that holds only some chunks of a file (store_reader.py) uses it too.
"""

from __future__ import annotations

import bisect
import io
import os
from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import FileSystem

from trainforge.trainer.checkpointing.safe_dcp import SafeFileSystemReader

ROOT = Path("/in-memory-checkpoint")


Pieces = Sequence[tuple[int, memoryview]]
"""A file's bytes held in memory: (offset in the file, bytes) pieces, sorted by offset. A whole file is one piece
at 0; a restore from the store (store_reader.py) holds only the chunks its load plan reads."""


class _PiecesStream(io.RawIOBase):
    """A seekable, read-only stream over a file's pieces; reading a byte no piece holds (a gap in a partial file)
    fails loudly: it means the read plan and the reads disagree."""

    def __init__(self, name: str, pieces: Pieces):
        super().__init__()
        self._name = name
        self._pieces = pieces
        self._starts = [start for start, _ in pieces]
        self._end = pieces[-1][0] + len(pieces[-1][1]) if pieces else 0
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._end}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        view = memoryview(buffer).cast("B")
        want = max(0, min(len(view), self._end - self._pos))
        done = 0
        while done < want:
            i = bisect.bisect_right(self._starts, self._pos) - 1
            start, data = self._pieces[i] if i >= 0 else (0, memoryview(b""))
            inside = self._pos - start
            if i < 0 or inside >= len(data):
                raise OSError(f"{self._name}: byte {self._pos} is not held in memory (read plan mismatch)")
            n = min(want - done, len(data) - inside)
            view[done:done + n] = data[inside:inside + n]
            done += n
            self._pos += n
        return done

    def read(self, size: int | None = -1) -> bytes:
        n = self._end - self._pos if size is None or size < 0 else size
        out = bytearray(max(0, n))
        return bytes(out[:self.readinto(out)])


class MemoryFileSystem(FileSystem):
    """DCP's file-system interface over name -> pieces in memory; only reading is supported."""

    def __init__(self, files: Mapping[str, Pieces]):
        self.files = files

    def _name(self, path: str | os.PathLike) -> str:
        return Path(path).relative_to(ROOT).as_posix()

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if mode != "rb":
            raise PermissionError(f"in-memory checkpoint is read-only (asked to open {path} with mode {mode!r})")
        name = self._name(path)
        if name not in self.files:
            raise FileNotFoundError(f"in-memory checkpoint has no file {name!r} (has {sorted(self.files)})")
        with _PiecesStream(name, self.files[name]) as stream:
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
        self.fs = MemoryFileSystem({name: [(0, memoryview(t.numpy()).cast("B"))] for name, t in files.items()})
