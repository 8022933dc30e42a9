"""Where a segment's events go and how they are read back.

Senders build typed events (trainforge/contract/events.py) and hand them to a sink's `publish`; the sink is the one
place that knows the transport. A worker launched by a backend has a node publisher ($TRAINFORGE_CHANNEL_SOCKET,
the node's sidecar): `event_sink` gives it a `ChannelSink`, and its events cross machines through the channel
(trainforge/contract/channel.py). The control plane (tasks/supervisor.py) reads the channel and appends what it
receives to the job's own events.jsonl, its journal: that file is written by the control plane only, and every
reader (the flow's event pump, report, observe, chaos measurements, cost) reads it as before. A trainer driven
without a publisher (tests, `trainforge.offline`) writes run_dir/events.jsonl itself (`EventWriter`).
Only rank 0 sends the segment's events (plus the supervisor's fault and recovery records).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import socket
import threading
from pathlib import Path
from typing import Any, Protocol, TypeVar

from trainforge.contract.events import EventError, Metrics, SegmentEvent, Sender, dump_event, parse_event

logger = logging.getLogger(__name__)

E = TypeVar("E")


class EventSink(Protocol):
    """Anything a sender publishes typed events to (the events file today, the node publisher of the channel)."""

    def publish(self, event: SegmentEvent) -> None: ...


def worker_sender(job: str | None, rank: int | None) -> Sender:
    """The identity a worker process stamps on what it sends: its job, segment attempt, rank, host and node
    (the launcher's environment: TRAINFORGE_SEGMENT_ATTEMPT, torchrun's GROUP_RANK)."""
    attempt = os.environ.get("TRAINFORGE_SEGMENT_ATTEMPT")
    node = os.environ.get("GROUP_RANK")
    return Sender(job=job, attempt=int(attempt) if attempt and attempt.isdigit() else None, rank=rank,
                  host=socket.gethostname(), node=int(node) if node and node.isdigit() else None)


_CLIENT: Any = None


def rank_client(rank: int | None = None) -> Any:
    """This process's end of its node publisher's socket (a `RankClient`), or None when the worker has none.
    One per process: the monitor's heartbeats, the events and the failure report share it."""
    global _CLIENT
    path = os.environ.get("TRAINFORGE_CHANNEL_SOCKET")
    if not path:
        return None
    if _CLIENT is None:
        from trainforge.contract.channel import RankClient

        if rank is None:
            rank = int(os.environ.get("RANK", "0"))
        _CLIENT = RankClient(path, rank)
        atexit.register(_CLIENT.drain)
    return _CLIENT


class ChannelSink:
    """The worker's sink when its node has a publisher: each event is one datagram to the node's sidecar (never
    blocks; the sidecar batches the node's ranks into the job's channel)."""

    nonblocking = True

    def __init__(self, client: Any, enabled: bool, src: Sender | None = None):
        self.client, self.enabled, self.src = client, enabled, src

    def publish(self, event: SegmentEvent) -> None:
        if self.enabled:
            self.client.publish(dump_event(_stamp(event, self.src)))

    def drain(self, timeout_s: float = 2.0) -> None:
        self.client.drain(timeout_s)


def event_sink(run_dir: str | Path, enabled: bool, src: Sender | None = None) -> EventWriter | ChannelSink:
    """The worker's event sink: the node publisher's channel when it has one, else run_dir/events.jsonl."""
    client = rank_client(src.rank if src is not None else None)
    if client is not None:
        return ChannelSink(client, enabled, src)
    return EventWriter(run_dir, enabled, src)


def _stamp(event: SegmentEvent, src: Sender | None) -> SegmentEvent:
    return event if src is None or event.src is not None else event.model_copy(update={"src": src})


class EventWriter:
    """The events.jsonl sink: one line per event, appended and flushed per event for live tailing."""

    def __init__(self, run_dir: str | Path, enabled: bool, src: Sender | None = None):
        self.path = Path(run_dir) / "events.jsonl"
        self.enabled = enabled
        self.src = src

    def publish(self, event: SegmentEvent) -> None:
        if not self.enabled:
            return
        line = json.dumps(dump_event(_stamp(event, self.src)), sort_keys=True)
        # One writer, one line per append. Only events that change what a resume does are fsynced: a per-step
        # fsync would cost the loop milliseconds for nothing.
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            if not isinstance(event, Metrics):
                os.fsync(f.fileno())


