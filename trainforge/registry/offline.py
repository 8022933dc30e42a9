"""The trainer's offline module (evaluation, export) as subprocesses the control plane can stop, per job.

A job winding down (cancelled, or failed past its retries) skips the evaluations still queued; one already
running is a subprocess that could take minutes on a busy host, and nothing will promote its checkpoint. So the
flow stops them (`stopped`): the running ones are killed and new ones refused, and the caller books the checkpoint
without its metrics. Keyed by the job's storage location, which is unique per job and known to every caller.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import Any

Key = tuple[str, str]

_LOCK = threading.Lock()
_RUNNING: dict[Key, set[subprocess.Popen[str]]] = {}
_STOPPING: dict[Key, int] = {}  # a count: two wind-downs of one job may overlap (Ctrl-C during the drain)


class OfflineStopped(RuntimeError):
    """The job is winding down: its offline evaluation or export was stopped, or not started."""


def offline_argv(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "trainforge.trainer.offline", *args]


def refuse_if_stopped(key: Key, what: str) -> None:
    with _LOCK:
        _refuse_locked(key, what)


def _refuse_locked(key: Key, what: str) -> None:
    """OfflineStopped while the job winds down; the caller holds _LOCK."""
    if _STOPPING.get(key):
        raise OfflineStopped(f"offline {what} not started: the job is ending")


def run_offline(key: Key, args: list[str], timeout_s: float, env: Mapping[str, str]) -> dict[str, Any]:
    """The offline module's JSON result (its last stdout line); RuntimeError with its stderr's tail when it fails,
    OfflineStopped when the job's wind-down stopped it."""
    with _LOCK:  # checked and registered at once: a wind-down starting now kills this process
        _refuse_locked(key, args[0])
        # a session of its own: a stop kills what the user's model code started too (its group)
        proc = subprocess.Popen(offline_argv(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=dict(env), start_new_session=True)
        _RUNNING.setdefault(key, set()).add(proc)
    try:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except BaseException:  # a timeout, or Ctrl-C in this thread: the process never outlives its caller
            _kill(proc)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=5)
            raise
    finally:
        with _LOCK:
            running = _RUNNING.get(key, set())
            running.discard(proc)
            if not running:
                _RUNNING.pop(key, None)
            stopping = bool(_STOPPING.get(key))
    if proc.returncode != 0:
        if stopping:
            raise OfflineStopped(f"offline {args[0]} stopped: the job is ending")
        tail = "\n".join(err.splitlines()[-15:])
        raise RuntimeError(f"offline {args[0]} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(out.strip().splitlines()[-1])


def _kill(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the offline process's whole group (its own session: see `run_offline`)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def stopped(key: Key) -> Iterator[None]:
    """While the job winds down: its running offline processes are killed and new ones refused (a download
    between them checks `refuse_if_stopped` per file). An evaluation writes nothing of its own (its caller stores
    the result), and an export writes into a scratch folder renamed into place only once it succeeded
    (registry/checkpoints.py `export_safetensors`), so a kill leaves nothing that reads as valid."""
    with _LOCK:
        _STOPPING[key] = _STOPPING.get(key, 0) + 1
        running = list(_RUNNING.get(key, ()))
    for proc in running:
        _kill(proc)
    try:
        yield
    finally:
        with _LOCK:
            _STOPPING[key] -= 1
            if not _STOPPING[key]:
                del _STOPPING[key]
