"""A segment attempt's channel on a local-folder store, for tests that drive the supervisor.

Real parts only: the `LocalObjectStore`, the `NodePublisher` of each node (its own thread, as in the sidecar), the
`ChannelReader` and `CommandWriter` the supervisor is given, and a `CommandReader` to see what went down. A test
sets a rank's beat on its node's publisher (`beat`), and `deliver` waits until the supervisor has read it through
the channel, so the beats a test hands the supervisor's checks are the ones the channel delivered.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from trainforge.contract.channel import (
    ChannelReader,
    Command,
    CommandReader,
    CommandWriter,
    NodePublisher,
    channel_root,
)
from trainforge.contract.events import Heartbeat, dump_event
from trainforge.infra.storage import LocalObjectStore
from trainforge.registry.jobs import JobRecord
from trainforge.tasks.supervisor import RankBeat, SegmentSupervisor
from trainforge.trainer.health import HealthPolicy

FLUSH_S = 0.05


class LocalChannel:
    def __init__(self, folder: Path, nodes: Iterable[str] = ("node-0",), *, publishing: Iterable[str] | None = None,
                 lost_after_s: float = 3.0, flush_interval_s: float = FLUSH_S, socket: str | None = None,
                 lease_ttl_s: float = 30.0):
        """`nodes`: the nodes the control plane launched (the reader's); `publishing`: those with a running
        publisher (default: all of them; a launched node without one never publishes and is lost); `socket`: the
        first node's rank socket (for worker processes: their $TRAINFORGE_CHANNEL_SOCKET)."""
        nodes = list(nodes)
        self.store = LocalObjectStore(folder)
        self.root = f"{channel_root('teams/t/jobs/j')}/segment-0"
        self.reader = ChannelReader(self.store, self.root, nodes=nodes, lost_after_s=lost_after_s,
                                    flush_interval_s=flush_interval_s)
        self.commands = CommandWriter(self.store, self.root)
        self.socket = socket
        self.publishers = {n: NodePublisher(self.store, self.root, n, flush_interval_s=flush_interval_s,
                                            lease_ttl_s=lease_ttl_s, socket_path=socket if n == nodes[0] else None
                                            ).start()
                           for n in (nodes if publishing is None else publishing)}
        self._down = {n: CommandReader(self.store, self.root, n) for n in nodes}  # what each node would receive
        self._sent: dict[str, list[Command]] = {n: [] for n in nodes}

    def supervisor(self, record: JobRecord, attempt: int = 0, policy: HealthPolicy | None = None,
                   **kw: Any) -> SegmentSupervisor:
        return SegmentSupervisor(record, attempt, policy or HealthPolicy(), channel=self.reader,
                                 commands=self.commands, **kw)

    def beat(self, rank: int, node: str = "node-0", **fields: Any) -> Heartbeat:
        """A rank's heartbeat (typed, as the worker's monitor sends it) handed to its node's publisher; extra
        envelope fields (`alive=False`: the sidecar's finding) go as `node_side`."""
        node_side = fields.pop("node_side", {})
        # A rank at step N has done N steps of this (re)start unless told otherwise (it began at step 0); a rank
        # with none done is warming up, which the supervisor judges by the start-up budget instead.
        fields.setdefault("steps_done", fields.get("step", 0))
        beat = Heartbeat(rank=rank, pid=fields.pop("pid", 1000 + rank), **{"phase": "training", **fields})
        self.publishers[node].heartbeat(rank, **dump_event(beat), **node_side)
        return beat

    def deliver(self, sup: SegmentSupervisor, *beats: Heartbeat, timeout_s: float = 10.0) -> dict[int, RankBeat]:
        """Read the channel as the supervisor does until it holds exactly these beats (one per rank)."""
        return self.read_until(sup, lambda got: all(b.rank in got and got[b.rank].beat == b for b in beats),
                               timeout_s)

    def read_until(self, sup: SegmentSupervisor, cond: Callable[[dict[int, RankBeat]], bool],
                   timeout_s: float = 10.0) -> dict[int, RankBeat]:
        """Read the channel as the supervisor does until its beats satisfy `cond`."""
        deadline = time.monotonic() + timeout_s
        while not cond(got := sup._read_beats()):
            assert time.monotonic() < deadline, f"the channel did not deliver the beats in {timeout_s}s: {got}"
            time.sleep(FLUSH_S / 2)
        return got

    def sent(self, node: str = "node-0") -> list[Command]:
        """Every command for `node` written down so far (read as its publisher reads them), except the leases."""
        self._sent[node] += [c for c in self._down[node].poll() if c.kind != "lease"]
        return list(self._sent[node])

    def kill(self, node: str) -> None:
        """The node's publisher dies as with its node (SIGKILL): its threads stop, no closing batch is written."""
        pub = self.publishers.pop(node)
        pub._stop.set()
        pub._wake.set()
        for thread in pub._threads:
            thread.join(timeout=10)

    def close(self) -> None:
        for pub in self.publishers.values():
            pub.close()
        self.reader.close()
