"""A rank's commands from the control plane, and the notices it reports back.

Commands come down the channel (trainforge/contract/channel.py): the node's sidecar hands each one to every rank
of the node over its socket, where `RankClient.poll_commands()` returns them. Several parts of a rank want
different kinds (the profiler `profile_window`, the notice watch the termination notices), so one `CommandInbox`
per process polls the client and keeps each wanted kind for whoever takes it; kinds nobody wants are dropped (the
sidecar already acts on them: signals, kills).

`NoticeWatch` publishes the typed `Notice` when the rank got a preemption or resize notice (the command; the
sidecar also turns it into the SIGTERM the HealthMonitor answers with an emergency checkpoint) or a SIGTERM
without one (a node's own termination notice, e.g. a spot reclaim).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

from trainforge.contract.events import Notice, Sender, dump_event
from trainforge.events import rank_client

logger = logging.getLogger(__name__)

WANTED = ("profile_window", "preemption_notice", "resize_notice", "stop")
"""The command kinds a rank acts on itself (the rest are the sidecar's: it signals the ranks)."""
KEEP = 16
"""Per kind, the most commands kept for a taker that is slow to come (a window asked for many times)."""


class CommandInbox:
    """This process's commands, by kind (thread-safe: the loop and the notice watch both take from it)."""

    def __init__(self, client: Any):
        self.client = client
        self._lock = threading.Lock()
        self._kept: dict[str, collections.deque[dict[str, Any]]] = {k: collections.deque(maxlen=KEEP)
                                                                    for k in WANTED}
        self._seen: set[int] = set()  # seqs already kept: a replayed command is not acted on twice

    def take(self, *kinds: str) -> list[dict[str, Any]]:
        """The commands of these kinds received since the last take, oldest first (never blocks)."""
        with self._lock:
            for cmd in self.client.poll_commands():
                kind, seq = cmd.get("kind"), cmd.get("seq")
                if kind not in self._kept or (isinstance(seq, int) and seq >= 0 and seq in self._seen):
                    continue
                if isinstance(seq, int) and seq >= 0:
                    self._seen.add(seq)
                self._kept[kind].append(cmd)
            out = [c for k in kinds for c in self._kept.get(k, ())]
            for k in kinds:
                if k in self._kept:
                    self._kept[k].clear()
        return sorted(out, key=lambda c: c.get("seq", -1))


_INBOX: CommandInbox | None = None
_INBOX_LOCK = threading.Lock()


def rank_inbox() -> CommandInbox | None:
    """This process's inbox, or None when the worker has no node publisher (a trainer driven directly)."""
    global _INBOX
    client = rank_client()
    if client is None:
        return None
    with _INBOX_LOCK:
        if _INBOX is None or _INBOX.client is not client:
            _INBOX = CommandInbox(client)
        return _INBOX


def notice_of(cmd: dict[str, Any]) -> Notice | None:
    """The `Notice` a rank reports for a notice command (None for any other command)."""
    args = cmd.get("args") or {}
    if cmd.get("kind") == "preemption_notice":
        deadline = args.get("deadline_s")
        return Notice(notice="preemption", message="the control plane preempts the job: emergency checkpoint at "
                      "the next step boundary, then the segment ends",
                      deadline=float(deadline) if isinstance(deadline, int | float) else None)
    if cmd.get("kind") == "resize_notice":
        workers = args.get("workers")
        return Notice(notice="resize", message=f"the allocation changes to {workers} workers: emergency checkpoint "
                      "at the next step boundary, then the gang is re-provisioned",
                      target_workers=int(workers) if isinstance(workers, int) else None)
    return None


class NoticeWatch:
    """A daemon thread that reports the notices this rank received as `Notice` events: the command notices from
    rank 0 (one event per notice for the gang: every rank gets the same command), a bare SIGTERM (no notice
    command came with it within `explain_s`) from each rank that got it (a signal reaches the ranks it was sent
    to, a node's termination notice all of the node's, a fault drill one)."""

    def __init__(self, inbox: CommandInbox, monitor: Any, *, rank: int, src: Sender, interval_s: float = 0.25,
                 explain_s: float = 1.0):
        self.inbox, self.monitor, self.rank, self.src = inbox, monitor, rank, src
        self.interval_s, self.explain_s = interval_s, explain_s
        self._explained = False
        self._sigterm_at: float | None = None
        self._stop = threading.Event()
        self.sent: list[Notice] = []
        self._thread = threading.Thread(target=self._run, name="notice-watch", daemon=True)

    def start(self) -> NoticeWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def check(self, now: float | None = None) -> None:
        """One pass (the thread's body; tests call it directly)."""
        now = time.monotonic() if now is None else now
        for cmd in self.inbox.take("preemption_notice", "resize_notice", "stop"):
            self._explained = True  # the control plane's own notice: the SIGTERM that comes with it is no news
            notice = notice_of(cmd)
            if notice is not None and self.rank == 0:
                self._publish(notice)
        if getattr(self.monitor, "stop_requested", False) and not self._explained:
            if self._sigterm_at is None:
                self._sigterm_at = now
            elif now - self._sigterm_at >= self.explain_s:
                self._explained = True
                self._publish(Notice(notice="termination", message=f"rank {self.rank} got SIGTERM without a "
                                     "notice from the control plane (the node's own termination notice, e.g. a "
                                     "spot reclaim): emergency checkpoint at the next step boundary"))

    def _publish(self, notice: Notice) -> None:
        self.sent.append(notice)
        logger.warning("rank %d: %s notice: %s", self.rank, notice.notice, notice.message)
        try:
            self.inbox.client.publish(dump_event(notice.model_copy(update={"src": self.src})))
        except Exception as e:  # the report must never stop the emergency checkpoint
            logger.warning("could not report the notice: %s: %s", type(e).__name__, e)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.check()
