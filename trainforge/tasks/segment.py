"""Launching and supervising one training segment on the local backend.

A segment is one launch of the whole gang (torchrun + workers). It ends when training ends, at
`segment_max_steps`, at a failure, or when the run is cancelled. A failure is turned into a `SegmentFailed` that
names the rank, the exception and the last lines of that rank's log, and says whether it is the user's fault
(not worth retrying) or the infrastructure's (retried from the last committed checkpoint).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from trainforge.events import last_event
from trainforge.infra.backends.local import LocalGang, free_port
from trainforge.infra.launch import LaunchSpec, worker_environment
from trainforge.jobconfig import WorkerConfig
from trainforge.registry.jobs import JobRecord

LOG_TAIL_LINES = 20


class SegmentFailed(RuntimeError):
    def __init__(self, message: str, kind: str, rank: int | None):
        super().__init__(message)
        self.kind = kind
        self.rank = rank


class SegmentCancelled(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class SegmentResult:
    attempt: int
    exit_code: int
    duration_s: float
    last_step: int | None
    reason: str | None


# Gangs alive in this process, so a cancel or Ctrl-C can stop every worker (no orphans).
_LIVE: dict[str, LocalGang] = {}
_LIVE_LOCK = threading.Lock()


def terminate_job(job_id: str) -> None:
    with _LIVE_LOCK:
        gang = _LIVE.pop(job_id, None)
    if gang is not None:
        gang.terminate()


def terminate_all() -> None:
    for job_id in list(_LIVE):
        terminate_job(job_id)


atexit.register(terminate_all)


def next_attempt(record: JobRecord) -> int:
    attempts = record.data.get("segments", [])
    return len(attempts)


def run_segment(record: JobRecord, config_path: Path, config: WorkerConfig, *, nproc: int, max_restarts: int,
                extra_env: dict[str, str] | None = None, cancel: threading.Event | None = None) -> SegmentResult:
    attempt = next_attempt(record)
    segments = record.data.get("segments", [])
    segments.append({"attempt": attempt, "started_at": time.time(), "state": "running"})
    record.update(segments=segments, state="running")
    log_dir = record.folder / "logs" / f"segment-{attempt}"
    threads = max(1, (os.cpu_count() or 1) // nproc)
    env = worker_environment(dict(os.environ) | (extra_env or {}), config_path=str(config_path),
                             segment_attempt=attempt, threads_per_worker=threads)
    gang = LocalGang(LaunchSpec(nproc_per_node=nproc, master_port=free_port(), max_restarts=max_restarts,
                                log_dir=str(log_dir)), env, log_dir / "agent.log")
    t0 = time.monotonic()
    gang.start()
    with _LIVE_LOCK:
        _LIVE[config.job_id] = gang
    try:
        while (code := gang.poll()) is None:
            if cancel is not None and cancel.is_set():
                gang.terminate()
                raise SegmentCancelled(f"segment {attempt} of {config.job_id} cancelled; workers stopped")
            time.sleep(0.2)
    except BaseException:
        gang.terminate()
        _finish(record, attempt, "cancelled")
        raise
    finally:
        with _LIVE_LOCK:
            _LIVE.pop(config.job_id, None)
    duration = time.monotonic() - t0
    if code != 0:
        _finish(record, attempt, "failed")
        raise _failure(record, attempt, log_dir, code)
    _finish(record, attempt, "completed")
    end = _last_segment_end(record)
    return SegmentResult(attempt, code, duration, end.get("step"), end.get("reason"))


def _finish(record: JobRecord, attempt: int, state: str) -> None:
    segments = record.data.get("segments", [])
    for seg in segments:
        if seg["attempt"] == attempt:
            seg.update(state=state, ended_at=time.time())
    record.update(segments=segments)


def _last_segment_end(record: JobRecord) -> dict:
    return last_event(record.events_path, "segment_end") or {}


def _failure(record: JobRecord, attempt: int, log_dir: Path, code: int) -> SegmentFailed:
    reports = []
    for path in sorted((record.folder / "failures").glob(f"segment-{attempt}-rank-*.json")):
        try:
            reports.append(json.loads(path.read_text()))
        except ValueError:
            continue
    # The first failure is the root cause; the others are usually peers dying of the lost connection.
    reports.sort(key=lambda r: (r.get("kind") != "user", r.get("time", 0)))
    if reports:
        first = reports[0]
        rank = int(first["rank"])
        tail = _log_tail(log_dir, rank)
        return SegmentFailed(
            f"rank {rank} failed ({first['kind']} error): {first['exception']}\n"
            f"--- last lines of rank {rank}'s log ({_rank_log(log_dir, rank)}) ---\n{tail}",
            first["kind"], rank,
        )
    # No report: the process was killed (signal, OOM killer, lost node) before it could write one.
    rank, signal_text = _killed_rank(log_dir)
    tail = _log_tail(log_dir, rank) if rank is not None else _tail(log_dir / "agent.log")
    who = f"rank {rank}" if rank is not None else "a worker"
    return SegmentFailed(f"{who} died without a report ({signal_text or f'torchrun exit code {code}'}): "
                         f"treated as an infrastructure fault\n--- last lines ---\n{tail}", "infra", rank)


def _rank_log(log_dir: Path, rank: int) -> Path | None:
    found = sorted(log_dir.glob(f"*/attempt_*/{rank}/stderr.log"))
    return found[-1] if found else None


def _tail(path: Path | None, n: int = LOG_TAIL_LINES) -> str:
    if path is None or not path.is_file():
        return "(no log)"
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join(lines[-n:])


def _log_tail(log_dir: Path, rank: int) -> str:
    return _tail(_rank_log(log_dir, rank))


def _killed_rank(log_dir: Path) -> tuple[int | None, str | None]:
    """torchrun's summary names the first failed rank and its exit code / signal."""
    text = _tail(log_dir / "agent.log", 200)
    rank, sig = None, None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("rank") and ":" in line and rank is None:
            with contextlib.suppress(ValueError):
                rank = int(line.split(":", 1)[1].split()[0])
        if ("exitcode" in line or "Signal" in line) and sig is None:
            sig = line
    return rank, sig