class AsyncEventWriter:
    """Publishes from a background thread so the training step never waits on file I/O: `publish` queues the
    event (stamped with its time when it was made); the thread writes and flushes whatever is queued in one
    append. `close` (also run at exit, so a failing worker's last metrics still land) drains the queue. Only for
    events no resume depends on (metrics, telemetry): those keep the synchronous, fsynced EventWriter."""

    def __init__(self, writer: EventWriter | ChannelSink):
        self.writer = writer
        self.enabled = writer.enabled
        self._queue: queue.SimpleQueue[SegmentEvent | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        # A channel sink never blocks the step (one datagram): no thread needed.
        self._direct = isinstance(writer, ChannelSink)
        if self.enabled and not self._direct:
            self._thread = threading.Thread(target=self._run, name="event-writer", daemon=True)
            self._thread.start()
            atexit.register(self.close)

    def publish(self, event: SegmentEvent) -> None:
        if self._direct:
            self.writer.publish(event)
        elif self.enabled:
            self._queue.put(event)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            batch = [item]
            while True:  # take everything already queued: one open/append per burst
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            assert isinstance(self.writer, EventWriter)
            lines = [json.dumps(dump_event(_stamp(e, self.writer.src)), sort_keys=True)
                     for e in batch if e is not None]
            if lines:
                with open(self.writer.path, "a", encoding="utf-8") as f:
                    f.write("\n".join(lines) + "\n")
            if any(e is None for e in batch):
                return

    def close(self, timeout_s: float = 10.0) -> None:
        if isinstance(self.writer, ChannelSink):
            self.writer.drain(min(timeout_s, 2.0))
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout_s)
        self._thread = None


def append_records(path: str | Path, records: list[dict[str, Any]]) -> None:
    """The control plane's journal: append already-encoded events (from the channel) in one write; fsynced when
    one of them changes what a resume does (anything but metrics), as EventWriter does."""
    if not records:
        return
    lines = [json.dumps(r, sort_keys=True) for r in records]
    with open(path, "a", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
        f.flush()
        if any(r.get("type") not in ("metrics", "rank_metrics", "system") for r in records):
            os.fsync(f.fileno())


def read_events(path: str | Path, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """Complete lines from byte `offset` on (as JSON objects), and the offset after the last complete line."""
    p = Path(path)
    if not p.is_file():
        return [], offset
    with open(p, "rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n")
    if end < 0:
        return [], offset
    events = [json.loads(line) for line in data[: end + 1].splitlines() if line.strip()]
    return events, offset + end + 1


def _type_of(cls: type) -> str:
    return cls.model_fields["type"].default  # type: ignore[attr-defined, no-any-return]


def read_typed_events(path: str | Path, offset: int = 0, only: tuple[type, ...] = ()
                      ) -> tuple[list[SegmentEvent], int, list[str]]:
    """Like read_events, typed: (events, next offset, problems). A line that is not a valid event (or comes from
    a newer schema) is left out and described in `problems` (with its file and byte offset) for the reader to log:
    one bad line must not stop the flow from reading the commits after it. `only`: parse just these event
    classes (a reader that needs the commits of a long job does not validate its 100,000 metrics lines)."""
    raw, end = read_events(path, offset)
    wanted = {_type_of(cls) for cls in only}
    events, problems = [], []
    for i, data in enumerate(raw):
        if wanted and data.get("type") not in wanted:
            continue
        try:
            events.append(parse_event(data))
        except EventError as exc:
            problems.append(f"{path} (event {i + 1} after byte {offset}): {exc}")
    return events, end, problems


def typed(events: list[dict[str, Any]]) -> list[SegmentEvent]:
    """Parse already-read event objects, leaving out (and logging) the ones that are not valid events."""
    out = []
    for data in events:
        try:
            out.append(parse_event(data))
        except EventError as exc:
            logger.warning("ignoring an event: %s", exc)
    return out


def last_event(path: str | Path, kind: str) -> dict[str, Any] | None:
    events, _ = read_events(path)
    for event in reversed(events):
        if event.get("type") == kind:
            return event
    return None


def last_of(path: str | Path, cls: type[E]) -> E | None:
    """The newest valid event of class `cls` in the stream (typed counterpart of last_event)."""
    events, _, _ = read_typed_events(path, only=(cls,))
    for event in reversed(events):
        if isinstance(event, cls):
            return event
    return None
