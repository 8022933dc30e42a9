"""In-memory checkpoint replicas: each rank keeps its newest shard in host memory and a copy on a peer.

Host memory here is the node's shared memory (`/dev/shm`), which outlives the worker processes: when torchrun
restarts the workers of a segment (`--max-restarts`), the new processes find the shards there and restore without
touching object storage. Each rank also sends its shard to a peer — the same local rank on the next node (ring by
node; on a single node, the next rank) — so that a replaced node's shards are fetched from its peers over the
checkpointer's gloo group. Object storage stays the source of truth for committed checkpoints: a segment retry (a
fresh gang) clears the replicas and resumes from the last committed checkpoint.

A shard is kept as its files (`holder-H/rank-S/step-N/<file>`), so that saving copies them with the kernel
(`copyfile`) and restoring maps them (`torch.from_file`, no copy until read) and hands the bytes straight to the
DCP reader (`memory_fs.SafeMemoryReader`): no staging folder, no pickled or packed payload in Python memory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

_STEP_DIR = re.compile(r"^step-(\d+)$")


def replica_root(job_prefix: str) -> Path:
    base = os.environ.get("TRAINFORGE_REPLICA_DIR") or ("/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir())
    return Path(base) / "trainforge-replica" / job_prefix.replace("/", "_")


def map_file(path: Path) -> torch.Tensor:
    """The file's bytes as a uint8 tensor backed by a private mapping: pages are read on first touch (from memory
    for /dev/shm) and writes, which nothing here does, would not reach the file."""
    size = path.stat().st_size
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)


def read_file(path: Path) -> torch.Tensor:
    """The file's bytes in a fresh uint8 tensor (one copy; `readinto` runs without the GIL)."""
    size = path.stat().st_size
    out = torch.empty(size, dtype=torch.uint8)
    if size:
        with path.open("rb") as f:
            view = memoryview(out.numpy())
            got = 0
            while got < size:
                n = f.readinto(view[got:])
                if not n:
                    raise OSError(f"{path}: file shrank while being read ({got} of {size} bytes)")
                got += n
    return out


