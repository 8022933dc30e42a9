"""In-memory checkpoint replicas: each rank keeps its newest shard in host memory and a copy on a peer.

Host memory here is the node's shared memory (`/dev/shm`), which outlives the worker processes: when torchrun
restarts the workers of a segment (`--max-restarts`), the new processes find the shards there and restore without
touching object storage. Each rank also sends its shard to a peer — the same local rank on the next node (ring by
node; on a single node, the next rank) — so that a replaced node's shards are fetched from its peers over the
checkpointer's gloo group. Object storage stays the source of truth for committed checkpoints: a segment retry (a
fresh gang) clears the replicas and resumes from the last committed checkpoint.
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


def pack(files: dict[str, bytes]) -> bytes:
    header = json.dumps([[name, len(data)] for name, data in files.items()]).encode()
    return len(header).to_bytes(8, "little") + header + b"".join(files.values())


def unpack(payload: bytes) -> dict[str, bytes]:
    n = int.from_bytes(payload[:8], "little")
    pos = 8 + n
    out = {}
    for name, size in json.loads(payload[8:pos]):
        out[name] = payload[pos:pos + size]
        pos += size
    return out


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
        shutil.rmtree(self.root, ignore_errors=True)

    # ---- save: own copy + ring exchange (collective over the group) ----------------------------------

    def put(self, step: int, files: dict[str, bytes]) -> None:
        payload = pack(files)
        self._write(self._shard_dir(self.rank), step, payload)
        if self.world > 1:
            received = self._exchange(payload)
            self._write(self._shard_dir(self.source), step, received)

    def _exchange(self, payload: bytes) -> bytes:
        out = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        size_out = torch.tensor([out.numel()], dtype=torch.int64)
        size_in = torch.zeros(1, dtype=torch.int64)
        reqs = [dist.isend(size_out, self.peer, group=self.group), dist.irecv(size_in, self.source, group=self.group)]
        for r in reqs:
            r.wait()
        buf = torch.empty(int(size_in.item()), dtype=torch.uint8)
        reqs = [dist.isend(out, self.peer, group=self.group), dist.irecv(buf, self.source, group=self.group)]
        for r in reqs:
            r.wait()
        return buf.numpy().tobytes()

    def _write(self, shard_dir: Path, step: int, payload: bytes) -> None:
        target = shard_dir / f"step-{step:010d}"
        tmp = shard_dir / f".tmp-{step:010d}-{self.rank}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (tmp / "payload").write_bytes(payload)
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
                                     and (p / "payload").is_file())
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

    def fetch_all(self, step: int, holders: dict[int, int], write: Any) -> None:
        """Every shard of `step` to every rank (DCP may read any shard after resharding or replicated tensors);
        `write(files)` stores one shard's files locally."""
        for shard in range(self.world):
            holder = holders[shard]
            payload = b""
            if holder == self.rank:
                payload = (self._shard_dir(shard) / f"step-{step:010d}" / "payload").read_bytes()
            if self.world > 1:
                size = torch.tensor([len(payload)], dtype=torch.int64)
                dist.broadcast(size, holder, group=self.group)
                buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if holder == self.rank
                       else torch.empty(int(size.item()), dtype=torch.uint8))
                dist.broadcast(buf, holder, group=self.group)
                if holder != self.rank:
                    payload = buf.numpy().tobytes()
            write(unpack(payload))
