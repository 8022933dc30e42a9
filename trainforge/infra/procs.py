"""Process liveness on this host, shared by the server stack (infra/servers.py) and the node sidecar
(infra/backends/sidecar.py)."""

from __future__ import annotations

import os


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
