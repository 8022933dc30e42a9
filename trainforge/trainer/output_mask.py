"""A rank's own stdout and stderr, masked before anything writes them down.

torchrun writes each rank's output to files (`--redirects`) and tees it into the agent's log; the platform keeps
both, `logs -f` streams them and failure reports quote them. So the worker masks at the source: before the
user's code is imported it points its file descriptors 1 and 2 at pipes that a small pump process copies to
the real ones through a `StreamMasker` (contract/masking.py) holding every spelling (value, base64, URL
encoding) of the job's secrets, which it knows by their variable names: $TRAINFORGE_MASKED_ENV (the spec's
secrets, set by the flow) plus the object-store secrets. Everything that writes to fd 1/2 is covered: print,
logging, C extensions, subprocesses and data-loader workers that inherit them.

What it cannot cover: a secret the code transforms otherwise (reversed, split, encrypted). A worker that dies
loses nothing: the pump outlives it and writes out what it held.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Mapping

from trainforge.contract.masking import MIN_SECRET_LEN, StreamMasker, mask_stream, spellings

MASKED_ENV = "TRAINFORGE_MASKED_ENV"
ALWAYS_MASKED = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "TRAINFORGE_JOB_S3_SECRET_ACCESS_KEY",
                 "TRAINFORGE_JOB_S3_SESSION_TOKEN")


def masked_values(env: Mapping[str, str]) -> dict[str, str]:
    """{secret value: its variable's name} for every variable $TRAINFORGE_MASKED_ENV names, and the S3 secrets."""
    names = [n.strip() for n in env.get(MASKED_ENV, "").split(",") if n.strip()] + list(ALWAYS_MASKED)
    return {env[n]: n for n in names if len(env.get(n, "")) >= MIN_SECRET_LEN}


class OutputMask:
    """`OutputMask(values).start()` ... `close()`; `mask(text)` for what the worker sends by other routes.

    The pumps run in a small process of their own (`python -m trainforge.trainer.output_mask`), not in a thread
    of the worker: when the worker dies (SIGKILL, a segfault's faulthandler dump, os._exit) its ends of the pipes
    close and the pump still writes out everything, the last lines of a crash included."""

    def __init__(self, values: Mapping[str, str], fds: tuple[int, ...] = (1, 2)):
        self._spellings = spellings(values)
        self.fds = fds
        self._saved: list[tuple[int, int]] = []
        self._proc: subprocess.Popen[bytes] | None = None

    def mask(self, text: str) -> str:
        m = StreamMasker(self._spellings)
        return (m.feed(text.encode()) + m.flush()).decode(errors="replace")

    def start(self) -> OutputMask:
        if not self._spellings or self._proc is not None:
            return self
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        pipes = [os.pipe() for _ in self.fds]
        reads = [r for r, _ in pipes]
        # The pump's own fd 1/2 are the real streams (inherited); it reads the pipes and writes each to its twin.
        self._proc = subprocess.Popen([sys.executable, "-m", __name__, *map(str, reads)], pass_fds=reads,
                                      stdin=subprocess.DEVNULL, env=dict(os.environ))
        for fd, (read_end, write_end) in zip(self.fds, pipes, strict=True):
            self._saved.append((fd, os.dup(fd)))
            os.dup2(write_end, fd)
            os.close(write_end)
            os.close(read_end)
        return self

    def close(self, timeout_s: float = 2.0) -> None:
        """Put the real streams back and let the pump write what it holds. A child that still holds a pipe open
        keeps the pump running after this process exits (it ends with that child): waited for timeout_s."""
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        saved, self._saved = self._saved, []
        for fd, real in saved:
            os.dup2(real, fd)  # closes this process's write end of the pipe: the pump reads EOF
            os.close(real)
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout_s)


def _pump(read_end: int, real: int, values: Mapping[str, str]) -> None:
    # Unbuffered reads (each returns what the pipe holds: a line printed is passed on at once); buffered writes,
    # flushed per chunk by mask_stream, so a short write is never lost.
    # An OSError: the real stream is gone (torchrun's file closed), nothing left to protect.
    with contextlib.suppress(OSError), os.fdopen(read_end, "rb", buffering=0) as source, \
            os.fdopen(real, "wb") as sink:
        mask_stream(source, sink, values)


def _pump_main(argv: list[str]) -> int:
    """The pump process: pipe i -> fd i+1 (stdout, stderr), masked; ends when every writer has closed."""
    values = spellings(masked_values(os.environ))
    threads = [threading.Thread(target=_pump, args=(int(fd), i + 1, values), daemon=True)
               for i, fd in enumerate(argv)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return 0


_CURRENT: OutputMask | None = None


def start_from_env(env: Mapping[str, str] | None = None) -> OutputMask:
    global _CURRENT
    if _CURRENT is None:
        _CURRENT = OutputMask(masked_values(os.environ if env is None else env)).start()
    return _CURRENT


def current() -> OutputMask | None:
    return _CURRENT


def close() -> None:
    """Let the pump write out what it holds before this process exits (no-op when nothing was started)."""
    if _CURRENT is not None:
        _CURRENT.close()


if __name__ == "__main__":
    sys.exit(_pump_main(sys.argv[1:]))
