"""The trainer's offline module (evaluation, export) as subprocesses the control plane can stop, per job.

A job winding down (cancelled, or failed past its retries) skips the evaluations still queued; one already
running is a subprocess that could take minutes on a busy host, and nothing will promote its checkpoint. So the
flow stops them (`stopped`): the running ones are killed and new ones refused, and the caller books the checkpoint
without its metrics. Keyed by the job's storage location, which is unique per job and known to every caller.

Each request runs as a child of this process's warm starter for its environment (trainer/offline_zygote.py: the
offline module imported once, a fork per request, 2.4 s of imports saved each on 2 cores), or, with
TRAINFORGE_OFFLINE_WARM=0 or no starter to be had, as a process of its own; a stop kills either's process group.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Key = tuple[str, str]

_LOCK = threading.Lock()
_RUNNING: dict[Key, set[Any]] = {}  # each a Popen or a warm starter's _Child: what a stop kills (by its pid)
_STOPPING: dict[Key, int] = {}  # a count: two wind-downs of one job may overlap (Ctrl-C during the drain)


class OfflineStopped(RuntimeError):
    """The job is winding down: its offline evaluation or export was stopped, or not started."""


def offline_argv(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "trainforge.trainer.offline", *args]


def zygote_argv() -> list[str]:
    """The warm starter of the offline processes (trainer/offline_zygote.py)."""
    return [sys.executable, "-m", "trainforge.trainer.offline_zygote"]


WARM_ENV = "TRAINFORGE_OFFLINE_WARM"
"""`0`: a plain `python -m trainforge.trainer.offline` per request, no warm starter."""
ZYGOTE_START_S = 120.0
"""How long the warm starter may take to import the offline module (a plain process would have taken as long)."""


def refuse_if_stopped(key: Key, what: str) -> None:
    with _LOCK:
        _refuse_locked(key, what)


def _refuse_locked(key: Key, what: str) -> None:
    """OfflineStopped while the job winds down; the caller holds _LOCK."""
    if _STOPPING.get(key):
        raise OfflineStopped(f"offline {what} not started: the job is ending")


@dataclass(eq=False)
class _Child:
    """A request's child of the warm starter: its pid (its own session's) and its exit once reported."""

    pid: int | None = None
    exit: int | None = None
    forked: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)


class _Zygote:
    """One warm starter for one environment: requests go down its stdin, a reader thread hands out the replies."""

    def __init__(self, env: Mapping[str, str]):
        self.env = dict(env)
        self._closed = threading.Event()
        self.proc = self._spawn()
        self.ready = threading.Event()
        self.dead = False
        self._ids = itertools.count()
        self._children: dict[int, _Child] = {}
        self._send = threading.Lock()
        threading.Thread(target=self._read, name="offline-zygote", daemon=True).start()

    def _spawn(self) -> subprocess.Popen[bytes]:
        """Started from a thread of its own that lives as long as the starter: the starter's PR_SET_PDEATHSIG fires
        when the thread that started it ends, and the caller's (a task runner's pool thread) may end first."""
        started = threading.Event()
        box: dict[str, Any] = {}

        def keep() -> None:
            try:
                box["proc"] = subprocess.Popen(zygote_argv(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                               stderr=subprocess.DEVNULL, env=self.env)
            except BaseException as exc:  # handed to the caller
                box["error"] = exc
            started.set()
            self._closed.wait()

        threading.Thread(target=keep, name="offline-zygote-keeper", daemon=True).start()
        started.wait()
        if "error" in box:
            raise box["error"]
        return box["proc"]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            with contextlib.suppress(ValueError):
                message = json.loads(raw)
                if message.get("ready"):
                    self.ready.set()
                child = self._children.get(message.get("id", -1))
                if child is None:
                    continue
                if "pid" in message:
                    child.pid = int(message["pid"])
                    child.forked.set()
                if "exit" in message:
                    child.exit = int(message["exit"])
                    self._children.pop(message["id"], None)
                    child.done.set()
        self.dead = True  # its children died with it (their PR_SET_PDEATHSIG): each reads as killed
        self.ready.set()
        for child in list(self._children.values()):
            child.forked.set()
            child.done.set()

    def fork(self, args: list[str], env: Mapping[str, str], out: Path, err: Path) -> _Child | None:
        """A child running `args`, forked and known by its pid; None when the starter is not there to fork it."""
        if not self.ready.wait(ZYGOTE_START_S) or self.dead:
            return None
        child = _Child()
        rid = next(self._ids)
        self._children[rid] = child
        request = {"id": rid, "args": args, "env": dict(env), "cwd": os.getcwd(), "stdout": str(out),
                   "stderr": str(err)}
        try:
            with self._send:
                assert self.proc.stdin is not None
                self.proc.stdin.write((json.dumps(request) + "\n").encode())
                self.proc.stdin.flush()
        except (OSError, ValueError):
            self._children.pop(rid, None)
            return None
        child.forked.wait(30.0)
        if child.pid is None:
            self._children.pop(rid, None)
            return None
        return child

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError, ValueError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()  # it kills its children left and exits
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


_ZYGOTES: dict[tuple[tuple[str, str], ...], _Zygote] = {}
_ZYGOTE_LOCK = threading.Lock()


def _zygote(env: Mapping[str, str]) -> _Zygote | None:
    """The warm starter for this environment (started on first use), None when turned off. A process keeps one:
    one for another environment (a test's home) is closed once it has no request in flight, so a module-level
    setting read at import in the offline module is always this environment's."""
    if os.environ.get(WARM_ENV, "1") == "0":
        return None
    key = tuple(sorted(env.items()))
    with _ZYGOTE_LOCK:
        zygote = _ZYGOTES.get(key)
        if zygote is None or zygote.dead:
            for other_key, other in list(_ZYGOTES.items()):
                if other_key != key and not other._children:
                    other.close()
                    del _ZYGOTES[other_key]
            try:
                zygote = _ZYGOTES[key] = _Zygote(env)
            except OSError:
                return None
        return zygote


def close_warm_starters() -> None:
    """Every warm starter of this process closed (its exit, a test session's end)."""
    with _ZYGOTE_LOCK:
        for zygote in _ZYGOTES.values():
            zygote.close()
        _ZYGOTES.clear()


atexit.register(close_warm_starters)


def run_offline(key: Key, args: list[str], timeout_s: float, env: Mapping[str, str]) -> dict[str, Any]:
    """The offline module's JSON result (its last stdout line); RuntimeError with its stderr's tail when it fails,
    OfflineStopped when the job's wind-down stopped it. Run by the warm starter (trainer/offline_zygote.py) when
    there is one for `env`, else as a process of its own."""
    zygote = _zygote(env)
    if zygote is not None:
        with tempfile.TemporaryDirectory(prefix="tf-offline-") as scratch:
            out, err = Path(scratch) / "stdout", Path(scratch) / "stderr"
            with _LOCK:  # checked and registered at once: a wind-down starting now kills this child
                _refuse_locked(key, args[0])
                child = zygote.fork(args, env, out, err)
                if child is not None:
                    _RUNNING.setdefault(key, set()).add(child)
            if child is not None:
                try:
                    if not child.done.wait(timeout_s):
                        raise subprocess.TimeoutExpired(offline_argv(args), timeout_s)
                except BaseException:  # a timeout, or Ctrl-C in this thread: the child never outlives its caller
                    _kill(child)
                    child.done.wait(5.0)
                    raise
                finally:
                    stopping = _forget(key, child)
                code = child.exit if child.exit is not None else -int(signal.SIGKILL)
                return _result(args, code, out.read_text(errors="replace"), err.read_text(errors="replace"),
                               stopping)
    with _LOCK:  # checked and registered at once: a wind-down starting now kills this process
        _refuse_locked(key, args[0])
        # a session of its own: a stop kills what the user's model code started too (its group)
        proc = subprocess.Popen(offline_argv(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=dict(env), start_new_session=True)
        _RUNNING.setdefault(key, set()).add(proc)
    try:
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except BaseException:  # a timeout, or Ctrl-C in this thread: the process never outlives its caller
            _kill(proc)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=5)
            raise
    finally:
        stopping = _forget(key, proc)
    return _result(args, proc.returncode, stdout, stderr, stopping)


def _forget(key: Key, handle: Any) -> bool:
    """`handle` no longer runs for `key`; whether the job is winding down."""
    with _LOCK:
        running = _RUNNING.get(key, set())
        running.discard(handle)
        if not running:
            _RUNNING.pop(key, None)
        return bool(_STOPPING.get(key))


def _result(args: list[str], code: int, out: str, err: str, stopping: bool) -> dict[str, Any]:
    if code != 0:
        if stopping:
            raise OfflineStopped(f"offline {args[0]} stopped: the job is ending")
        tail = "\n".join(err.splitlines()[-15:])
        raise RuntimeError(f"offline {args[0]} failed (exit {code}):\n{tail}")
    return json.loads(out.strip().splitlines()[-1])


def _kill(proc: Any) -> None:
    """SIGKILL the offline process's whole group (its own session: see `run_offline`)."""
    if proc.pid is not None:
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