def _encode(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


class MemoryReplica:
    def __init__(self, root: Path, rank: int, world_size: int, local_world_size: int, group: Any):
        self.root = root
        self.rank, self.world, self.group = rank, world_size, group
        nodes = max(1, world_size // max(1, local_world_size))
        self.stride = local_world_size if nodes > 1 else 1
        self.peer = (rank + self.stride) % world_size
        self.source = (rank - self.stride) % world_size

    def _shard_dir(self, shard: int) -> Path:
        """Where this rank keeps a shard: per holder, so a node's own and peer copies never share a path."""
        return self.root / f"holder-{self.rank:05d}" / f"rank-{shard:05d}"

    def clear(self) -> None:
        """Drop this attempt's replicas, and the job's and the base folder when nothing else is left in them: a
        finished job leaves nothing in /dev/shm (the memory is the node's, not the job's)."""
        shutil.rmtree(self.root, ignore_errors=True)
        for folder in (self.root.parent, self.root.parent.parent):
            try:
                folder.rmdir()  # only when empty: another attempt or job keeps it
            except OSError:
                break

    # ---- save: own copy + ring exchange (collective over the group) ----------------------------------

    def put(self, step: int, folder: Path, names: list[str]) -> None:
        """Keep this rank's files of `step` (in `folder`) in memory, and a copy of them on the peer; receive and keep
        the source rank's. Every rank of the group calls it for the same step."""
        tmp = self._tmp(self._shard_dir(self.rank), step)
        for name in names:  # names are relative paths (an engine's own checkpoint may use subfolders)
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(folder / name, tmp / name)  # kernel copy (sendfile / copy_file_range)
        self._publish(self._shard_dir(self.rank), step, tmp)
        if self.world > 1:
            self._exchange(step, folder, names)

    def _exchange(self, step: int, folder: Path, names: list[str]) -> None:
        """Send my files to the peer and receive the source's: sizes, then the file list, then one message per file
        (tagged by index, so the pairing never depends on message order)."""
        header_out = _encode([[n, (folder / n).stat().st_size] for n in names])
        len_out = torch.tensor([header_out.numel()], dtype=torch.int64)
        len_in = torch.zeros(1, dtype=torch.int64)
        self._wait([dist.isend(len_out, self.peer, group=self.group, tag=0),
                    dist.irecv(len_in, self.source, group=self.group, tag=0)])
        header_in = torch.empty(int(len_in.item()), dtype=torch.uint8)
        self._wait([dist.isend(header_out, self.peer, group=self.group, tag=1),
                    dist.irecv(header_in, self.source, group=self.group, tag=1)])
        incoming = json.loads(header_in.numpy().tobytes())
        sends = [read_file(folder / n) for n in names]
        recvs = [torch.empty(size, dtype=torch.uint8) for _, size in incoming]
        works = [dist.isend(t, self.peer, group=self.group, tag=2 + i) for i, t in enumerate(sends) if t.numel()]
        works += [dist.irecv(t, self.source, group=self.group, tag=2 + i) for i, t in enumerate(recvs) if t.numel()]
        self._wait(works)
        tmp = self._tmp(self._shard_dir(self.source), step)
        for (name, _), data in zip(incoming, recvs, strict=True):
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            with (tmp / name).open("wb") as f:
                f.write(memoryview(data.numpy()))
        self._publish(self._shard_dir(self.source), step, tmp)

    @staticmethod
    def _wait(works: list[Any]) -> None:
        for w in works:
            w.wait()

    def _tmp(self, shard_dir: Path, step: int) -> Path:
        tmp = shard_dir / f".tmp-{step:010d}-{self.rank}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        return tmp

    @staticmethod
    def _publish(shard_dir: Path, step: int, tmp: Path) -> None:
        target = shard_dir / f"step-{step:010d}"
        (tmp / ".complete").touch()
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)  # complete or absent
        for old in shard_dir.iterdir():
            m = _STEP_DIR.match(old.name)
            if m and int(m.group(1)) < step:
                shutil.rmtree(old, ignore_errors=True)

    # ---- restore (collective) -----------------------------------------------------------------------

    def inventory(self) -> dict[int, list[int]]:
        """Shard rank -> steps held in this node's memory for the ranks this rank answers for (itself and the
        rank it is the peer of)."""
        held: dict[int, list[int]] = {}
        for shard in {self.rank, self.source}:
            d = self._shard_dir(shard)
            if d.is_dir():
                held[shard] = sorted(int(m.group(1)) for p in d.iterdir() if (m := _STEP_DIR.match(p.name))
                                     and (p / ".complete").is_file())
        return held

    def newest_complete(self) -> tuple[int | None, dict[int, int]]:
        """The newest step whose every shard some rank holds, and for each shard the rank that sends it."""
        mine = self.inventory()
        gathered: list[Any] = [None] * self.world
        if self.world > 1:
            dist.all_gather_object(gathered, mine, group=self.group)
        else:
            gathered = [mine]
        holders: dict[int, dict[int, int]] = {}  # step -> shard -> holder rank
        for holder, inv in enumerate(gathered):
            for shard, steps in inv.items():
                for step in steps:
                    current = holders.setdefault(step, {}).get(shard)
                    if current is None or holder == shard:  # prefer the shard's own copy
                        holders[step][shard] = holder
        complete = [s for s, h in holders.items() if len(h) == self.world]
        if not complete:
            return None, {}
        step = max(complete)
        return step, holders[step]

    def fetch_all(self, step: int, holders: dict[int, int]) -> dict[str, torch.Tensor]:
        """Every shard's files of `step` on every rank (DCP may read any shard after resharding, or a replicated
        tensor another rank wrote), as name -> uint8 tensor: mapped from this node's memory where this rank holds
        the shard, else received from its holder."""
        files: dict[str, torch.Tensor] = {}
        for shard in range(self.world):
            holder = holders[shard]
            mine: dict[str, torch.Tensor] = {}
            if holder == self.rank:
                d = self._shard_dir(shard) / f"step-{step:010d}"
                mine = {p.relative_to(d).as_posix(): map_file(p) for p in sorted(d.rglob("*"))
                        if p.is_file() and p.name != ".complete"}
            if self.world > 1:
                box = [[(n, t.numel()) for n, t in mine.items()]]
                dist.broadcast_object_list(box, src=holder, group=self.group)
                for name, size in box[0]:
                    buf = mine[name] if holder == self.rank else torch.empty(size, dtype=torch.uint8)
                    if size:
                        dist.broadcast(buf, holder, group=self.group)
                    mine[name] = buf
            files.update(mine)
        return files
