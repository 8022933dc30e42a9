"""Events the workers report to the control plane: one JSON object per line in run_dir/events.jsonl.

The flow tails this file to stream metrics to MLflow and to start commit bookkeeping and evaluation of each
checkpoint while training goes on. Only rank 0 writes (plus any rank's failure report in failures/).
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any


class EventWriter:
    def __init__(self, run_dir: str | Path, enabled: bool):
        self.path = Path(run_dir) / "events.jsonl"
        self.enabled = enabled

    def emit(self, kind: str, **fields: Any) -> None:
        if not self.enabled:
            return
        line = json.dumps({"type": kind, "time": time.time(), **fields}, sort_keys=True)
        # One writer, one line per append; flushed per event for live tailing. Only events that change what a
        # resume does are fsynced: a per-step fsync would cost the loop milliseconds for nothing.
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()
            if kind != "metrics":
                os.fsync(f.fileno())


class AsyncEventWriter:
    """Appends events from a background thread so the training step never waits on file I/O: `emit` stamps the
    time and queues; the thread writes and flushes whatever is queued in one append. `close` (also run at exit,
    so a failing worker's last metrics still land) drains the queue. Only for events no resume depends on
    (metrics): those keep the synchronous, fsynced EventWriter."""

    def __init__(self, writer: EventWriter):
        self.writer = writer
        self.enabled = writer.enabled
        self._queue: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name="event-writer", daemon=True)
            self._thread.start()
            atexit.register(self.close)

    def emit(self, kind: str, **fields: Any) -> None:
        if self.enabled:
            self._queue.put({"type": kind, "time": time.time(), **fields})

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            batch = [item]
            while True:  # take everything already queued: one open/append per burst
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            lines = [json.dumps(e, sort_keys=True) for e in batch if e is not None]
            if lines:
                with open(self.writer.path, "a", encoding="utf-8") as f:
                    f.write("\n".join(lines) + "\n")
            if any(e is None for e in batch):
                return

    def close(self, timeout_s: float = 10.0) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout_s)
        self._thread = None


def read_events(path: str | Path, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """Complete lines from byte `offset` on, and the offset after the last complete line."""
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


def last_event(path: str | Path, kind: str) -> dict[str, Any] | None:
    events, _ = read_events(path)
    for event in reversed(events):
        if event.get("type") == kind:
            return event
    return None
