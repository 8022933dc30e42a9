"""Events the workers report to the control plane: one JSON object per line in run_dir/events.jsonl.

The flow tails this file to stream metrics to MLflow and to start commit bookkeeping and evaluation of each
checkpoint while training goes on. Only rank 0 writes (plus any rank's failure report in failures/).
"""

from __future__ import annotations

import json
import os
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
