"""A node agent's measure of which gang peers it reaches: a probe port of its own, and a prober of its peers'.

The agent opens `ProbeListener` before it reports `ready` (its port goes up in that report), so every peer's port
is open before any node is told `go`; the `go` line carries the peers' probe addresses, and `Prober` then connects
to each once per PROBE_INTERVAL_S (all at once, non-blocking, PROBE_TIMEOUT_S each) from the host's own network
stack, the one its ranks' collectives cross. A peer that failed FAILED_ROUNDS rounds in a row is reported
unreachable; the report goes up the agent's own connection to the control plane (its stdout), only when the set
changes. What the control plane makes of the reports is trainforge/plan/reach.py's.

Standard library only: the agent starts with no torch loaded.
"""

from __future__ import annotations

import contextlib
import errno
import selectors
import socket
import threading
import time
from collections.abc import Callable, Mapping

from trainforge.plan.reach import FAILED_ROUNDS, PROBE_INTERVAL_S, PROBE_TIMEOUT_S


class ProbeListener:
    """A TCP port on every address of the host that accepts and closes at once (the peers only connect)."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("", 0))
        self._sock.listen(256)
        self._sock.settimeout(0.5)
        self.port = int(self._sock.getsockname()[1])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="probe-listener", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.close()

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.close()
        self._thread.join(timeout=2)


def parse_peers(text: str) -> dict[str, tuple[str, int]]:
    """`name=address:port,...` (the `go` line's peers) as {name: (address, port)}; a malformed entry is skipped."""
    out: dict[str, tuple[str, int]] = {}
    for entry in filter(None, text.split(",")):
        name, _, where = entry.partition("=")
        address, _, port = where.rpartition(":")
        if name and address and port.isdigit():
            out[name] = (address, int(port))
    return out


def format_peers(peers: Mapping[str, tuple[str, int]]) -> str:
    return ",".join(f"{name}={address}:{port}" for name, (address, port) in peers.items())


def probe_round(peers: Mapping[str, tuple[str, int]], timeout_s: float = PROBE_TIMEOUT_S) -> set[str]:
    """Connect to every peer at once; the names not connected within timeout_s (refused, unreachable, no answer)."""
    failed: set[str] = set()
    sel = selectors.DefaultSelector()
    pending: dict[socket.socket, str] = {}
    try:
        for name, address in peers.items():
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            code = sock.connect_ex(address)
            if code == 0:
                sock.close()
            elif code in (errno.EINPROGRESS, errno.EWOULDBLOCK):
                pending[sock] = name
                sel.register(sock, selectors.EVENT_WRITE)
            else:
                sock.close()
                failed.add(name)
        deadline = time.monotonic() + timeout_s
        while pending and (left := deadline - time.monotonic()) > 0:
            for key, _ in sel.select(timeout=left):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                name = pending.pop(sock)
                sel.unregister(sock)
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0:
                    failed.add(name)
                sock.close()
        failed.update(pending.values())
    finally:
        for sock in pending:
            sock.close()
        sel.close()
    return failed


class Prober:
    """Probes the peers every `interval_s` on a thread; `report(unreachable, failing_s)` when the set of peers that
    failed `rounds` rounds in a row changes (`failing_s`: since each one's first failed probe began)."""

    def __init__(self, peers: Mapping[str, tuple[str, int]],
                 report: Callable[[list[str], dict[str, float]], None], *, interval_s: float = PROBE_INTERVAL_S,
                 timeout_s: float = PROBE_TIMEOUT_S, rounds: int = FAILED_ROUNDS):
        self.peers, self.report = dict(peers), report
        self.interval_s, self.timeout_s, self.rounds = interval_s, timeout_s, rounds
        self.sent = 0
        self._failing: dict[str, tuple[int, float]] = {}  # peer: (failed rounds in a row, when the first began)
        self._reported: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reach-prober", daemon=True)

    def start(self) -> Prober:
        if self.peers:
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            failed = probe_round(self.peers, self.timeout_s)
            self.sent += len(self.peers)
            self._failing = {p: (rounds + 1, first) for p in failed
                             for rounds, first in [self._failing.get(p, (0, began))]}
            now = time.monotonic()
            down = sorted(p for p, (n, _) in self._failing.items() if n >= self.rounds)
            if down != self._reported:
                self._reported = down
                with contextlib.suppress(Exception):  # the agent's stdout gone: its control plane will say so
                    self.report(down, {p: round(now - self._failing[p][1], 3) for p in down})
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - began)))

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.timeout_s + 1)
