"""Process liveness and stopping on this host, shared by the server stack (infra/servers.py), the local backend
(infra/backends/local.py), the node agent (infra/backends/node_agent.py) and the node sidecar
(infra/backends/sidecar.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path


def pid_alive(pid: int | None) -> bool:
    """The process exists and is not a zombie (a killed worker stays a zombie until its parent reaps it)."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):  # no /proc entry readable: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def group_alive(pgid: int) -> bool:
    """A process of the group exists that is not a zombie (a zombie is gone for our purpose: its parent has not
    reaped it yet)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().split(")")[-1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def stop_group(proc: subprocess.Popen[bytes] | None, grace_s: float, poll_s: float = 0.05) -> None:
    """SIGTERM the process group `proc` leads, SIGKILL what is left after grace_s; returns once the leader is
    reaped and nothing of its group runs (bounded: grace_s + 5 s + 5 s)."""
    if proc is None:
        return
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if proc.poll() is not None and not group_alive(proc.pid):
                return
            time.sleep(poll_s)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def stop_process(proc: subprocess.Popen[bytes] | None, timeout_s: float) -> None:
    """SIGTERM one process and wait for it to exit on its own (a publisher writing its closing batch); its group
    is SIGKILLed past timeout_s."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_group(proc, 0.0)
