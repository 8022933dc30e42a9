"""DCP restore straight from the object store: each rank reads only the chunks under its load plan's byte ranges,
each chunk verified against the manifest's sha256, and each chunk of the checkpoint is read from the store once.

How one `dcp.load` goes with `StoreRangeReader`:
1. every rank's local plan (DCP's ReadItems) names byte ranges of the checkpoint's files; `prepare_local_plan`
   turns them into the chunks that hold them (read_plan.spans_for_range) and sends that list to the coordinator;
2. the coordinator decides, in `prepare_global_plan`, which rank fetches each needed chunk (read_plan.assign:
   exactly one of the ranks that need it) and who sends it to whom;
3. in `read_data` every rank fetches its chunks (a pool of GETs; a node-local copy of the file is used instead where
   its bytes hash right), verifies each, and the gang agrees on the outcome (one all_gather) before anything is
   copied into the model: a chunk that is missing or does not hash right fails the load on every rank together,
   with the problems listed (`problems`), and the model and optimizer are untouched;
4. one all-to-all hands every chunk to the other ranks that need it; DCP's own reader then reads the ranges from
   those chunks in memory (memory_fs.MemoryFileSystem), through the safe unpickler (safe_dcp.py).
`.metadata` is read by one rank and broadcast before the load (`read_metadata_once`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from trainforge.infra.storage.base import ObjectStore
from trainforge.registry.dedup import ChunkError, chunk_intact, read_chunk
from trainforge.trainer.checkpointing.memory_fs import ROOT, MemoryFileSystem
from trainforge.trainer.checkpointing.read_plan import (
    Chunk,
    RankReads,
    Span,
    assign,
    file_spans,
    spans_for_range,
)
from trainforge.trainer.checkpointing.safe_dcp import SafeFileSystemReader, read_metadata_bytes

FETCH_THREADS = 8  # concurrent GETs per rank: a store's per-request latency, not its bandwidth, bounds one stream


class RestoreReadError(RuntimeError):
    """The restore could not read its chunks. `problems` (same on every rank) lists chunks found missing or corrupt
    (the checkpoint is bad); an empty list means the store failed otherwise (an outage: the checkpoint may be fine)."""

    def __init__(self, message: str, problems: list[str]):
        super().__init__(message)
        self.problems = problems


class StoreRangeReader(SafeFileSystemReader):
    """A DCP StorageReader over one committed checkpoint in the store (see the module docstring). `files` are the
    manifest's entries; `metadata` the `.metadata` bytes (read once, `read_metadata_once`); `extra_files` are files
    this rank reads whole besides its plan (its RNG state), returned in `extra` after the load; `local_copy` is a
    node-local folder that may hold some of the files (a previous save on this node): chunks found there with the
    right sha256 are not fetched."""

    def __init__(self, store: ObjectStore, job_prefix: str, files: Sequence[Mapping[str, Any]], metadata: bytes, *,
                 group: Any = None, extra_files: Sequence[str] = (), local_copy: Path | None = None):
        super().__init__(ROOT)
        self.store, self.job_prefix, self.group = store, job_prefix, group
        self._entries = {f["name"]: f for f in files}
        self._spans: dict[str, list[Span]] = {}
        self._metadata = metadata
        self._extra = [n for n in extra_files if n in self._entries]
        self._local_copy = local_copy
        self._needs: list[Span] = []
        self._names: dict[Chunk, str] = {}
        self.extra: dict[str, bytes] = {}
        self.failure: RestoreReadError | None = None
        """Set on every rank alike when the chunks could not be read (the load then fails on every rank together)."""
        self.fetched_bytes = 0  # read from the store by this rank
        self.local_bytes = 0  # taken from the node-local copy instead
        self.received_bytes = 0  # received from peers

    # -------------------------------------------------------------- DCP's StorageReader

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise FileNotFoundError("a trainforge checkpoint has one global .metadata")
        metadata = read_metadata_bytes(self._metadata)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        needs: dict[tuple[str, int], Span] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            for span in spans_for_range(self._file_spans(info.relative_path), info.offset, info.length):
                needs[(span.name, span.start)] = span
        for name in self._extra:
            for span in self._file_spans(name):
                needs[(span.name, span.start)] = span
        self._needs = list(needs.values())
        self._names = {s.chunk: s.name for s in self._needs}
        return replace(plan, storage_data=sorted({s.chunk for s in self._needs}))

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        reads = assign([p.storage_data or () for p in plans])
        return [replace(p, storage_data=r) for p, r in zip(plans, reads, strict=True)]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
        reads: RankReads = plan.storage_data
        have = self._fetch_and_agree(reads)
        have.update(self._exchange(reads, have))
        files: dict[str, list[tuple[int, memoryview]]] = {}
        for span in sorted(self._needs):
            files.setdefault(span.name, []).append((span.start, have[span.chunk]))
        for name in self._extra:
            self.extra[name] = b"".join(bytes(data) for _, data in files[name])
        self.fs = MemoryFileSystem(files)  # the chunks this rank holds, at their offsets
        return super().read_data(plan, planner)

    # -------------------------------------------------------------- reading and exchanging

    def _file_spans(self, name: str) -> list[Span]:
        if name not in self._spans:
            if name not in self._entries:
                # raised on this rank only (DCP fails the load on every rank): not an agreed `failure`
                raise ChunkError(f"the checkpoint's metadata names {name!r}, which its manifest does not list")
            self._spans[name] = file_spans(self._entries[name])
        return self._spans[name]

    def _fetch_and_agree(self, reads: RankReads) -> dict[Chunk, memoryview]:
        """Fetch and verify this rank's chunks; then every rank learns every rank's problems, so all of them fail
        together (before anything is loaded) or go on together."""
        local = self._local_places(reads.fetch)
        have: dict[Chunk, memoryview] = {}
        problems: list[str] = []
        errors: list[str] = []
        lock = threading.Lock()

        def one(chunk: Chunk) -> None:
            data = self._from_local(chunk, local.get(chunk))
            from_store = data is None
            try:
                if data is None:
                    data = read_chunk(self.store, self.job_prefix, chunk.sha, chunk.size, chunk.codec,
                                      what=self._what(chunk))
            except ChunkError as exc:
                with lock:
                    problems.append(str(exc))
                return
            except Exception as exc:  # the store failed (not the checkpoint): the load fails, nothing is quarantined
                with lock:
                    errors.append(f"{self._what(chunk)}: chunk {chunk.sha[:12]}: {type(exc).__name__}: {exc}")
                return
            with lock:
                have[chunk] = memoryview(data)
                if from_store:
                    self.fetched_bytes += chunk.size
                else:
                    self.local_bytes += chunk.size

        with ThreadPoolExecutor(max_workers=FETCH_THREADS, thread_name_prefix="ckpt-restore-get") as pool:
            list(pool.map(one, reads.fetch))
        outcome = [(sorted(problems), sorted(errors))]
        if self.group is not None:
            outcome = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(outcome, (sorted(problems), sorted(errors)), group=self.group)
        all_problems = [p for ps, _ in outcome for p in ps]
        all_errors = [e for _, es in outcome for e in es]
        if all_problems:
            self.failure = RestoreReadError(f"checkpoint is corrupt: {'; '.join(all_problems[:5])}", all_problems)
        elif all_errors:
            self.failure = RestoreReadError(f"reading the checkpoint failed: {'; '.join(all_errors[:5])}", [])
        if self.failure is not None:
            raise self.failure
        return have

    def _exchange(self, reads: RankReads, have: Mapping[Chunk, memoryview]) -> dict[Chunk, memoryview]:
        """One all-to-all: each chunk goes from the rank that fetched it to every other rank that needs it."""
        if self.group is None:
            return {}
        world = dist.get_world_size(self.group)
        send_sizes, recv_sizes = reads.send_sizes(world), reads.recv_sizes(world)
        out = torch.empty(sum(recv_sizes), dtype=torch.uint8)
        inp = torch.empty(sum(send_sizes), dtype=torch.uint8)
        flat, pos = memoryview(inp.numpy()), 0
        for dst in range(world):
            for chunk in reads.send.get(dst, ()):
                flat[pos:pos + chunk.size] = have[chunk]
                pos += chunk.size
        dist.all_to_all_single(out, inp, recv_sizes, send_sizes, group=self.group)
        got: dict[Chunk, memoryview] = {}
        view, pos = memoryview(out.numpy()), 0
        for src in range(world):
            for chunk in reads.recv.get(src, ()):
                got[chunk] = view[pos:pos + chunk.size]
                pos += chunk.size
        self.received_bytes += pos
        return got

    def _local_places(self, chunks: Sequence[Chunk]) -> dict[Chunk, Span]:
        """Where in the node-local copy each chunk would be (the first place this rank needs it at)."""
        if self._local_copy is None:
            return {}
        wanted = set(chunks)
        places: dict[Chunk, Span] = {}
        for span in sorted(self._needs):
            if span.chunk in wanted:
                places.setdefault(span.chunk, span)
        return places

    def _from_local(self, chunk: Chunk, span: Span | None) -> bytes | None:
        if span is None or self._local_copy is None:
            return None
        path = self._local_copy / span.name
        try:
            if path.stat().st_size != self._entries[span.name]["bytes"]:
                return None
            with open(path, "rb") as f:
                f.seek(span.start)
                data = f.read(chunk.size)
        except OSError:
            return None
        return data if chunk_intact(data, chunk.sha, chunk.size) else None

    def _what(self, chunk: Chunk) -> str:
        return self._names.get(chunk, "checkpoint")


def read_metadata_once(store: ObjectStore, job_prefix: str, files: Sequence[Mapping[str, Any]], *, group: Any,
                       is_reader: bool, name: str = ".metadata") -> bytes:
    """The checkpoint's DCP `.metadata` bytes, read and verified by one rank and broadcast to the gang (a corrupt or
    missing one raises RestoreReadError on every rank)."""
    result: tuple[bytes | None, list[str], str] = (None, [], "")
    if is_reader:
        entry = next((f for f in files if f["name"] == name), None)
        try:
            if entry is None:
                raise ChunkError(f"{name}: not in the manifest")
            result = (b"".join(read_chunk(store, job_prefix, s.chunk.sha, s.chunk.size, s.chunk.codec, what=name)
                               for s in file_spans(entry)), [], "")
        except ChunkError as exc:
            result = (None, [str(exc)], "")
        except Exception as exc:  # the store failed, not the checkpoint
            result = (None, [], f"{name}: {type(exc).__name__}: {exc}")
    if group is not None:
        box = [result]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        result = box[0]
    data, problems, error = result
    if problems:
        raise RestoreReadError(f"checkpoint is corrupt: {problems[0]}", problems)
    if data is None:
        raise RestoreReadError(f"reading the checkpoint failed: {error}", [])
    return data
