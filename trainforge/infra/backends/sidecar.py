"""The node sidecar: one per node, started by the backend beside the node's torchrun agent.

It runs the node's `NodePublisher` (trainforge/contract/channel.py): the node's ranks send their events,
heartbeats and failure reports to it over its Unix datagram socket ($TRAINFORGE_CHANNEL_SOCKET), and it batches
them into the job's channel in the object store. It outlives a rank's restart (torchrun restarts workers, not the
sidecar), so nothing a rank sent before it died is lost with it.

It also watches its own node's rank processes (a node-local check: the control plane needs no pid): a rank whose
process is gone without a last heartbeat ("done"/"failed") is reported at once, with `alive: false` in its
heartbeat and an immediate flush, so kill -9 detection stays well under a second plus one read of the channel.

Commands down are delivered to the node's ranks here, as local signals: `preemption_notice` / `resize_notice` /
`stop` -> SIGTERM (the ranks' HealthMonitor turns it into a checkpoint at the next step boundary),
`dump_stacks` -> SIGUSR1 (faulthandler), `kill_rank` -> SIGKILL of one rank (an unresponsive or hung one). A node
whose lease lapsed (no renewal from the control plane) stops its ranks: SIGTERM, then SIGKILL. The publisher
hands every command to the ranks too (their `RankClient.poll_commands()`): `profile_window` is read there, and
replayed here to a rank that reached the publisher after it came (started or restarted later).

Stack dumps come back the same way: each rank's faulthandler writes into a file on its own node, in the folder
named after this sidecar's socket (trainer/health.py `node_stacks_dir`); after the SIGUSR1 the sidecar reads what
the dump added and publishes it as a `StackDump` record (trainforge/contract/events.py), so the control plane
reads no worker's disk.

Run: python -m trainforge.infra.backends.sidecar --store URL --root ROOT --node NAME --socket @NAME
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from trainforge.contract.channel import FLUSH_INTERVAL_S, LEASE_TTL_S, Command, NodePublisher
from trainforge.contract.events import Sender, StackDump, dump_event
from trainforge.infra.procs import pid_alive
from trainforge.trainer.health import SOCKET_ENV, node_stacks_dir, stacks_file_name

log = logging.getLogger(__name__)

__all__ = ["SOCKET_ENV", "NodeSidecar", "main"]
WATCH_INTERVAL_S = 0.1
FINISHED = ("done", "failed", "terminated")
DUMP_WAIT_S = 3.0
"""How long the sidecar waits for a rank's faulthandler file to grow after SIGUSR1 (a rank that does not answer
in that time is reported with an empty dump: its process is not running Python, e.g. stopped)."""
DUMP_SETTLE_S = 0.15
"""A dump is complete once its file stopped growing for this long (faulthandler writes it in one go)."""
MAX_DUMP_BYTES = 64 * 1024
"""The most of one rank's dump sent up (its head: every thread's innermost frames come first)."""


LEASE_MARKER_ENV = "TRAINFORGE_LEASE_MARKER"
"""The file the sidecar writes when its publisher's lease lapsed (the one stopping rule, contract/channel.py
NodePublisher: no renewal from the control plane for the lease's TTL). Whoever started the node's torchrun agent
(the node agent, infra/backends/node_agent.py) watches it and stops the node: torchrun would otherwise restart the
ranks the lapse stopped."""


class NodeSidecar:
    """The publisher plus the node-local watch of its ranks and the delivery of commands to them."""

    def __init__(self, publisher: NodePublisher, *, watch_interval_s: float = WATCH_INTERVAL_S,
                 dump_wait_s: float = DUMP_WAIT_S):
        self.publisher = publisher
        self.watch_interval_s, self.dump_wait_s = watch_interval_s, dump_wait_s
        self.stopping = threading.Event()
        self._reported: set[tuple[str, int]] = set()  # (rank, pid) already reported dead
        # The newest profile window, replayed to a rank that reaches the publisher after it was delivered (a
        # window asked for while the gang starts up, or before torchrun restarted a rank), and who has it.
        self._window: Command | None = None
        self._window_given: set[tuple[str, int]] = set()
        # The node's ranks write their faulthandler dumps here (created before they start, removed at the end).
        self.stacks_dir = node_stacks_dir(publisher.socket_path) if publisher.socket_path else None
        if self.stacks_dir is not None:
            self.stacks_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        publisher.on_command(self._on_command)

    def _pids(self) -> dict[str, int]:
        out = {}
        for rank, info in self.publisher.beats().items():
            with contextlib.suppress(KeyError, TypeError, ValueError):
                out[rank] = int(info["pid"])
        return out

    def _signal_ranks(self, sig: int, rank: Any = None) -> None:
        for r, pid in self._pids().items():
            if rank is None or str(rank) == r:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)

    def _on_command(self, cmd: Command) -> None:
        if cmd.kind in ("preemption_notice", "resize_notice", "stop"):
            self._signal_ranks(signal.SIGTERM)
        elif cmd.kind == "dump_stacks":
            self.dump_stacks(cmd.seq, cmd.args.get("rank"))
        elif cmd.kind == "profile_window":
            # The publisher hands it to every rank it knows right after this handler; the others get it later.
            self._window, self._window_given = cmd, set(self._pids().items())
        elif cmd.kind == "kill_rank":
            self._signal_ranks(signal.SIGKILL, cmd.args["rank"])
        elif cmd.kind == "lease_expired":
            log.warning("sidecar %s: the control plane's lease lapsed: stopping this node's ranks",
                        self.publisher.node)
            if marker := os.environ.get(LEASE_MARKER_ENV):  # the node agent stops the node's torchrun on it
                with contextlib.suppress(OSError):
                    Path(marker).write_text(f"{time.time():.3f}\n")
            self._signal_ranks(signal.SIGTERM)
            timer = threading.Timer(5.0, self._signal_ranks, (signal.SIGKILL,))
            timer.daemon = True
            timer.start()

    def dump_stacks(self, cmd_seq: int, rank: Any = None) -> threading.Thread:
        """SIGUSR1 to the rank (all of the node's ranks when None); a thread then waits for each dump to land in
        its faulthandler file and publishes it (the publisher's own thread, which called this, must not wait:
        it carries the node's heartbeats)."""
        targets = {}
        for r, info in self.publisher.beats().items():
            if not r.isdigit() or (rank is not None and str(rank) != r):
                continue
            if info.get("phase") in FINISHED or info.get("alive") is False:
                continue  # no process to answer
            restart = int(info.get("restart") or 0)
            path = self.stacks_dir / stacks_file_name(int(r), restart) if self.stacks_dir else None
            targets[r] = (path, _size(path), restart)
        self._signal_ranks(signal.SIGUSR1, rank)
        thread = threading.Thread(target=self._collect_dumps, args=(cmd_seq, targets), daemon=True,
                                  name=f"stack-dump-{cmd_seq}")
        thread.start()
        return thread

    def _collect_dumps(self, cmd_seq: int, targets: dict[str, tuple[Path | None, int, int]]) -> None:
        deadline = time.monotonic() + self.dump_wait_s
        last = {r: start for r, (_, start, _) in targets.items()}
        changed_at = dict.fromkeys(targets, time.monotonic())
        while time.monotonic() < deadline:
            now, pending = time.monotonic(), False
            for r, (path, start, _) in targets.items():
                size = _size(path)
                if size != last[r]:
                    last[r], changed_at[r] = size, now
                if size <= start or now - changed_at[r] < DUMP_SETTLE_S:
                    pending = True  # nothing yet, or still growing
            if not pending:
                break
            time.sleep(0.03)
        for r, (path, start, restart) in targets.items():
            text, truncated = _read_from(path, start, MAX_DUMP_BYTES)
            event = StackDump(rank=int(r), restart=restart, text=text, truncated=truncated, cmd_seq=cmd_seq,
                              src=Sender(rank=int(r), host=socket.gethostname()))
            self.publisher.publish(dump_event(event))
        self.publisher.wake()

    def replay_window(self) -> None:
        """The profile window to the ranks that reached the publisher since it was delivered."""
        if self._window is None:
            return
        for rank_pid in self._pids().items():
            if rank_pid not in self._window_given and self.publisher.deliver_to(rank_pid[0], self._window):
                self._window_given.add(rank_pid)

    def watch_once(self) -> bool:
        """Mark the ranks whose process is gone; True when one was newly found dead."""
        self.replay_window()
        found = False
        for rank, info in self.publisher.beats().items():
            if info.get("phase") in FINISHED or info.get("alive") is False or "pid" not in info:
                continue
            pid = int(info["pid"])
            if (rank, pid) in self._reported or pid_alive(pid):
                continue
            self._reported.add((rank, pid))
            self.publisher.heartbeat(rank, **{**info, "alive": False, "dead_at": time.time()})
            found = True
        if found:
            self.publisher.wake()
        return found

    def run(self) -> None:
        while not self.stopping.wait(self.watch_interval_s):
            self.watch_once()
        self.watch_once()  # a rank that died just before the stop is reported in the closing batch

    def cleanup(self) -> None:
        """Remove the node's stack-dump folder: every dump anyone asked for went up the channel."""
        if self.stacks_dir is not None:
            shutil.rmtree(self.stacks_dir, ignore_errors=True)


def _size(path: Path | None) -> int:
    try:
        return path.stat().st_size if path is not None else 0
    except OSError:
        return 0


def _read_from(path: Path | None, start: int, limit: int) -> tuple[str, bool]:
    """What the file holds after byte `start` (at most `limit` bytes), and whether it was cut."""
    if path is None:
        return "", False
    try:
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(limit + 1)
    except OSError:
        return "", False
    return data[:limit].decode(errors="replace"), len(data) > limit


def main(argv: list[str] | None = None) -> int:
    from trainforge.infra.storage import open_store

    parser = argparse.ArgumentParser(prog="python -m trainforge.infra.backends.sidecar",
                                     description="A node's channel publisher and rank watch (started by the backend).")
    parser.add_argument("--store", required=True, help="object store URL of the job (a folder, file://, s3://)")
    parser.add_argument("--root", required=True, help="the channel's root key (the segment attempt's channel)")
    parser.add_argument("--node", required=True, help="this node's name (the scheduler's)")
    parser.add_argument("--socket", required=True, help="the Unix datagram socket of the node's ranks")
    parser.add_argument("--flush-interval", type=float, default=FLUSH_INTERVAL_S)
    parser.add_argument("--lease-ttl", type=float, default=LEASE_TTL_S)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s sidecar %(levelname)s %(name)s: %(message)s")
    publisher = NodePublisher(open_store(args.store), args.root, args.node, flush_interval_s=args.flush_interval,
                              lease_ttl_s=args.lease_ttl, socket_path=args.socket, info={"pid": os.getpid()})
    sidecar = NodeSidecar(publisher)
    signal.signal(signal.SIGTERM, lambda *_: sidecar.stopping.set())
    signal.signal(signal.SIGINT, lambda *_: sidecar.stopping.set())
    publisher.start()
    try:
        sidecar.run()
    finally:
        publisher.close(timeout=10.0)  # the closing batch: the reader tells a clean end from a lost node
        sidecar.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
