"""The Linux process controls several parts need, standard library only (a node agent starts with no torch, an
offline starter before it imports any): prctl's parent-death signal and child subreaper.

Every call is best effort: off Linux, or where prctl is refused, nothing happens and the caller's own fallbacks
(an agent's stdin, a server's atexit hook) still stop what it started."""

from __future__ import annotations

import contextlib
import ctypes

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def prctl(option: int, value: int) -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, value, 0, 0, 0)


def die_with_parent(sig: int) -> None:
    """This process gets `sig` when the thread that started it ends (its parent process's, in practice: so a
    parent must start it from a thread that lives as long as it should run). Safe between fork and exec."""
    prctl(PR_SET_PDEATHSIG, sig)
